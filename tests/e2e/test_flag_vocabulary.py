"""Every verb speaks one flag vocabulary (``modeling_tagclip.flags.VOCABULARY``): dashed flags, one name per idea,
and every old spelling (``--output_dir``, ``--out``, ``--amp``, positionals) still parses as it did."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from modeling_tagclip.cli import VERBS, build_parser, parse
from modeling_tagclip.flags import RENAMED, VOCABULARY, visible_flags

# the arguments each verb needs besides the flag under test
BASE = {
    "train": [],
    "eval": ["--model", "m", "--data", "d"],
    "index": ["--model", "m", "--images", "i"],
    "search": [],
    "serve": [],
    "remove": ["some.png"],
    "ingest": [],
    "push": ["--model", "m", "--repo-id", "org/name"],
    "export": ["onnx", "--model", "m", "--output", "o"],
    "convert": ["hf-clip", "--checkpoint", "s", "--output", "o"],
    "dtg": ["--images", "i", "--model", "m", "--output", "o"],
    "ablate": ["--study", "table4"],
}


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and each of its subcommands' parsers."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_verb_is_checked():
    assert set(BASE) == set(VERBS)


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_flag_a_verb_shows_is_dashed_and_in_the_vocabulary(verb):
    flags = visible_flags(build_parser(verb))
    assert flags, verb
    assert [flag for flag in flags if not re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", flag)] == []
    assert [flag for flag in flags if flag not in VOCABULARY] == [], (
        f"tagclip {verb}: flags missing from VOCABULARY"
    )
    assert [flag for flag in flags if flag in RENAMED.get(verb, {})] == [], (
        f"tagclip {verb} shows an old name"
    )


@pytest.mark.parametrize("verb", list(VERBS))
def test_help_shows_no_hidden_alias(verb):
    for parser in _parsers(build_parser(verb)):
        text = parser.format_help()
        assert re.findall(r"--\w*_\w*", text) == [], parser.prog
        for old in RENAMED.get(verb, {}):
            if old not in VOCABULARY:
                assert not re.search(rf"{old}(?![\w-])", text), (parser.prog, old)


def test_one_name_per_idea():
    names: dict[str, list[str]] = {}
    for flag, idea in VOCABULARY.items():
        names.setdefault(idea.lower(), []).append(flag)
    assert {idea: flags for idea, flags in names.items() if len(flags) > 1} == {}
    # an old name is no verb's flag any more, unless it is the word of another idea (train's --model)
    shown = {flag for verb in VERBS for flag in visible_flags(build_parser(verb))}
    for renames in RENAMED.values():
        for old, new in renames.items():
            assert new in VOCABULARY
            assert old in VOCABULARY or old not in shown, old
    assert set(VOCABULARY) <= shown, f"in VOCABULARY but no verb's flag: {set(VOCABULARY) - shown}"


def test_the_named_ideas_have_one_name_in_every_verb():
    """Output, batch size, workers, dtype and device: the five ideas the old spellings split."""
    for verb in VERBS:
        flags = visible_flags(build_parser(verb))
        for old in (
            "--out",
            "--output-dir",
            "--out-dir",
            "--num-workers",
            "--amp",
            "--per-device-batch-size",
        ):
            assert old not in flags, (verb, old)


def _value(action: argparse.Action, other: argparse.Action | None = None) -> list[str]:
    """A value both actions accept (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        shared = [c for c in action.choices if other is None or not other.choices or c in other.choices]
        return [str(shared[-1])]
    value = next(text for text in ("3", "1", "0/2") if _accepts(action, text))
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def _accepts(action: argparse.Action, text: str) -> bool:
    try:
        (action.type or str)(text)
    except (argparse.ArgumentTypeError, ValueError):
        return False
    return True


def _chosen(verb: str) -> argparse.ArgumentParser:
    """The parser (the verb's, or the subcommand ``BASE`` picks) whose flags are tried."""
    parser = build_parser(verb)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[BASE[verb][0]]
    return parser


@pytest.mark.parametrize("verb", list(VERBS))
def test_every_underscore_spelling_parses_to_the_same_destination(verb):
    parser = _chosen(verb)
    base = parse(verb, BASE[verb])
    for flag, action in visible_flags(parser).items():
        if action.dest in ("help",) or "-" not in flag[2:]:
            continue
        old = "--" + flag[2:].replace("-", "_")
        assert parser._option_string_actions[old] is action, (verb, old)
        value = _value(action)
        dashed, underscored = (parse(verb, [*BASE[verb], name, *value]) for name in (flag, old))
        assert getattr(dashed, action.dest) == getattr(underscored, action.dest), (verb, flag)
    assert base is not None


@pytest.mark.parametrize(
    ("verb", "old", "new"),
    [(verb, old, new) for verb, renames in RENAMED.items() for old, new in renames.items()],
)
def test_every_old_name_parses_to_the_same_destination_as_the_new(verb, old, new):
    parser = _chosen(verb)
    action = parser._option_string_actions[new]
    old_action = parser._option_string_actions[old]
    value = _value(action, old_action)
    before = getattr(parse(verb, BASE[verb]), action.dest)
    for spelling in (old, "--" + old[2:].replace("-", "_")):
        assert (
            getattr(parse(verb, [*BASE[verb], spelling, *value]), action.dest)
            == getattr(parse(verb, [*BASE[verb], new, *value]), action.dest)
            != before
        ), (verb, spelling)


def test_eval_amp_maps_its_values_onto_dtype():
    base = BASE["eval"]
    assert [parse("eval", [*base, "--amp", amp]).dtype for amp in ("none", "bf16", "fp16")] == [
        "fp32",
        "bf16",
        "fp16",
    ]
    assert parse("eval", base).dtype == "fp32"


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["export", "onnx", "M", "O"], ["export", "onnx", "--model", "M", "--output", "O"]),
        (["convert", "hf-clip", "S", "O"], ["convert", "hf-clip", "--checkpoint", "S", "--output", "O"]),
        (["convert", "tagpr", "S", "O"], ["convert", "tagpr", "--checkpoint", "S", "--output", "O"]),
        (["convert", "visa", "S", "O"], ["convert", "visa", "--checkpoint", "S", "--output", "O"]),
        (["convert", "vocab", "S", "O"], ["convert", "vocab", "--vocab", "S", "--output", "O"]),
        (
            ["convert", "tagpr", "S", "--output", "O"],
            ["convert", "tagpr", "--checkpoint", "S", "--output", "O"],
        ),
    ],
)
def test_positionals_still_parse_as_the_flags(argv, flags):
    assert parse(argv[0], argv[1:]) == parse(flags[0], flags[1:])


@pytest.mark.parametrize("argv", [["export", "onnx", "M"], ["convert", "visa", "--checkpoint", "S"]])
def test_a_missing_output_is_a_usage_error_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as done:
        parse(argv[0], argv[1:])
    assert done.value.code == 2
    assert "the following arguments are required: --output" in capsys.readouterr().err


def test_every_convert_kind_takes_the_same_form():
    convert = build_parser("convert")
    kinds = next(a for a in convert._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("hf-clip", "tagpr", "visa"):
        assert {"--checkpoint", "--output"} <= set(visible_flags(kinds[name])), name
        assert [
            a.dest for a in kinds[name]._actions if not a.option_strings and a.help != argparse.SUPPRESS
        ] == []


def test_an_unknown_flag_names_the_closest_one(capsys):
    with pytest.raises(SystemExit) as done:
        parse("index", [*BASE["index"], "--batchsize", "3"])
    assert done.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "tagclip index: error: unknown option '--batchsize'; did you mean '--batch-size'?"
    )
