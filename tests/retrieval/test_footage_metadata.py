"""Footage metadata (track, source, frame, box, t_start, t_end): validated from the sidecar with the file and
record named, stored by both backends, returned in every hit, filtered by ``track``; a v2 index (no footage
columns) still opens and searches, and a writer migrates it."""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from fixtures import synthetic_gallery, tiny_model

from modeling_tagclip.retrieval.embedded import index_store
from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex, list_images
from modeling_tagclip.retrieval.embedded.index_build import build_index, read_sidecar
from modeling_tagclip.retrieval.embedded.index_store import GalleryIndexError, SearchFilter, metadata_row
from modeling_tagclip.retrieval.encode import encode_texts

FOOTAGE = ("track", "source", "frame", "box", "t_start", "t_end")
QUERIES = ["a man in a red coat", "a woman with a backpack"]


def _records(root: Path) -> dict[str, dict]:
    """Crops of 3 tracks on 2 cameras (track "1" exists on both cameras), frame/box/time per crop."""
    records = {}
    for i, path in enumerate(list_images(root)):
        rel = path.relative_to(root).as_posix()
        records[rel] = {
            "camera": f"c{i % 2}",
            "track": str(i % 3 // 2 + 1),
            "source": f"videos/cam{i % 2}.mp4",
            "frame": str(10 * i),
            "box": f"{i} 2 {i + 30} 64",
            "t_start": f"2026-01-01T10:00:{i:02d}Z",
            "t_end": 1767261600 + i + 5,
        }
    return records


def _expected(record: dict) -> dict:
    x1, y1, x2, y2 = (int(v) for v in record["box"].split())
    return {
        "track": record["track"],
        "source": record["source"],
        "frame": int(record["frame"]),
        "box": [x1, y1, x2, y2],
        "t_start": index_store.parse_time(record["t_start"]),
        "t_end": float(record["t_end"]),
    }


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("frame", "-1", "frame must be an integer >= 0, got '-1'"),
        ("frame", "1.5", "frame must be an integer >= 0"),
        ("frame", True, "frame must be an integer >= 0"),
        ("box", "1 2 3", "box must be 4 integers"),
        ("box", [1, 2, 3, "x"], "box must be an integer >= 0"),
        ("box", "5,0,3,4", r"box '5,0,3,4' is empty \(needs x1 < x2 and y1 < y2\)"),
        ("track", ["a"], "track must be text"),
        ("t_start", "yesterday", "t_start: 'yesterday' is neither epoch seconds nor an ISO 8601 time"),
        ("t_end", "5", r"t_start '10' is after t_end '5'"),
    ],
)
def test_bad_footage_values_are_one_error_naming_the_crop(field, value, message):
    record = {"t_start": "10", field: value}
    with pytest.raises(ValueError, match=r"^metadata of a\.png: .*" + message):
        metadata_row("a.png", record, None)


@pytest.mark.parametrize("record", [{"frame": 7, "box": [1, 2, 3, 4]}, {"frame": " 7", "box": "1,2, 3 4"}])
def test_good_footage_values_in_both_spellings(record):
    row = dict(zip(index_store.CROP_COLUMNS, metadata_row("a.png", record, None), strict=True))
    assert (row["frame"], json.loads(row["box"])) == (7, [1, 2, 3, 4])


