"""Bad input at ``tagclip dtg``: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from bad_input import (
    Context,
    case_id,
    check,
    check_table,
    dtg_cli,
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- tagclip dtg
    (
        "dtg",
        lambda c: dtg_cli("--images", str(c["root"] / "noimg"), "--model", "m", "--out", "o.json"),
        FileNotFoundError,
        "--images: .*noimg is not a directory",
    ),
    (
        "dtg",
        lambda c: dtg_cli("--model", "m", "--out", "o.json"),
        SystemExit,
        "one of the arguments --images --dataset is required",
    ),
    (
        "dtg",
        lambda c: dtg_cli("--images", str(c["images"]), "--model", "m", "--out", "o.json"),
        FileNotFoundError,
        "--model m is not a local model folder",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"dtg"}, 3)
