"""One hostile line or request never takes a server down: ``tagclip serve`` answers every bad line with
``{"error": ...}`` and goes on, and the endpoint handler answers every malformed request with a 400/413 error,
bounding the decoded pixels of a whole request from the image headers before decoding any."""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import sys

import pytest
from fixtures import save_tiny_model, synthetic_gallery
from PIL import Image, ImageFile

from handler import EndpointHandler, Limits, PayloadTooLargeError, RequestError, decode_images
from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import index_build

QUERY = "a man in a blue hooded sweatshirt with a brown bag"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(args, model, processor) of ``tagclip serve`` over a small built index."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    model, processor = cli.load_model(str(model_dir))
    index_build.build_index(model, processor, images, root / "idx", batch_size=4, progress=False)
    args = argparse.Namespace(
        index=str(root / "idx"),
        image_root=None,
        top_k=3,
        view=None,
        camera=None,
        after=None,
        before=None,
        tag=None,
        track=None,
        milvus_uri=None,
    )
    return args, model, processor


def _answer(served, line: str) -> dict:
    return json.loads(cli.serve_answer(line, *served))


UNREACHED = (
    argparse.Namespace(
        index="/nonexistent",
        image_root=None,
        top_k=3,
        view=None,
        camera=None,
        after=None,
        before=None,
        tag=None,
        track=None,
        milvus_uri=None,
    ),
    None,
    None,
)  # fmt: skip  (bad lines fail before loading)


