"""The Milvus gallery (Milvus Lite files): the embedded exact index's answers, filters, remove, --add, the
model fingerprint, hostile filter strings, 2-process indexing and resume after kill -9."""

from __future__ import annotations

import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
from fixtures import (
    TAGCLIP_CLI,
    assert_same_milvus_rows,
    milvus_index_cli,
    milvus_rows,
    save_tiny_model,
    synthetic_gallery,
    tiny_model,
)

from modeling_tagclip.retrieval.embedded.index_store import GalleryIndexError
from modeling_tagclip.retrieval.milvus import filter_expression, path_id, quote

pytest.importorskip("pymilvus")  # the milvus extra; CI installs it

QUERIES = [
    "a man in a red coat",
    "a woman with a backpack",
    "a child in blue jeans",
    "an old man with a cane",
    "a person riding a bicycle",
    "a woman in a white dress",
]
FILTERS = [
    None,
    {"view": "aerial"},
    {"view": "ground"},
    {"camera": "c1"},
    {"camera": ["c0", "c2"]},
    {"after": "2026-01-01T10:05", "before": "2026-01-01T10:15"},
    {"tag": "red"},
    {"tag": 'x"y'},
    {"tag": "a\\b"},
    {"view": "ground", "camera": "c0", "after": 1767261900},
]
HOSTILE = [
    'c0" or camera != "',
    'c0\\" or true or \\"',
    "c0' or 1==1 --",
    '"] or removed == true or ["',
    "x\\",
    'array_contains(tags, "red")',
]
IDLE_S = 40.0  # a Lite client idle this long was dropped by its server


def _metadata(root: Path) -> dict[str, dict]:
    """Sidecar records for every image: alternating views, cameras from the file name, a minute apart, tags."""
    from modeling_tagclip.retrieval.embedded.gallery_index import list_images

    records = {}
    for i, path in enumerate(list_images(root)):
        rel = path.relative_to(root).as_posix()
        tags = ["red"] * (i % 3 == 0) + ['x"y'] * (i % 4 == 1) + ["a\\b"] * (i % 5 == 2)
        records[rel] = {
            "view": ("aerial", "ground")[i % 2],
            "camera": f"c{i % 3}",
            "timestamp": f"2026-01-01T10:{i:02d}",
            "tags": tags or None,
        }
    return records


def _hits(results: list[list[dict]]) -> list[list[tuple[str, float]]]:
    return [[(hit["path"], hit["score"]) for hit in hits] for hits in results]


