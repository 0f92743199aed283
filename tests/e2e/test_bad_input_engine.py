"""Bad input at ``training/train.py`` arguments: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from bad_input import (
    Context,
    case_id,
    check,
    check_table,
    text_file,
    train_cli,
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- training/train.py arguments
    (
        "train.py",
        lambda c: train_cli(c, "--per_device_batch_size", "0"),
        ValueError,
        "per_device_batch_size must be >= 2",
    ),
    ("train.py", lambda c: train_cli(c, "--batch_szie", "4"), ValueError, "unknown option '--batch_szie'"),
    (
        "train.py",
        lambda c: train_cli(c, "--config", str(c["root"] / "nope.yaml")),
        FileNotFoundError,
        "no config file .*nope.yaml",
    ),
    (
        "train.py",
        lambda c: train_cli(c, "--config", text_file(c, "unk.yaml", "learning_rat: 0.1\n")),
        ValueError,
        "unknown key 'learning_rat'; did you mean 'learning_rate'",
    ),
    (
        "train.py",
        lambda c: train_cli(c, "--data_dir", str(c["root"] / "nodata")),
        FileNotFoundError,
        "data_dir .*nodata does not exist",
    ),
    pytest.param(
        "train.py",
        lambda c: train_cli(c, "--config", text_file(c, "broken.yaml", "learning_rate: [1, 2\n")),
        ValueError,
        "broken.yaml: not valid YAML",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"train.py"}, 6)