def test_a_bad_sidecar_row_names_the_file_and_its_line(tmp_path):
    sidecar = tmp_path / "crops.csv"
    with open(sidecar, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows(
            [["path", "track", "frame", "box"], ["a.png", "1", "3", "0 0 4 4"], ["b.png", "1", "x", ""]]
        )
    with pytest.raises(
        GalleryIndexError, match=rf"^metadata file {sidecar}, line 3 \(b\.png\): frame must be"
    ):
        read_sidecar(sidecar)
    (tmp_path / "crops.json").write_text(json.dumps([{"path": "a.png", "box": [0, 0, 4]}]))
    with pytest.raises(GalleryIndexError, match=r"crops\.json, record 1 \(a\.png\): box must be 4 integers"):
        read_sidecar(tmp_path / "crops.json")


def test_track_filter_type_errors():
    with pytest.raises(ValueError, match="track filter must be a track id or a non-empty list of them"):
        SearchFilter(track=[])
    with pytest.raises(ValueError, match="unknown search filter"):
        SearchFilter.of({"tracks": "1"})
    assert index_store.filter_sql(SearchFilter(track="1", camera="c0")) == (
        "camera IN (?) AND track IN (?)",
        ["c0", "1"],
    )


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("footage")
    model, processor = tiny_model()
    root = synthetic_gallery(tmp / "data")
    records = _records(root)
    sidecar = tmp / "crops.csv"
    with open(sidecar, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["path", "camera", *FOOTAGE])
        writer.writeheader()
        writer.writerows({"path": rel, **record} for rel, record in records.items())
    index = build_index(model, processor, root, tmp / "index", progress=False, metadata=sidecar)
    query = encode_texts(model, processor, QUERIES)
    return {
        "tmp": tmp,
        "root": root,
        "records": records,
        "index": index,
        "query": query,
        "model": model,
        "processor": processor,
        "sidecar": sidecar,
    }


def _rel(hit: dict, root: Path) -> str:
    return Path(hit["path"]).relative_to(root).as_posix()


def test_embedded_hits_carry_the_footage_fields_and_filter_by_track(gallery):
    index, records, root = gallery["index"], gallery["records"], gallery["root"]
    hits = index.search(gallery["query"], 30)
    assert len(hits[0]) == len(records) == 20
    for hit in hits[0]:
        assert {k: hit[k] for k in FOOTAGE} == _expected(records[_rel(hit, root)])
    for filters in ({"track": "1"}, {"track": ["1", "2"]}, {"track": "1", "camera": "c1"}, {"track": "9"}):
        spec = SearchFilter.of(filters)
        want = {
            rel
            for rel, r in records.items()
            if r["track"] in spec.tracks() and (spec.camera is None or r["camera"] == spec.camera)
        }
        got = [_rel(h, root) for h in index.search(gallery["query"], 30, filters)[0]]
        assert set(got) == want and len(got) == len(want)
    assert 0 < len(index.search(gallery["query"], 20, {"track": "1", "camera": "c1"})[0]) < 8


def _downgrade_to_v2(database: Path) -> None:
    """Rewrite a crop database as the v2 schema (no footage columns), keeping its rows."""
    rows = sqlite3.connect(database).execute(
        "SELECT id, path, view, camera, timestamp, tags, removed FROM crops"
    )
    rows = rows.fetchall()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(database)
    db.executescript(index_store._SCHEMA_V2)
    db.executemany("INSERT INTO crops VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()


def test_a_v2_index_searches_with_none_fields_and_a_writer_migrates_it(gallery):
    old = gallery["tmp"] / "old"
    shutil.copytree(gallery["tmp"] / "index", old)
    _downgrade_to_v2(old / "gallery.sqlite")
    index = GalleryIndex.load(old, cache=False)
    hits = index.search(gallery["query"], 5)[0]
    assert [h["path"] for h in hits] == [h["path"] for h in gallery["index"].search(gallery["query"], 5)[0]]
    assert all(h[k] is None for h in hits for k in FOOTAGE) and hits[0]["camera"] in ("c0", "c1")
    assert index.search(gallery["query"], 5, {"track": "1"})[0] == []  # a v2 index holds no tracks
    assert index.remove(paths=[_rel(hits[0], gallery["root"])]) == 1  # the writer adds the columns
    columns = {row[1] for row in sqlite3.connect(old / "gallery.sqlite").execute("PRAGMA table_info(crops)")}
    assert set(FOOTAGE) <= columns
    index = GalleryIndex.load(old, cache=False)
    assert [h["path"] for h in index.search(gallery["query"], 4)[0]] == [h["path"] for h in hits[1:]]


@pytest.mark.slow
def test_milvus_lite_stores_the_same_fields_and_track_filters_as_the_embedded_index(gallery):
    pytest.importorskip("pymilvus")
    from modeling_tagclip.retrieval.milvus import MilvusGallery, filter_expression, index_into_milvus

    assert filter_expression({"track": ["1", 'x"']}) == 'removed == false and track in ["1", "x\\""]'
    uri = str(gallery["tmp"] / "g.db")
    index_into_milvus(
        gallery["model"], gallery["processor"], gallery["root"], uri, "g", metadata=gallery["sidecar"]
    )
    with MilvusGallery(uri, "g") as milvus:
        for filters in (None, {"track": "1"}, {"track": ["1", "2"]}, {"track": "1", "camera": "c1"}):
            a = gallery["index"].search(gallery["query"], 30, filters)
            b = milvus.search(gallery["query"], 30, filters)
            assert [[h["path"] for h in q] for q in a] == [[h["path"] for h in q] for q in b]
            assert [[{k: h[k] for k in FOOTAGE} for h in q] for q in a] == [
                [{k: h[k] for k in FOOTAGE} for h in q] for q in b
            ]


@pytest.mark.slow
def test_a_milvus_collection_made_before_the_footage_fields_searches_and_refuses_footage_rows(
    tmp_path, monkeypatch
):
    pytest.importorskip("pymilvus")
    from modeling_tagclip.retrieval import milvus as milvus_store

    real = milvus_store._create

    def create_without_footage(client, collection, meta):  # the schema of a collection made before them
        make = client.create_schema

        def schema(**kwargs):
            made = make(**kwargs)
            add = made.add_field
            made.add_field = lambda name, *a, **k: None if name in FOOTAGE else add(name, *a, **k)
            return made

        client.create_schema = schema
        real(client, collection, meta)

    monkeypatch.setattr(milvus_store, "_create", create_without_footage)
    monkeypatch.setattr(milvus_store, "SCALAR_INDEXES", ("path", "camera", "timestamp", "tags", "removed"))
    generator = torch.Generator().manual_seed(0)
    embeds = {"global": torch.nn.functional.normalize(torch.randn(4, 8, generator=generator), dim=-1)}
    uri = str(tmp_path / "old.db")
    with milvus_store.MilvusGallery.create(
        uri, "old", dim=8, fingerprint=None, image_root=tmp_path
    ) as gallery:
        assert not set(FOOTAGE) & gallery.fields
        assert gallery.add(embeds, [f"{i}.png" for i in range(4)], [{"camera": "c0"}] * 4) == 4
        hits = gallery.search({"global": embeds["global"][:1]}, 4)[0]
        assert len(hits) == 4 and hits[0]["path"].endswith("0.png") and hits[0]["camera"] == "c0"
        assert all(h[k] is None for h in hits for k in FOOTAGE)
        assert gallery.search({"global": embeds["global"][:1]}, 4, {"track": "1"}) == [[]]
        with pytest.raises(
            GalleryIndexError, match=r"'old' was made before the track, frame field\(s\) existed"
        ):
            gallery.add({"global": embeds["global"][:1]}, ["new.png"], [{"track": "1", "frame": 2}])
