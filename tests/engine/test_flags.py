"""Every command accepts both flag spellings (`--a-b`, the one `--help` shows, and `--a_b`, the training commands'
old one)."""

import argparse

import pytest

from modeling_tagclip.cli import parse
from modeling_tagclip.flags import accept_both_spellings, alias


@pytest.mark.parametrize(
    "verb, argv, flag, dest",
    [
        ("index", ["--model", "m", "--images", "i", "--output", "o"], "--batch-size", "batch_size"),
        ("convert", ["hf-clip", "src", "out"], "--num-identities", "num_identities"),
        ("eval", ["--model", "m", "--data", "d"], "--batch-size", "batch_size"),
        ("eval", ["--task", "reid", "--model", "m", "--data", "d"], "--workers", "workers"),
        ("ablate", ["--study", "table5"], "--image-dir", "image_dir"),
        ("train", [], "--eval-batch-size", "eval_batch_size"),
    ],
)
def test_commands_parse_both_spellings_of_the_same_flag(verb, argv, flag, dest):
    underscored = "--" + flag[2:].replace("-", "_")
    assert str(getattr(parse(verb, [*argv, flag, "3"]), dest)) == "3"
    assert str(getattr(parse(verb, [*argv, underscored, "3"]), dest)) == "3"


def test_a_parser_gets_the_other_spelling_of_each_long_flag():
    parser = accept_both_spellings(argparse.ArgumentParser())
    parser.add_argument("--x")  # added after: untouched
    fresh = argparse.ArgumentParser()
    fresh.add_argument("--output-dir")
    fresh.add_argument("--data_dir")
    accept_both_spellings(fresh)
    args = fresh.parse_args(["--output_dir", "a", "--data-dir", "b"])
    assert (args.output_dir, args.data_dir) == ("a", "b")
    with pytest.raises(SystemExit):
        parser.parse_args(["--x_y", "1"])


def test_an_alias_is_hidden_and_parses_to_the_same_action(capsys):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--output", required=True)
    alias(parser, "--output", "--out-dir")
    assert parser.parse_args(["--out_dir", "a"]).output == parser.parse_args(["--out-dir", "a"]).output == "a"
    assert "out" not in parser.format_help().replace("--output", "")
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert "the following arguments are required: --output" in capsys.readouterr().err