BAD_LINES = [
    ('{"query": ' + "[" * 100_000, "nested too deeply"),
    ("{" * 100_000, "not valid JSON|nested too deeply"),
    ('{"query": "a man", "filters": {"tag": ["x"]}}', "tag filter must be a string"),
    ('{"query": "a man", "filters": {"camera": {"a": 1}}}', "camera filter must be"),
    ('{"query": "a man", "filters": {"camera": []}}', "camera filter must be"),
    ('{"query": "a man", "filters": {"camera": [true]}}', "camera filter must be"),
    ('{"query": "a man", "filters": {"view": 1}}', "view filter must be a string"),
    ('{"query": "a man", "filters": {"after": [1]}}', "neither epoch seconds"),
    ('{"query": "a man", "filters": {"after": 1e999}}', "not a finite time"),
    ('{"query": "a man", "filters": "camera=3"}', "filters must be a dict"),
    ('{"query": "a man", "filters": {"colour": "red"}}', "unknown search filter"),
    ('{"query": "a man", "top_k": 1e400}', "top_k must be a positive integer"),
    ('{"query": "a man", "top_k": "3"}', "top_k must be a positive integer"),
    ('{"query": "a man", "top_k": -1}', "top_k must be a positive integer"),
    ('{"query": 5}', 'non-empty "query" string'),
    ('{"query": ["a", "b"]}', 'non-empty "query" string'),
    ('{"query": "a man", "extra": 1}', "unknown request key"),
    ('{"query": "a man"', "not valid JSON"),
    ("{}", 'non-empty "query" string'),
    ('{"query": "a man", "top_k": NaN}', "top_k must be a positive integer"),
    ("[" * 100_000, "nested too deeply"),
    ("null", "must be an object"),
    ("42", "must be an object"),
    (" -1.5e3 ", "must be an object"),
    ("true", "must be an object"),
    ('"a man"', "must be an object"),
    ('["a man"]', "must be an object"),
    ("", 'non-empty "query" string'),
    ("   ", 'non-empty "query" string'),
    (b"caf\xe9 man".decode("utf-8", "surrogateescape"), r"not valid UTF-8 \(byte 0xe9 at character 3\)"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[f"line{i}" for i in range(len(BAD_LINES))])
def test_serve_answers_a_bad_line_with_a_clear_error(line, message):
    answer = _answer(UNREACHED, line)
    assert set(answer) == {"error"}
    assert pytest.importorskip("re").search(message, answer["error"]), answer


@pytest.mark.slow
def test_serve_goes_on_after_bad_lines_and_bounds_a_huge_top_k(served, monkeypatch, capsys):
    lines = [line for line, _ in BAD_LINES[:4]] + [json.dumps({"query": QUERY, "top_k": 10**400}), QUERY]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    capsys.readouterr()
    args = served[0]
    assert cli.main(["serve", "--index", args.index, "-k", "2"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert answers[0]["ready"] is True and all("error" in a for a in answers[1:5])
    assert len(answers[5]["hits"]) == answers[0]["images"]  # top_k 10**400: every image, once
    assert len(answers[6]["hits"]) == 2


@pytest.mark.slow
def test_serve_answers_every_line_an_empty_one_and_json_scalars_included(served, monkeypatch, capsys):
    lines = ["", "null", "42", QUERY, "   ", "3 men in red"]  # a query that starts with a digit is text
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    capsys.readouterr()
    assert cli.main(["serve", "--index", served[0].index, "-k", "2"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()][1:]
    assert len(answers) == len(lines)
    assert [set(a) for a in answers] == [
        {"error"},
        {"error"},
        {"error"},
        {"query", "hits"},
        {"error"},
        {"query", "hits"},
    ]
    assert answers[5]["query"] == "3 men in red" and len(answers[5]["hits"]) == 2


@pytest.mark.slow
def test_serve_drops_an_overlong_line_without_holding_it(served, monkeypatch, capsys):
    huge = "x" * (cli.MAX_LINE_CHARS * 3 + 17)
    assert list(cli.serve_lines(io.StringIO(f"{huge}\nnext\n"))) == [None, "next"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{huge}\n{QUERY}\n"))
    capsys.readouterr()
    assert cli.main(["serve", "--index", served[0].index, "-k", "1"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (
        answers[1] == {"error": f"line over {cli.MAX_LINE_CHARS} characters"} and len(answers[2]["hits"]) == 1
    )


@pytest.mark.slow
def test_serve_survives_invalid_utf8_on_stdin(served, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfe bad bytes\n" + QUERY.encode() + b"\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    capsys.readouterr()
    assert cli.main(["serve", "--index", served[0].index, "-k", "1"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert answers[1] == {"error": "the line is not valid UTF-8 (byte 0xff at character 0)"}
    assert len(answers) == 3 and len(answers[2]["hits"]) == 1  # the next line is answered as usual


# ----------------------------------------------------------------------------- the endpoint handler


@pytest.fixture(scope="module")
def handler(tmp_path_factory):
    return EndpointHandler(str(save_tiny_model(tmp_path_factory.mktemp("endpoint") / "model")))


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


SMALL = _png(
    Image.frombytes("RGB", (16, 32), random.Random(0).randbytes(16 * 32 * 3))
)  # noise: no short zlib
MALFORMED_IMAGES = [
    ("data:image/png;base64" + _b64(SMALL), "data: URI must look like"),
    ("data:image/png," + _b64(SMALL), "data: URI must look like"),
    ("data:", "data: URI must look like"),
    ("not base64 !!", "base64"),
    (_b64(SMALL[: len(SMALL) // 2]), "cannot decode image"),
    (_b64(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"), "cannot decode image"),
    (_b64(b""), "cannot decode image"),
    ({"a": 1}, "unsupported image value"),
    (12, "unsupported image value"),
]


@pytest.mark.parametrize(
    "value, message", MALFORMED_IMAGES, ids=[f"img{i}" for i in range(len(MALFORMED_IMAGES))]
)
def test_handler_answers_a_malformed_image_with_400(value, message):
    with pytest.raises(RequestError, match=message) as info:
        decode_images([value], Limits())
    assert info.value.status == 400


def test_request_pixels_are_bounded_from_headers_before_any_decoding(monkeypatch):
    """Eight 10 Mpx images (a few KB each, inside every per-image limit) exceed the per-request bound; no pixel
    is decoded to find out."""
    big = _b64(_png(Image.new("1", (4000, 2500))))
    decoded = []
    real = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real(self))
    limits = Limits()
    with pytest.raises(PayloadTooLargeError, match="8 images of 80000000 pixels.*max_request_pixels") as info:
        decode_images([big] * 8, limits)
    assert info.value.status == 413 and decoded == []
    assert len(decode_images([big] * 6, limits)) == 6 and len(decoded) == 6  # 60 Mpx fit the 64 Mpx bound
    with pytest.raises(PayloadTooLargeError, match="max_request_pixels"):
        decode_images([big] * 2, limits._replace(max_request_pixels=15_000_000))


def _nested(depth: int) -> list:
    """``[[[...]]]`` ``depth`` deep, built without recursion (as a JSON parser with no depth limit returns it)."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


DEEP = _nested(100_000)
DEEP_REQUESTS = [
    (DEEP, 400, "must be a JSON object"),
    ({"inputs": DEEP}, 400, "'inputs' must be a text, an image or an object"),
    ({"inputs": {"text": DEEP}}, 400, "text 0 must be a non-empty string, got a list of 1 item"),
    ({"inputs": {"text": ["a man", DEEP]}}, 400, "text 1 must be a non-empty string, got a list of 1 item"),
    ({"inputs": {"images": [DEEP]}}, 400, "unsupported image value"),
    (
        {"inputs": "a man", "parameters": {"top_k": DEEP}},
        400,
        "'top_k' must be a positive integer, got a list",
    ),
    ({"inputs": {"query": "a man"}, "parameters": {"filters": {"camera": DEEP}}}, 400, "gallery"),
    ({"inputs": {"text": "x" * 50_000_000}}, 413, "max_text_chars"),
]


@pytest.mark.parametrize(
    "request_, status, message", DEEP_REQUESTS, ids=[f"deep{i}" for i in range(len(DEEP_REQUESTS))]
)
def test_handler_answers_deeply_nested_and_huge_requests_with_an_error(handler, request_, status, message):
    with pytest.raises(RequestError, match=message) as info:
        handler(request_)
    assert info.value.status == status and len(str(info.value)) < 400


def test_handler_runs_folder_code_only_with_opt_in(tmp_path, monkeypatch):
    import handler as module

    monkeypatch.delenv("TAGCLIP_TRUST_REMOTE_CODE", raising=False)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "tagclip", "auto_map": {"AutoModel": "m.M"}})
    )
    assert module.trust_remote_code_for(str(tmp_path)) is False  # the installed package serves it
    monkeypatch.setattr(module, "CONFIG_MAPPING", {})
    monkeypatch.setitem(sys.modules, "modeling_tagclip", None)  # as on a machine without the package
    with pytest.raises(RuntimeError, match="needs the modeling_tagclip package.*TAGCLIP_TRUST_REMOTE_CODE=1"):
        module.trust_remote_code_for(str(tmp_path))
    monkeypatch.setenv("TAGCLIP_TRUST_REMOTE_CODE", "1")
    assert module.trust_remote_code_for(str(tmp_path)) is True
    with pytest.raises(RuntimeError, match="needs the modeling_tagclip package"):
        module.trust_remote_code_for(str(tmp_path), opt_in=False)  # the argument wins over the environment


# ----------------------------------------------------------------------------- fuzz


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "none", "list", "dict", "huge", "nested"]
    kind = rng.choice(kinds if depth < 3 else kinds[:5])
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return rng.choice([float("nan"), float("inf"), -0.0, rng.random() * 1e308])
    if kind == "str":
        return "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 40)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        keys = ["query", "top_k", "filters", "view", "camera", "after", "before", "tag", "x"]
        return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "huge":
        return 10 ** rng.randint(20, 400)
    return json.loads("[" * 50 + "]" * 50)


def _malformed_line(rng: random.Random) -> str:
    """A serve line that is a malformed request: starts with '{' and is broken JSON, or has a bad field."""
    choice = rng.randrange(6)
    if choice == 0:
        return "{" + "".join(rng.choice('[]{}":,0123456789truefalsnul ') for _ in range(rng.randint(0, 200)))
    if choice == 1:
        return '{"query": ' + "[" * rng.randint(1000, 200_000)
    if choice == 2:
        key = rng.choice(["view", "camera", "after", "before", "tag"])
        return json.dumps(
            {"query": "a man", "filters": {key: rng.choice([{"a": 1}, [], [[1]], True, [None]])}}
        )
    if choice == 3:
        return json.dumps({"query": rng.choice([None, 5, [], {}, "", "   ", ["a"], 1e400]), "top_k": 1})
    if choice == 4:
        return json.dumps({"query": "a man", "top_k": rng.choice([0, -5, 2.5, "7", None, [3], 1e400, True])})
    return json.dumps({"query": "a man", rng.choice(["Query", "k", "filter", "extra"]): _random_value(rng)})


def _malformed_request(rng: random.Random):
    """A handler request body that is malformed (bad shape, bad types, bad or oversized images)."""
    choice = rng.randrange(8)
    if choice == 0:
        return _random_value(rng) if rng.random() < 0.5 else [1, 2]
    if choice == 1:
        return {
            "inputs": {
                "images": [rng.choice(["data:", "data:x", "%%%", _b64(rng.randbytes(rng.randint(0, 300)))])]
            }
        }
    if choice == 2:
        cut = rng.randint(
            0, len(SMALL) - 24
        )  # into the pixels (without IEND, CRC or Adler-32 alone it decodes)
        return {"inputs": {"image": _b64(SMALL[:cut])}}
    if choice == 3:
        return {"inputs": {"text": rng.choice(["", [""], [1], {"a": 1}, ["ok", None], "x" * 5000])}}
    if choice == 4:
        return {
            "inputs": {"text": "a man", "images": [_b64(SMALL)]},
            "parameters": {"top_k": rng.choice([0, -1, 2.5, "3", None, True, [1], 1e400])},
        }
    if choice == 5:
        return {"inputs": {rng.choice(["img", "texts", "Image"]): "x"}}
    if choice == 6:
        return {
            "inputs": {"images": []} if rng.random() < 0.5 else {"image": SMALL_B64, "images": [SMALL_B64]}
        }
    return {"inputs": {"images": [HUGE_B64] * 2}}


SMALL_B64 = _b64(SMALL)
HUGE_B64 = _b64(_png(Image.new("1", (9000, 9000))))  # 81 Mpx in a few KB: over the per-image limit


@pytest.mark.slow
def test_fuzz_1000_malformed_requests_against_serve_and_the_handler(served, handler):
    """1,000 random malformed serve lines and 1,000 malformed handler requests: every answer is an error, and
    the process's resident memory stays within 200 MB of where it started."""
    rng = random.Random(22)
    start = _rss_bytes()
    peak = start
    for i in range(1000):
        answer = _answer(served, _malformed_line(rng))
        assert set(answer) == {"error"} and answer["error"], answer
        request = _malformed_request(rng)
        with pytest.raises(RequestError) as info:
            handler(request)
        assert info.value.status in (400, 413) and str(info.value)
        if i < 40:  # the malformed images also through the handler
            with pytest.raises(RequestError):
                handler({"inputs": {"images": [MALFORMED_IMAGES[i % len(MALFORMED_IMAGES)][0]]}})
        if i % 50 == 0:
            peak = max(peak, _rss_bytes())
    assert max(peak, _rss_bytes()) - start < 200 * 2**20
