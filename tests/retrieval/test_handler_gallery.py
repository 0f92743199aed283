"""The endpoint handler serving a gallery: a Milvus Lite collection and the embedded index give the same
answers as a direct search of the embedded exact index, for every filter and for queries by hit id and track;
configuration and bad requests."""

from __future__ import annotations

import json

import pytest
from fixtures import save_tiny_model, synthetic_gallery

from handler import EndpointHandler, Limits, PayloadTooLargeError, RequestError

pytest.importorskip("pymilvus")  # the milvus extra; CI installs it

QUERIES = ["a man in a red coat", "a woman with a backpack", "a child in blue jeans"]
FILTERS = [
    None,
    {"view": "aerial"},
    {"view": "ground"},
    {"camera": ["c0", "c2"]},
    {"tag": 'x"y'},
    {"after": "2026-01-01T10:03", "before": "2026-01-01T10:11", "view": "ground"},
]


def _metadata(root) -> dict[str, dict]:
    from modeling_tagclip.retrieval.embedded.gallery_index import list_images

    records = {}
    for i, path in enumerate(list_images(root)):
        records[path.relative_to(root).as_posix()] = {
            "view": ("aerial", "ground")[i % 2],
            "camera": f"c{i % 3}",
            "timestamp": f"2026-01-01T10:{i:02d}",
            "tags": ['x"y'] if i % 3 == 1 else None,
            "track": f"t{i // 4}",
        }
    return records


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One gallery built into an embedded exact index and a Milvus Lite FLAT collection; a handler on each."""
    from modeling_tagclip.retrieval.cli import load_model
    from modeling_tagclip.retrieval.embedded.index_build import build_index
    from modeling_tagclip.retrieval.milvus import index_into_milvus

    tmp = tmp_path_factory.mktemp("handler_gallery")
    folder = save_tiny_model(tmp / "model")
    model, processor = load_model(str(folder))
    root = synthetic_gallery(tmp / "data")
    metadata = _metadata(root)
    embedded = build_index(model, processor, root, tmp / "index", progress=False, metadata=metadata)
    uri = str(tmp / "gallery.db")
    assert index_into_milvus(model, processor, root, uri, "g", metadata=metadata) == len(embedded) == 20
    lite = EndpointHandler(str(folder), gallery=uri, collection="g")
    yield {
        "folder": folder,
        "model": model,
        "processor": processor,
        "embedded": embedded,
        "uri": uri,
        "lite": lite,
        "index_dir": str(tmp / "index"),
        "index": EndpointHandler(str(folder), gallery=str(tmp / "index")),
    }
    lite.gallery.close()


def _same(expected: list[list[dict]], answer: list[dict]) -> None:
    assert [row["query"] for row in answer] == QUERIES
    for hits, row in zip(expected, answer, strict=True):
        assert [h["path"] for h in row["hits"]] == [h["path"] for h in hits]
        for want, got in zip(hits, row["hits"], strict=True):
            assert abs(want["score"] - got["score"]) <= 1e-5
            keys = ("rank", "view", "camera", "timestamp", "tags")
            assert {k: got[k] for k in keys} == {k: want[k] for k in keys}


@pytest.mark.slow
def test_a_milvus_gallery_answers_as_the_embedded_index_for_every_filter(served):
    from modeling_tagclip.retrieval.encode import encode_texts

    query = encode_texts(served["model"], served["processor"], QUERIES)
    returned = 0
    for filters in FILTERS:
        expected = served["embedded"].search(query, 5, filters)
        request = {"inputs": {"query": QUERIES}, "parameters": {"top_k": 5, "filters": filters}}
        for name in ("lite", "index"):
            answer = served[name](request)
            _same(expected, answer)
            json.dumps(answer, allow_nan=False)
        returned += sum(map(len, expected))
    assert returned > 3 * 5 * 4  # the filters select real subsets, and differing ones
    one = served["lite"]({"inputs": {"query": QUERIES[0]}})  # one query, the default top_k
    assert len(one) == 1 and len(one[0]["hits"]) == 10


@pytest.mark.slow
def test_the_gallery_comes_from_the_environment_and_another_model_is_refused(served, monkeypatch, tmp_path):
    from modeling_tagclip.retrieval.embedded.index_store import GalleryIndexError

    monkeypatch.setenv("TAGCLIP_GALLERY", served["uri"])
    monkeypatch.setenv("TAGCLIP_COLLECTION", "g")
    by_env = EndpointHandler(str(served["folder"]))
    try:
        request = {"inputs": {"query": QUERIES}, "parameters": {"filters": {"view": "aerial"}}}
        _same([row["hits"] for row in served["index"](request)], by_env(request))
    finally:
        by_env.gallery.close()
    other = save_tiny_model(tmp_path / "other", seed=1)
    with pytest.raises(GalleryIndexError, match="different model"):
        EndpointHandler(str(other))
    monkeypatch.setenv("TAGCLIP_COLLECTION", "")
    with pytest.raises(ValueError, match="name the collection"):
        EndpointHandler(str(served["folder"]))


@pytest.mark.slow
def test_hit_ids_and_tracks_are_queries_on_both_galleries(served):
    from modeling_tagclip.retrieval.encode import encode_texts
    from modeling_tagclip.retrieval.queries import example_embeddings, person_search

    first = served["index"]({"inputs": {"query": QUERIES[0]}, "parameters": {"top_k": 1}})[0]["hits"][0]
    for inputs, parameters in (
        ({"like": first["id"]}, {}),
        ({"track": "c1:t1"}, {}),  # crops 4 and 7
        (
            {"query": QUERIES[:2], "like": [first["id"]], "track": ["c1:t1"]},
            {"text_weight": 0.3, "set_rule": "max"},
        ),
    ):
        like, track = (
            [v] if isinstance(v, str) else v for v in (inputs.get("like", []), inputs.get("track", []))
        )
        crops = example_embeddings(served["embedded"], like, track)
        texts = (
            encode_texts(served["model"], served["processor"], inputs["query"]) if "query" in inputs else None
        )
        rule, weight = parameters.get("set_rule", "mean"), parameters.get("text_weight", 0.5)
        expected = person_search(served["embedded"], texts, crops, 5, None, weight, rule)
        request = {"inputs": inputs, "parameters": {"top_k": 5, **parameters}}
        for name in ("lite", "index"):
            answer = served[name](request)
            assert len(answer) == len(expected)
            for hits, row in zip(expected, answer, strict=True):
                assert [h["id"] for h in row["hits"]] == [h["id"] for h in hits]
                assert [h["score"] for h in row["hits"]] == pytest.approx(
                    [h["score"] for h in hits], abs=1e-5
                )
    assert served["lite"]({"inputs": {"like": first["id"]}})[0]["query"] == f"like {first['id']}"
    assert served["lite"]({"inputs": {"like": first["id"]}})[0]["hits"][0]["id"] == first["id"]


@pytest.mark.slow
def test_bad_gallery_requests_are_clear_errors(served):
    index = served["index"]
    cases = [
        ({"inputs": {"query": "a man", "text": "a man"}}, RequestError, "without 'text'"),
        ({"inputs": {"query": "a man"}, "parameters": {"filters": {"view": "sky"}}}, RequestError, "view"),
        (
            {"inputs": {"query": "a man"}, "parameters": {"filters": {"colour": "red"}}},
            RequestError,
            "colour",
        ),
        ({"inputs": {"query": "a man"}, "parameters": {"filters": "aerial"}}, RequestError, "filters"),
        ({"inputs": {"query": "a man"}, "parameters": {"top_k": 0}}, RequestError, "top_k"),
        ({"inputs": {"query": "a man"}, "parameters": {"top_k": 1001}}, PayloadTooLargeError, "max_top_k"),
        ({"inputs": {"query": [""]}}, RequestError, "non-empty"),
        ({"inputs": {"query": []}}, RequestError, "empty list"),
        (
            {"inputs": "a man", "parameters": {"filters": {"view": "aerial"}}},
            RequestError,
            "gallery searches",
        ),
        ({"inputs": {"like": "0" * 16}}, RequestError, f"no crop with hit id {'0' * 16}"),
        ({"inputs": {"like": "xyz"}}, RequestError, "'xyz' is not a hit id"),
        ({"inputs": {"track": "c0:t99"}}, RequestError, "no track c0:t99"),
        ({"inputs": {"track": "t1"}}, RequestError, "a track is CAMERA:TRACK"),
        ({"inputs": {"like": 5}}, RequestError, "'like' must be a string or a list"),
        ({"inputs": {"track": "c1:t1", "image": "x"}}, RequestError, "without 'text' or 'image"),
        (
            {"inputs": {"track": "c1:t1"}, "parameters": {"set_rule": "median"}},
            RequestError,
            "'set_rule' must",
        ),
        (
            {"inputs": {"track": "c1:t1"}, "parameters": {"text_weight": 2}},
            RequestError,
            "'text_weight' must",
        ),
        ({"inputs": "a man", "parameters": {"set_rule": "max"}}, RequestError, "gallery searches"),
    ]
    for request, kind, words in cases:
        with pytest.raises(kind, match=words):
            index(request)
    small = EndpointHandler(str(served["folder"]), gallery=served["index_dir"], limits=Limits(max_top_k=3))
    with pytest.raises(PayloadTooLargeError, match="over 3"):
        small({"inputs": {"query": "a man"}, "parameters": {"top_k": 4}})
    assert len(small({"inputs": {"query": "a man"}, "parameters": {"top_k": 3}})[0]["hits"]) == 3
    plain = EndpointHandler(str(served["folder"]), gallery="")  # no gallery: the handler as before
    with pytest.raises(RequestError, match="serves no gallery"):
        plain({"inputs": {"query": "a man"}})
    assert plain.gallery is None and len(plain({"inputs": "a man"})[0]["embedding"]) == 16
