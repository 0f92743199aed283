"""Bad input at ``tagclip eval``: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from bad_input import (
    Context,
    case_id,
    check,
    check_table,
    evaluate_cli,
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- tagclip eval
    (
        "evaluate",
        lambda c: evaluate_cli("--model", str(c["root"] / "nomodel")),
        SystemExit,
        "the following arguments are required: --data",
    ),
    (
        "evaluate",
        lambda c: evaluate_cli("--model", str(c["model_dir"]), "--data", str(c["root"] / "nodata")),
        ValueError,
        "cannot detect a dataset at .*nodata",
    ),
    (
        "evaluate",
        lambda c: evaluate_cli(
            "--model", str(c["root"] / "nomodel"), "--data", str(c["data"]), "--split", "test"
        ),
        ValueError,
        "model folder .*nomodel does not exist",
    ),
    (
        "evaluate",
        lambda c: evaluate_cli("--model", str(c["model_dir"]), "--data", str(c["data"]), "--split", "nosuch"),
        ValueError,
        "unknown split 'nosuch'",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"evaluate"}, 4)
