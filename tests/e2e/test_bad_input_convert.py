"""Bad input at both converters: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from bad_input import (
    Context,
    case_id,
    check,
    check_table,
    convert_cli,
    convert_visa_cli,
    text_file,
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- converters
    (
        "convert",
        lambda c: convert_cli("tagpr", str(c["root"] / "nope.pth"), str(c["root"] / "o1")),
        FileNotFoundError,
        "checkpoint not found: .*nope.pth",
    ),
    (
        "convert",
        lambda c: convert_cli("tagpr", text_file(c, "garbage.pth", "garbage"), str(c["root"] / "o2")),
        ValueError,
        "corrupt checkpoint .*garbage.pth",
    ),
    (
        "convert",
        lambda c: convert_cli("hf-clip", str(c["root"] / "no-clip"), str(c["root"] / "o3")),
        FileNotFoundError,
        "no transformers CLIPModel folder .*no-clip",
    ),
    (
        "convert",
        lambda c: convert_cli("hf-clip", "x", "y", "--block-type", "mlp"),
        SystemExit,
        "invalid choice: 'mlp'",
    ),
    (
        "convert visa",
        lambda c: convert_visa_cli("--checkpoint", str(c["root"] / "nope.pth"), "--output", "o"),
        FileNotFoundError,
        "checkpoint not found: .*nope.pth",
    ),
    (
        "convert visa",
        lambda c: convert_visa_cli(
            "--checkpoint", text_file(c, "g.pth", "x"), "--output", "o", "--config", "{bad"
        ),
        ValueError,
        "--config is not valid JSON",
    ),
    (
        "convert visa",
        lambda c: convert_visa_cli("--output", "o"),
        SystemExit,
        "the following arguments are required: --checkpoint",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"convert visa", "convert"}, 7)
