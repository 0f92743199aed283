"""Bad input at ``tagclip index/search``, the endpoint handler, the demo's query function and the retrieval pipeline: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch
from bad_input import (
    Context,
    b64,
    case_id,
    check,
    check_table,
    index_cli,
    run_pipeline,
    search_cli,
    tagclip_cli,
)
from PIL import Image


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- tagclip index / search
    (
        "tagclip index",
        lambda c: index_cli(c, "--out", str(c["root"] / "i1"), "--batch-size", "0"),
        SystemExit,
        "--batch-size: must be a positive integer, got '0'",
    ),
    (
        "tagclip index",
        lambda c: index_cli(c, "--out", str(c["root"] / "i2"), "--batch-size", "-4"),
        SystemExit,
        "must be a positive integer, got '-4'",
    ),
    (
        "tagclip index",
        lambda c: index_cli(c, "--out", str(c["root"] / "i3"), "--shard-size", "0"),
        SystemExit,
        "--shard-size: must be a positive integer",
    ),
    (
        "tagclip index",
        lambda c: index_cli(c, "--out", str(c["root"] / "i4"), "--workers", "-1"),
        SystemExit,
        "must be a non-negative integer, got '-1'",
    ),
    (
        "tagclip index",
        lambda c: index_cli(c, "--out", str(c["root"] / "i5"), "--dtype", "fp8"),
        SystemExit,
        "invalid choice: 'fp8'",
    ),
    (
        "tagclip index",
        lambda c: tagclip_cli(
            "index",
            "--model",
            str(c["root"] / "nomodel"),
            "--images",
            str(c["images"]),
            "--out",
            str(c["root"] / "i6"),
        ),
        SystemExit,
        "model folder .*nomodel does not exist",
    ),
    (
        "tagclip search",
        lambda c: search_cli(c, "--index", str(c["root"] / "noidx"), "-k", "0", "a man"),
        SystemExit,
        "-k/--top-k: must be a positive integer, got '0'",
    ),
    (
        "tagclip search",
        lambda c: search_cli(c, "--index", str(c["root"] / "noidx"), "-k", "-1", "a man"),
        SystemExit,
        "must be a positive integer, got '-1'",
    ),
    (
        "tagclip search",
        lambda c: search_cli(c, "--index", str(c["root"] / "noidx"), "a man"),
        SystemExit,
        "no gallery index at .*noidx",
    ),
    (
        "tagclip search",
        lambda c: search_cli(c, "--index", "x", "--view", "sky", "a man"),
        SystemExit,
        "invalid choice: 'sky'",
    ),
    # ---- endpoint handler
    ("handler", lambda c: c["handler"](["a list"]), ValueError, "must be a JSON object"),
    (
        "handler",
        lambda c: c["handler"]({"inputs": 42}),
        ValueError,
        "'inputs' must be a text, an image or an object",
    ),
    ("handler", lambda c: c["handler"]({"inputs": {"txt": "a man"}}), ValueError, r"unknown keys \['txt'\]"),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"text": ["a man", 3]}}),
        ValueError,
        "text 1 must be a non-empty string",
    ),
    ("handler", lambda c: c["handler"]({"inputs": {"text": []}}), ValueError, "'texts' is an empty list"),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"image": "not base64 !!"}}),
        ValueError,
        "must be a base64 string",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"image": base64.b64encode(b"nope").decode()}}),
        ValueError,
        "cannot decode image",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"image": 3}}),
        ValueError,
        "unsupported image value of type int",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"image": "x", "images": ["x"]}}),
        ValueError,
        "either 'image' or 'images'",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"images": [b64(Image.new("RGB", (4, 4)))] * 65}}),
        ValueError,
        "65 images in one request; the limit is 64",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": {"image": base64.b64encode(c["bomb"].read_bytes()).decode()}}),
        ValueError,
        "400000000 pixels",
    ),
    (
        "handler",
        lambda c: c["handler"](
            {
                "inputs": {"text": "a man", "images": [b64(Image.new("RGB", (4, 4)))]},
                "parameters": {"top_k": 0},
            }
        ),
        ValueError,
        "'top_k' must be a positive integer, got 0",
    ),
    (
        "handler",
        lambda c: c["handler"](
            {
                "inputs": {"text": "a man", "images": [b64(Image.new("RGB", (4, 4)))]},
                "parameters": {"top_k": -3},
            }
        ),
        ValueError,
        "got -3",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": "a man", "parameters": [5]}),
        ValueError,
        "'parameters' must be an object, got list",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": "a man", "parameters": {"top": 5}}),
        ValueError,
        r"unknown parameters \['top'\]",
    ),
    (
        "handler",
        lambda c: c["handler"]({"inputs": "a " * 1500}),
        ValueError,
        "3000 characters; the limit is 2000",
    ),
    (
        "handler",
        lambda c: __import__("handler").EndpointHandler(str(c["model_dir"]), dtype="int8"),
        ValueError,
        "unknown dtype 'int8'",
    ),
    # ---- the demo's query function
    (
        "demo",
        lambda c: __import__("app").run_query(c["searcher"], "a man", 0),
        ValueError,
        "integer from 1 to 50, got 0",
    ),
    ("demo", lambda c: __import__("app").run_query(c["searcher"], "a man", -3), ValueError, "got -3"),
    ("demo", lambda c: __import__("app").run_query(c["searcher"], "a man", 500), ValueError, "got 500"),
    (
        "demo",
        lambda c: __import__("app").run_query(c["searcher"], "x" * 5000, 5),
        ValueError,
        "5000 characters; the limit is 1000",
    ),
    (
        "demo",
        lambda c: __import__("app").run_query(c["searcher"], "a man", 5, "sideways"),
        ValueError,
        "unknown view filter 'sideways'",
    ),
    (
        "demo",
        lambda c: __import__("app").run_query(c["searcher"], None, 5),
        ValueError,
        "description must be text, got NoneType",
    ),
    (
        "demo",
        lambda c: __import__("app").run_query(c["searcher"], "!!!", 5),
        ValueError,
        "empty after cleaning",
    ),
    # ---- the retrieval pipeline
    (
        "pipeline",
        lambda c: run_pipeline(c, "a man", gallery=str(c["images"]), top_k=0),
        ValueError,
        "top_k must be a positive integer, got 0",
    ),
    (
        "pipeline",
        lambda c: run_pipeline(c, "a man", gallery=str(c["images"]), top_k="3"),
        ValueError,
        "got '3'",
    ),
    ("pipeline", lambda c: run_pipeline(c, "a man"), ValueError, "no gallery"),
    (
        "pipeline",
        lambda c: run_pipeline(c, "a man", gallery=str(c["root"] / "nowhere")),
        FileNotFoundError,
        "neither an image, a folder nor an index",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"tagclip index", "handler", "tagclip search", "pipeline", "demo"}, 38)


def test_16_bit_image_encodes_like_its_8_bit_equivalent(ctx):
    """Gallery/index encoding (encode_images) and the processor agree on a 16-bit image (was all white)."""
    from modeling_tagclip.retrieval.encode import encode_images

    path16, path8 = ctx["root"] / "grey16.png", ctx["root"] / "grey8.png"
    Image.new("I;16", (16, 32), 40000).save(path16)
    Image.new("L", (16, 32), 156).save(path8)
    a, b = (encode_images(ctx["model"], ctx["processor"], [p]) for p in (path16, path8))
    torch.testing.assert_close(a["global"], b["global"])