def _same(embedded: list[list[dict]], milvus: list[list[dict]]) -> None:
    """Identical ranked paths and metadata, scores within 1e-5."""
    assert [[h["path"] for h in hits] for hits in embedded] == [[h["path"] for h in hits] for hits in milvus]
    for a, b in zip(embedded, milvus, strict=True):
        for x, y in zip(a, b, strict=True):
            assert abs(x["score"] - y["score"]) <= 1e-5
            assert {k: x[k] for k in ("rank", "view", "camera", "timestamp", "tags")} == {
                k: y[k] for k in ("rank", "view", "camera", "timestamp", "tags")
            }
            assert x["predicted_view"] == y["predicted_view"]
            assert x["predicted_view_score"] == pytest.approx(y["predicted_view_score"], abs=1e-6)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The same gallery (20 crops + metadata) in the embedded exact index and a Milvus Lite FLAT collection."""
    from modeling_tagclip.retrieval.embedded.index_build import build_index
    from modeling_tagclip.retrieval.encode import encode_texts
    from modeling_tagclip.retrieval.milvus import MilvusGallery, index_into_milvus

    tmp = tmp_path_factory.mktemp("milvus")
    model, processor = tiny_model()
    root = synthetic_gallery(tmp / "data")
    extra = tmp / "extra"  # images added later with --add
    shutil.move(str(root / "images" / "test"), extra)
    metadata = _metadata(root)
    embedded = build_index(model, processor, root, tmp / "index", progress=False, metadata=metadata)
    uri = str(tmp / "gallery.db")
    assert index_into_milvus(model, processor, root, uri, "gallery", metadata=metadata, shard_size=7) == 12
    milvus = MilvusGallery(uri, "gallery")
    query = encode_texts(model, processor, QUERIES)
    state = {
        "model": model,
        "processor": processor,
        "root": root,
        "extra": extra,
        "embedded": embedded,
        "milvus": milvus,
        "query": query,
        "uri": uri,
        "tmp": tmp,
        "last_used": time.monotonic(),
    }
    yield state
    milvus.close()


@pytest.mark.slow
def test_flat_collection_answers_as_the_embedded_exact_index_for_every_filter_remove_and_add(built):
    from modeling_tagclip.retrieval.embedded.index_build import build_index
    from modeling_tagclip.retrieval.milvus import index_into_milvus

    embedded, milvus, query = built["embedded"], built["milvus"], built["query"]
    assert len(milvus) == len(embedded) == 12 and milvus.fingerprint == embedded.meta["model_fingerprint"]
    matched = 0
    for filters in FILTERS:
        a, b = embedded.search(query, 10, filters), milvus.search(query, 10, filters)
        _same(a, b)
        matched += sum(map(len, a))
    assert matched > 6 * 30  # the filters select real, differing subsets

    top = Path(embedded.search(query, 1)[0][0]["path"]).relative_to(built["root"]).as_posix()
    assert embedded.remove(paths=[top]) == 1 and milvus.remove(paths=[top]) == 1
    assert milvus.remove(paths=[top]) == 0  # already removed
    for filters in FILTERS[:3]:
        _same(embedded.search(query, 10, filters), milvus.search(query, 10, filters))
    assert top not in str(milvus.search(query, 10))

    shutil.move(str(built["extra"]), built["root"] / "images" / "test")
    model, processor, root = built["model"], built["processor"], built["root"]
    grown = build_index(model, processor, root, built["tmp"] / "index", progress=False, add=True)
    assert index_into_milvus(model, processor, root, built["uri"], "gallery", add=True) == 8  # 20 - 12
    assert len(milvus) == len(grown) == 20
    for filters in FILTERS[:3]:
        _same(grown.search(query, 10, filters), milvus.search(query, 10, filters))
    assert top not in str(milvus.search(query, 20))  # --add does not bring a removed crop back
    built["last_used"] = time.monotonic()


@pytest.mark.slow
def test_another_model_is_refused_and_hostile_filter_strings_match_nothing(built):
    from modeling_tagclip.retrieval.milvus import MilvusGallery, index_into_milvus

    other, _ = tiny_model(seed=1)
    with pytest.raises(GalleryIndexError, match="different model"):
        built["milvus"].check_model(other)
    built["milvus"].check_model(built["model"])
    with pytest.raises(GalleryIndexError, match="different model"):
        index_into_milvus(other, built["processor"], built["root"], built["uri"], "gallery", add=True)
    with pytest.raises(GalleryIndexError, match="no collection 'nope'"):
        MilvusGallery(built["uri"], "nope")
    for text in HOSTILE:  # matched as plain strings: nothing has them; in a list, c0's crops as embedded
        for filters in ({"camera": text}, {"tag": text}):
            assert built["milvus"].search(built["query"], 5, filters) == [[]] * len(QUERIES), filters
            assert built["embedded"].search(built["query"], 5, filters) == [[]] * len(QUERIES)
        both = {"camera": ["c0", text]}
        _same(
            built["embedded"].search(built["query"], 5, both), built["milvus"].search(built["query"], 5, both)
        )
    with pytest.raises(ValueError, match="control character"):
        built["milvus"].search(built["query"], 5, {"tag": "a\nb"})
    with pytest.raises(ValueError, match="view filter"):
        built["milvus"].search(built["query"], 5, {"view": 'aerial" or true'})
    built["last_used"] = time.monotonic()


def test_filter_expressions_quote_and_ids():
    assert quote('a"b\\c') == '"a\\"b\\\\c"'
    assert filter_expression(None) == "removed == false"
    assert filter_expression(
        {"camera": ['x"', "7"], "tag": "t", "after": 10, "before": "1970-01-01T00:01"}
    ) == (
        'removed == false and camera in ["x\\"", "7"] and timestamp >= 10.0 and timestamp < 60.0 '
        'and array_contains(tags, "t")'
    )
    assert path_id("a/b.jpg") == path_id("a/b.jpg") != path_id("a/c.jpg")
    assert 0 <= path_id("a/b.jpg") < 2**63
    with pytest.raises(ValueError, match="control character"):
        quote("a\x00b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_processes_write_what_one_writes_and_a_killed_build_resumes(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    images = synthetic_gallery(tmp_path / "data") / "images"
    one = milvus_index_cli([sys.executable, *TAGCLIP_CLI], model, images, str(tmp_path / "one.db"))
    assert one.returncode == 0 and "indexed 20 new images" in one.stdout, one.stderr[-3000:]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        *TAGCLIP_CLI,
    ]
    two = milvus_index_cli(torchrun, model, images, str(tmp_path / "two.db"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert sorted(two.stdout.split("\n"))[-2:] == [  # shards of 3: rank 0 takes 0, 2, 4, 6; rank 1 1, 3, 5
        "rank 0 of 2: indexed 11 new images from "
        + f"{images} into {tmp_path / 'two.db'} collection g (flat)",
        "rank 1 of 2: indexed 9 new images from "
        + f"{images} into {tmp_path / 'two.db'} collection g (flat)",
    ]
    clean = milvus_rows(str(tmp_path / "one.db"))
    assert_same_milvus_rows(clean, milvus_rows(str(tmp_path / "two.db")))

    # kill -9 in the middle of the third upsert, after half its rows went in: the re-run adds the rest
    killer = (
        "import os, signal, runpy, sys\nfrom modeling_tagclip.retrieval import milvus as m\n"
        "add, calls = m.MilvusGallery.add, []\n"
        "def dying(self, embeds, paths, records=None, removed=()):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        add(self, {k: v[:1] for k, v in embeds.items()}, paths[:1], records[:1],\n"
        "            removed=[i for i in removed if i < 1])\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return add(self, embeds, paths, records, removed=removed)\n"
        "m.MilvusGallery.add = dying\nsys.argv = ['tagclip', *sys.argv[1:]]\n"
        "runpy.run_module('modeling_tagclip.cli', run_name='__main__')\n"
    )
    uri = str(tmp_path / "killed.db")
    killed = milvus_index_cli([sys.executable, "-c", killer], model, images, uri)
    assert killed.returncode == -9, killed.stderr[-3000:]
    # two shards of 3, and the third's first row unless the kill came before Lite made it durable
    kept = len(milvus_rows(uri))
    assert kept in (6, 7)
    again = milvus_index_cli([sys.executable, *TAGCLIP_CLI], model, images, uri)
    assert again.returncode == 0 and f"indexed {20 - kept} new images" in again.stdout, again.stderr[-3000:]
    assert_same_milvus_rows(clean, milvus_rows(uri))


@pytest.mark.slow
def test_pipeline_takes_a_milvus_uri_or_gallery_and_answers_as_the_embedded_index(built):
    from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
    from modeling_tagclip.retrieval.pipeline_tagclip import TagClipRetrievalPipeline

    # the open Lite client idles first for longer than a client survives with pymilvus' default keepalive
    # (10 s pings, refused by Lite's server as "too many pings" from the third): a serving process does this
    idle = IDLE_S - (time.monotonic() - built["last_used"])
    time.sleep(max(0.0, idle))
    search = TagClipRetrievalPipeline(model=built["model"], processor=built["processor"])
    embedded = GalleryIndex.load(built["tmp"] / "index", cache=False)  # as the other tests left both
    expected = search(QUERIES[0], gallery=embedded, top_k=5, filters={"view": "ground"})
    by_uri = search(
        QUERIES[0], gallery=built["uri"], collection="gallery", top_k=5, filters={"view": "ground"}
    )
    by_object = search(QUERIES[0], gallery=built["milvus"], top_k=5, filters={"view": "ground"})
    assert len(expected) == 5
    _same([expected], [by_uri])
    _same([expected], [by_object])


@pytest.mark.slow
def test_milvus_lite_refuses_float16_vectors_so_the_collection_stores_float32(tmp_path):
    """milvus-lite 3.2 has no FLOAT16_VECTOR (docs/milvus.md quotes its error): the gallery's vector field is
    FLOAT_VECTOR. When a Lite release accepts it, this fails, and an fp16 option can be offered."""
    from pymilvus import DataType, MilvusClient
    from pymilvus.exceptions import MilvusException

    from modeling_tagclip.retrieval.milvus import LITE_GRPC_OPTIONS, MilvusGallery

    uri = str(tmp_path / "f16.db")
    with MilvusGallery.create(uri, "g", dim=8, fingerprint=None, image_root=tmp_path) as gallery:
        fields = {f["name"]: f["type"] for f in gallery.client.describe_collection("g")["fields"]}
        assert fields["vector"] == DataType.FLOAT_VECTOR
    client = MilvusClient(uri, grpc_options=LITE_GRPC_OPTIONS)
    try:
        schema = client.create_schema(auto_id=False)
        schema.add_field("id", DataType.INT64, is_primary=True)
        schema.add_field("vector", DataType.FLOAT16_VECTOR, dim=8)
        index = client.prepare_index_params()
        index.add_index("vector", index_type="FLAT", metric_type="IP")
        with pytest.raises(MilvusException, match="Float16Vector which MilvusLite does not support"):
            client.create_collection("f16", schema=schema, index_params=index)
    finally:
        client.close()
