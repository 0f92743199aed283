"""Every command accepts both flag spellings (`--a_b`, the training commands' one, and `--a-b`)."""

import importlib

import pytest

from modeling_tagclip.flags import accept_both_spellings

PARSERS = [
    ("modeling_tagclip.retrieval.cli", "_parser", ["index", "--model", "m", "--images", "i", "--out", "o"]),
    ("modeling_tagclip.convert.arguments", "convert_parser", ["hf-clip", "src", "out"]),
]


@pytest.mark.parametrize("module, factory, argv", PARSERS)
def test_subcommand_flags_answer_to_both_spellings(module, factory, argv):
    parser = getattr(importlib.import_module(module), factory)()
    flag = "--batch-size" if "retrieval" in module else "--num-identities"
    dest = flag[2:].replace("-", "_")
    for spelling in (flag, flag.replace("-", "_").replace("__", "--", 1)):
        assert getattr(parser.parse_args([*argv, spelling, "3"]), dest) == 3


@pytest.mark.parametrize(
    "module, argv, dest",
    [
        (
            "modeling_tagclip.evaluation.arguments:parse_retrieval_args",
            ["--model", "m", "--data", "d", "--batch-size", "3"],
            "batch_size",
        ),
        (
            "modeling_tagclip.evaluation.arguments:parse_reid_args",
            ["--model", "m", "--data", "d", "--batch-size", "3"],
            "batch_size",
        ),
        ("modeling_tagclip.ablation.runner", ["--study", "table5", "--image-dir", "3"], "image_dir"),
    ],
)
def test_commands_parse_both_spellings_of_the_same_flag(module, argv, dest):
    module, _, function = module.partition(":")
    mod = importlib.import_module(module)
    parse = getattr(mod, function or "parse_args")
    flag = next(a for a in argv if a.startswith("--") and "-" in a[2:])
    other = [a.replace("-", "_").replace("__", "--", 1) if a == flag else a for a in argv]
    assert str(getattr(parse(argv), dest)) == str(getattr(parse(other), dest)) == "3"


def test_a_parser_gets_the_other_spelling_of_each_long_flag():
    import argparse

    parser = accept_both_spellings(argparse.ArgumentParser())
    parser.add_argument("--x")  # added after: untouched
    fresh = argparse.ArgumentParser()
    fresh.add_argument("--output-dir")
    fresh.add_argument("--data_dir")
    accept_both_spellings(fresh)
    args = fresh.parse_args(["--output_dir", "a", "--data-dir", "b"])
    assert (args.output_dir, args.data_dir) == ("a", "b")
