"""The one front door: `tagclip <verb>` for every job, one set of argparse types, recipes by name, `--help` that
shows what runs, and a quiet first run (one-line errors, no launcher traceback, no foreign warnings)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from fixtures import TINY_TRAIN_ARGS

from modeling_tagclip.cli import VERBS, main
from modeling_tagclip.engine.config import (
    RECIPE_DIR,
    TagClipTrainConfig,
    ViSATrainConfig,
    _all_fields,
    build_parser,
    load_config,
    parse_args,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = [
    str(Path(sys.executable).with_name("accelerate")),
    "launch",
    "--config_file",
    str(REPO_ROOT / "training" / "accelerate_config.yaml"),
]
TINY_RUN = [*TINY_TRAIN_ARGS, "--max-steps", "2"]


def _env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
    return {**env, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", **extra}


# ----------------------------------------------------------------------------- the dispatcher


def test_top_level_help_lists_every_verb(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in (
        "train",
        "eval",
        "index",
        "search",
        "serve",
        "remove",
        "push",
        "export",
        "convert",
        "dtg",
        "ablate",
    ):
        assert re.search(rf"^  {verb} +\S", out, re.M), verb
    assert main([]) == 2  # no verb: the same list on stderr, a usage error


def test_an_unknown_verb_is_one_line_with_the_closest_verb(capsys):
    assert main(["serch", "a man"]) == 2
    assert (
        capsys.readouterr().err.strip() == "tagclip: error: unknown command 'serch'; did you mean 'search'?"
    )


HELP_PAGES = [[verb] for verb in VERBS] + [
    ["convert", "visa"],
    ["convert", "vocab"],
    ["convert", "hf-clip"],
    ["convert", "tagpr"],
    ["export", "onnx"],
]


@pytest.mark.parametrize("argv", HELP_PAGES)
def test_every_verb_answers_help_with_a_description_of_every_flag(argv, capsys, monkeypatch):
    parser, out = _help(argv, capsys, monkeypatch)
    assert out.startswith("usage: tagclip " + " ".join(argv)), out[:200]
    undescribed = [
        action.option_strings or action.dest
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert not undescribed, f"tagclip {' '.join(argv)}: flags without a description: {undescribed}"


def _help(argv: list[str], capsys, monkeypatch) -> tuple[argparse.ArgumentParser, str]:
    """(the parser that printed ``tagclip ARGV --help``, what it printed)."""
    shown = []
    print_help = argparse.ArgumentParser.print_help
    monkeypatch.setattr(
        argparse.ArgumentParser,
        "print_help",
        lambda self, file=None: (shown.append(self), print_help(self, file)),
    )
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return shown[-1], capsys.readouterr().out


@pytest.mark.parametrize("argv", HELP_PAGES, ids=lambda argv: " ".join(argv))
def test_every_flag_with_a_default_shows_it_in_help(argv, capsys, monkeypatch):
    from modeling_tagclip.flags import has_default

    parser, out = _help(argv, capsys, monkeypatch)
    flat = " ".join(out.split())  # argparse wraps help text
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or not has_default(action):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert "default" in action.help.lower(), (
            f"tagclip {' '.join(argv)} {name}: no default in {action.help!r}"
        )
        shown = action.help % {"default": action.default, "prog": parser.prog}
        assert " ".join(shown.split()) in flat, f"tagclip {' '.join(argv)} {name}: {shown!r} not in the help"


def test_a_bad_input_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    argv = ["eval", "--model", str(tmp_path / "nomodel"), "--data", str(tmp_path / "nodata")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tagclip eval: error: cannot detect a dataset at ") and err.count("\n") == 1
    monkeypatch.setenv("TAGCLIP_DEBUG", "1")
    with pytest.raises(ValueError, match="cannot detect a dataset"):
        main(argv)


# ----------------------------------------------------------------------------- one set of argparse types

# (the verb and its argv before the value, the flag, where the parsed value lands); every one of them reads "+3" as
# 3, refuses 3.0
INTEGER_FLAGS = [
    (["index", "--model", "m", "--images", "i", "--output", "o"], "--batch-size", "batch_size"),
    (["search", "--index", "i", "q"], "-k", "top_k"),
    (["eval", "--model", "m", "--data", "d"], "--batch_size", "batch_size"),
    (["eval", "--task", "reid", "--model", "m", "--data", "d"], "--num-workers", "workers"),
    (["ablate", "--study", "table4"], "--seeds", "seeds"),
    (["train"], "--stop-after-steps", "stop_after_steps"),
    (["convert", "hf-clip", "a", "b"], "--num-identities", "num_identities"),
]


@pytest.mark.parametrize("argv, flag, dest", INTEGER_FLAGS, ids=lambda x: x if isinstance(x, str) else "")
def test_integer_flags_behave_the_same_in_every_command(argv, flag, dest, capsys):
    from modeling_tagclip.cli import parse

    verb, rest = argv[0], argv[1:]
    assert getattr(parse(verb, [*rest, flag, "+3"]), dest) == 3
    assert getattr(parse(verb, [*rest, flag, " 3 "]), dest) == 3
    for bad in ("3.0", "0x3", "three"):
        with pytest.raises(SystemExit) as done:
            parse(verb, [*rest, flag, bad])
        assert done.value.code == 2 and "integer" in capsys.readouterr().err


def test_export_convert_and_train_use_the_same_integer_type(capsys):
    from modeling_tagclip.cli import parse

    args, _ = parse_args(["--stop_after_steps", "+3"])
    assert args.stop_after_steps == 3
    for run in (
        lambda: main(["export", "onnx", "m", "o", "--opset", "1.5"]),
        lambda: parse("convert", ["tagpr", "c", "o", "--vision-heads", "0"]),
    ):
        with pytest.raises(SystemExit) as done:
            run()
        assert done.value.code == 2 and "must be a positive integer" in capsys.readouterr().err


def test_shared_types_refuse_what_is_not_their_kind():
    from modeling_tagclip.flags import finite_float, fraction, integer, nonnegative_int, positive_int

    assert (
        positive_int("+7"),
        nonnegative_int("0"),
        integer("-2"),
        finite_float("1e-3"),
        fraction("0.25"),
    ) == (7, 0, -2, 1e-3, 0.25)
    for kind, text in (
        (positive_int, "0"),
        (nonnegative_int, "-1"),
        (integer, "1_000"),
        (integer, "٣"),
        (finite_float, "nan"),
        (finite_float, "inf"),
        (fraction, "1.5"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(text)


# ----------------------------------------------------------------------------- recipes by name


def test_a_recipe_by_name_is_the_file_in_the_package(tmp_path):
    by_name = load_config("visa-cargo")
    assert by_name == load_config("visa-cargo.yaml") == load_config(RECIPE_DIR / "visa-cargo.yaml")
    mine = tmp_path / "mine.yaml"  # a path still works, and wins over nothing else
    mine.write_text((RECIPE_DIR / "visa-cargo.yaml").read_text() + "learning_rate: 0.5\n")
    assert load_config(mine).learning_rate == 0.5 != by_name.learning_rate
    with pytest.raises(
        FileNotFoundError, match=r"no config file nope \(shipped recipes: default, tag-pedes, "
    ):
        load_config("nope")


def test_an_unknown_recipe_is_a_usage_error_of_one_line(capsys, tmp_path):
    assert main(["train", "--config", "nope", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("tagclip train: error: no config file nope (shipped recipes: default, ")
        and "\n" not in err
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", ["--list_configs", "--list-configs"])
def test_list_configs_prints_every_shipped_recipe_with_its_values(flag, capsys):
    args, cfg = parse_args([flag])
    assert cfg is None and args.list_configs
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines[:-1] if not line.startswith(" ")]
    assert names == sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    assert lines[0].startswith("default ") and "Small TAG-CLIP" in lines[0] and str(RECIPE_DIR) in lines[-1]
    default = " ".join(lines[1 : next(i for i, line in enumerate(lines[1:], 1) if not line.startswith(" "))])
    words = default.split()
    for word in (
        "task=retrieval",
        "num_train_epochs=6",
        "synthetic.num_identities=435",
        "image_size=[128,64]",
    ):
        assert word in words, word
    recipe = load_config("default")
    for word in words:  # every word is a `--set KEY=VALUE` that gives the recipe's own value
        key, _, value = word.partition("=")
        assert load_config("default", {key: yaml.safe_load(value)}) == recipe, word


# ----------------------------------------------------------------------------- --help shows what runs


def _help_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """--flag -> its help line as printed (whitespace collapsed)."""
    text = re.sub(r"\s+", " ", parser.format_help())
    return {flag: text for flag in re.findall(r" (--\w+) ", text)}


def test_every_training_setting_has_a_description_and_a_real_metavar():
    from modeling_tagclip.engine.flag_help import HELP

    assert set(HELP) == set(_all_fields())  # a new setting needs its line
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 12, action.dest
            assert action.metavar != "VALUE", action.dest


def test_train_help_shows_the_default_recipes_values_not_the_dataclass_defaults():
    text = re.sub(r"\s+", " ", build_parser().format_help())
    tagclip, visa = load_config(None), load_config(None, task="reid")
    assert (
        TagClipTrainConfig().model_selection != tagclip.model_selection
    )  # the recipe differs from the class
    assert (f"[default: {tagclip.model_selection!r}; with --task reid: {visa.model_selection!r}]") in text
    assert (
        f"passes over the training split [default: {tagclip.num_train_epochs}; with --task reid: "
        f"{visa.num_train_epochs}]"
    ) in text
    assert (
        f"peak learning rate [default: {tagclip.learning_rate!r}; with --task reid: {visa.learning_rate!r}]"
        in text
    )
    assert (
        f"--num-instances N K images per identity in a batch (P = batch / K) [default: {visa.num_instances}]"
        in text
    )
    assert ViSATrainConfig().learning_rate != visa.learning_rate


# ----------------------------------------------------------------------------- a quiet, honest run


def test_main_job_ends_with_what_to_do_next():
    from modeling_tagclip.engine.cli import next_steps

    tagclip, visa = load_config(None), load_config(None, task="reid")
    lines = next_steps(tagclip).splitlines()
    assert f"tagclip index --model {tagclip.output_dir}/best --images {tagclip.data_dir}/images" in lines[1]
    assert lines[2].strip().startswith("tagclip search --index gallery-index ")
    assert "ablat" not in next_steps(tagclip)
    assert (
        next_steps(visa)
        == f"next: tagclip eval --task reid --model {visa.output_dir}/best --data {visa.data_dir} --grid grid.png"
    )


def test_export_silences_the_exporters_notes_but_not_errors(caplog):
    from modeling_tagclip.export import quiet_exporter

    note = logging.getLogger("torch.onnx._internal.exporter._registration")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_exporter():
            note.warning("torchvision is not installed. Skipping torchvision::nms")
            logging.getLogger("onnx_ir._convenience").warning("Attribute type is ambiguous")
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
            note.error("a real exporter error")
        warnings.warn("outside the export", FutureWarning, stacklevel=1)
    assert [r.getMessage() for r in caplog.records] == ["a real exporter error"]
    assert [str(w.message) for w in caught] == ["outside the export"]
    assert note.getEffectiveLevel() <= logging.WARNING  # restored afterwards


@pytest.mark.slow
def test_a_flag_typo_under_accelerate_launch_is_one_line(tmp_path):
    """`accelerate launch --config_file training/accelerate_config.yaml -q training/train.py --max_stpes 3`."""
    done = subprocess.run(
        [*ACCELERATE, "-q", "training/train.py", "--max_stpes", "3", "--output_dir", str(tmp_path / "o")],
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip() == "train.py: error: unknown option '--max_stpes'; did you mean '--max_steps'?"
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_tagclip_train_under_accelerate_launch_trains_without_launcher_warnings(tmp_path):
    """`accelerate launch --config_file ... -m modeling_tagclip.cli train` (2 tiny steps): no `--num_processes`
    warning from accelerate, and the run's last lines say what to do next."""
    done = subprocess.run(
        [*ACCELERATE, "-m", "modeling_tagclip.cli", "train", "--output_dir", "out", *TINY_RUN],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "were not passed to `accelerate launch`" not in done.stderr, done.stderr[:2000]
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["best_step"] in (1, 2) and 0 <= results["R@1"] <= 100
    assert done.stdout.rstrip().splitlines()[-1].lstrip().startswith("tagclip search --index gallery-index")
    assert "plots: none" not in done.stdout


def test_commands_load_models_without_a_progress_bar(tmp_path, capfd):
    import torch
    from fixtures import tiny_config
    from transformers.utils import logging as hf_logging

    from modeling_tagclip import TagClipModel, TagClipProcessor
    from modeling_tagclip.cli import _quiet_loading
    from modeling_tagclip.retrieval.loading import load_model

    torch.manual_seed(0)
    TagClipModel(tiny_config()).save_pretrained(tmp_path / "m")
    TagClipProcessor.from_defaults(32, 16).save_pretrained(tmp_path / "m")
    hf_logging.enable_progress_bar()  # the library's default (a `tagclip` call in this process turned it off)
    capfd.readouterr()
    load_model(str(tmp_path / "m"), "cpu", family="tagclip")
    assert "Loading weights" in capfd.readouterr().err
    try:
        _quiet_loading()
        load_model(str(tmp_path / "m"), "cpu", family="tagclip")
    finally:
        hf_logging.enable_progress_bar()
    assert "Loading weights" not in capfd.readouterr().err
