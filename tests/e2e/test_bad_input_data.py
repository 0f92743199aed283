"""Bad input at the annotation loaders: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from bad_input import (
    Context,
    anno_folder,
    case_id,
    check,
    check_table,
    entry_json,
    load_tagpedes_folder,
)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- annotation loaders
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "json", '[{"id": 1,, }]')),
        ValueError,
        r"train_reid.json: invalid JSON at line 1, column 11",
    ),
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "float-id", entry_json(id=3.7))),
        ValueError,
        r"has no integer 'id' \(got 3.7\)",
    ),
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "str-id", entry_json(id="7b"))),
        ValueError,
        "has no integer 'id' \\(got '7b'\\)",
    ),
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "escape", entry_json(file_path="../../etc/passwd"))),
        ValueError,
        "points outside the image folder",
    ),
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "absolute", entry_json(file_path="/etc/passwd"))),
        ValueError,
        "points outside the image folder",
    ),
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "captions", entry_json(captions=[]))),
        ValueError,
        "empty or invalid captions",
    ),
    (
        "loader",
        lambda c: load_tagpedes_folder(anno_folder(c, "object", '{"id": 1}')),
        ValueError,
        "expected a JSON list of entries, got dict",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"loader"}, 7)
