"""A gallery that grows and filters: SQLite crop metadata from a sidecar, ``tagclip index --add``, ``tagclip
remove``, filtered search (exact pre-filtering), interrupted adds, concurrent readers, ``tagclip serve``, and
``torchrun`` scale-out writing the same index as one process."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading

import pytest
import torch
from fixtures import REPO_ROOT, save_tiny_model, synthetic_gallery

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build, index_commit

QUERY = "a man in a blue hooded sweatshirt with a brown bag"


def _record(rel: str, i: int) -> dict:
    aerial = "_c0_" in rel
    return {
        "path": rel,
        "view": "aerial" if aerial else "ground",
        "camera": "3" if aerial else "7",
        "timestamp": f"2026-01-01T10:{i:02d}:00",
        "tags": "red;bag" if i % 3 == 0 else "",
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("db")
    model_dir = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    rels = [p.relative_to(images).as_posix() for p in gi.list_images(images)]
    sidecar = root / "crops.csv"
    with open(sidecar, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["path", "view", "camera", "timestamp", "tags"])
        writer.writeheader()
        writer.writerows(_record(rel, i) for i, rel in enumerate(rels))
    model, processor = cli.load_model(str(model_dir))
    return {
        "root": root,
        "model_dir": model_dir,
        "images": images,
        "rels": rels,
        "sidecar": sidecar,
        "model": model,
        "processor": processor,
    }


def _build(setup, images, out, **kwargs):
    options = dict(batch_size=2, shard_size=3, progress=False, metadata=setup["sidecar"])
    return index_build.build_index(setup["model"], setup["processor"], images, out, **{**options, **kwargs})


def _half_gallery(setup, folder):
    """A copy of the gallery holding only the train/ crops (test/ crops arrive later)."""
    shutil.copytree(setup["images"], folder)
    shutil.rmtree(folder / "test")
    return folder


@pytest.fixture(scope="module")
def full(setup):
    return _build(setup, setup["images"], setup["root"] / "full")


def _exact_filtered(index, query, keep, k):
    mask = torch.tensor([keep(i) for i in range(len(index))])
    return gi.chunked_topk(query, index.embeds, k, mask=mask)[1]


def test_metadata_lands_in_a_real_sqlite_file(setup, full):
    db = sqlite3.connect(setup["root"] / "full" / "gallery.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    rows = db.execute("SELECT id, path, view, camera, timestamp, tags FROM crops ORDER BY id").fetchall()
    assert [r[1] for r in rows] == setup["rels"] and [r[0] for r in rows] == list(range(len(rows)))
    first = _record(setup["rels"][0], 0)
    assert rows[0][2:4] == (first["view"], first["camera"])
    assert rows[0][4] == pytest.approx(1767261600.0)  # 2026-01-01T10:00:00 UTC
    assert json.loads(rows[0][5]) == ["red", "bag"] and rows[1][5] is None


@pytest.mark.parametrize(
    "filters, keep",
    [
        ({"camera": "7"}, lambda r: r["camera"] == "7"),
        ({"view": "aerial"}, lambda r: r["view"] == "aerial"),
        (
            {"after": "2026-01-01T10:05", "before": "2026-01-01T10:12"},
            lambda r: "10:05" <= r["timestamp"][11:16] < "10:12",
        ),
        ({"tag": "red", "camera": "3"}, lambda r: r["tags"] == "red;bag" and r["camera"] == "3"),
    ],
)
def test_filtered_search_is_the_exact_ranking_of_the_matching_crops(setup, full, filters, keep):
    records = [_record(rel, i) for i, rel in enumerate(setup["rels"])]
    query = gi.encode_texts(setup["model"], setup["processor"], [QUERY])
    hits = full.search(query, top_k=5, filters=filters)[0]
    expected = _exact_filtered(full, query, lambda i: keep(records[i]), 5)[0].tolist()
    assert [h["index"] for h in hits] == expected and len(expected) == min(5, sum(map(keep, records)))
    assert all(keep(records[h["index"]]) for h in hits)


def test_cli_search_filters_and_json(setup, full, capsys):
    capsys.readouterr()
    args = [
        "search",
        "--index",
        str(setup["root"] / "full"),
        "-k",
        "20",
        "--json",
        "--camera",
        "7",
        "--view",
        "ground",
    ]
    assert cli.main([*args, QUERY]) == 0
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    assert hits and all(h["camera"] == "7" for h in hits)
    assert len(hits) == sum(_record(r, i)["camera"] == "7" for i, r in enumerate(setup["rels"]))


def test_add_encodes_only_new_crops_and_equals_a_full_build(setup, full, tmp_path, monkeypatch):
    folder = _half_gallery(setup, tmp_path / "images")
    out = tmp_path / "grown"
    train = [r for r in setup["rels"] if r.startswith("train/")]
    _build(setup, folder, out, metadata={r: _record(r, setup["rels"].index(r)) for r in train})
    shutil.copytree(setup["images"] / "test", folder / "test")
    encoded = []
    real = index_build.encode_batch
    monkeypatch.setattr(
        index_build, "encode_batch", lambda m, px, *a: encoded.append(len(px)) or real(m, px, *a)
    )
    test = {r: _record(r, setup["rels"].index(r)) for r in setup["rels"] if r.startswith("test/")}
    assert (
        cli.main(
            [
                "index",
                "--add",
                "--model",
                str(setup["model_dir"]),
                "--images",
                str(folder),
                "--out",
                str(out),
                "--metadata",
                str(_sidecar(tmp_path, test)),
                "--quiet",
                "--workers",
                "0",
            ]
        )
        == 0
    )
    assert sum(encoded) == len(test)
    grown = gi.GalleryIndex.load(out, cache=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["rows"] for s in manifest["segments"]] == [len(train), len(test)]
    assert sorted(os.path.relpath(p, folder) for p in grown.paths) == sorted(setup["rels"])
    by_path = {os.path.relpath(p, folder): i for i, p in enumerate(grown.paths)}
    order = torch.tensor([by_path[r] for r in setup["rels"]])
    for key in ("global", "local"):
        torch.testing.assert_close(grown.embeds[key][order], full.embeds[key], atol=1e-6, rtol=0)
    query = gi.encode_texts(setup["model"], setup["processor"], [QUERY])
    assert [grown.paths[i] for i in grown.topk(query, 5, filters={"camera": "7"})[1][0]] == [
        str(folder / os.path.relpath(full.paths[i], setup["images"]))
        for i in full.topk(query, 5, filters={"camera": "7"})[1][0]
    ]
    encoded.clear()
    _build(setup, folder, out, add=True, metadata=None)  # nothing new: nothing encoded
    assert encoded == []


def _sidecar(folder, records: dict) -> os.PathLike:
    path = folder / "new.json"
    path.write_text(json.dumps(list(records.values())))
    return path


def test_remove_is_immediate_and_survives_reload_and_add(setup, tmp_path, capsys):
    out = tmp_path / "idx"
    shutil.copytree(setup["root"] / "full", out)
    query = gi.encode_texts(setup["model"], setup["processor"], [QUERY])
    loaded = gi.GalleryIndex.load(out)
    top = loaded.topk(query, 3)[1][0].tolist()
    victim = setup["rels"][top[0]]
    assert cli.main(["remove", "--index", str(out), victim]) == 0
    assert "removed 1 of 1" in capsys.readouterr().out
    assert loaded.topk(query, 3)[1][0].tolist() == [
        *top[1:],
        loaded.topk(query, 3)[1][0, 2].item(),
    ]  # same object
    assert top[0] not in gi.GalleryIndex.load(out, cache=False).topk(query, len(setup["rels"]))[1][0].tolist()
    _build(setup, setup["images"], out, add=True, metadata=None)  # the file is still there: not re-added
    assert top[0] not in gi.GalleryIndex.load(out, cache=False).topk(query, len(setup["rels"]))[1][0].tolist()
    assert cli.main(["remove", "--index", str(out), "no/such.png"]) == 2
    assert "not in the gallery index" in capsys.readouterr().err


def test_interrupted_add_leaves_the_index_usable_and_resumes(setup, tmp_path, monkeypatch):
    folder = _half_gallery(setup, tmp_path / "images")
    out = tmp_path / "idx"
    before = _build(setup, folder, out, metadata=None)
    shutil.copytree(setup["images"] / "test", folder / "test")
    stop = lambda done, total: (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        _build(setup, folder, out, add=True, metadata=None, on_shard=stop)
    query = gi.encode_texts(setup["model"], setup["processor"], [QUERY])
    usable = gi.GalleryIndex.load(out, cache=False)
    assert len(usable) == len(before) and torch.equal(usable.topk(query, 3)[1], before.topk(query, 3)[1])

    real = (
        index_commit.write_json
    )  # now crash at the commit point: segment and crop rows written, no manifest

    def fail(path, obj):
        if path.name == "manifest.json":
            raise OSError("disk full")
        return real(path, obj)

    monkeypatch.setattr(index_commit, "write_json", fail)
    with pytest.raises(OSError, match="disk full"):
        _build(setup, folder, out, add=True, metadata=None)
    with sqlite3.connect(out / "gallery.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM crops").fetchone()[0] == len(setup["rels"])  # rows exist ...
    still = gi.GalleryIndex.load(out, cache=False)  # ... but are invisible until the manifest names them
    assert len(still) == len(before) and len(still.paths) == len(before)
    monkeypatch.setattr(index_commit, "write_json", real)
    done = _build(setup, folder, out, add=True, metadata=None)
    assert len(done) == len(setup["rels"]) and not (out / "build").exists()


def test_concurrent_readers_see_the_old_or_the_new_index(setup, tmp_path):
    folder = _half_gallery(setup, tmp_path / "images")
    out = tmp_path / "idx"
    old = len(_build(setup, folder, out, metadata=None))
    shutil.copytree(setup["images"] / "test", folder / "test")
    seen, errors, stop = [], [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                index = gi.GalleryIndex.load(out, cache=False)
                assert len(index.paths) == len(index)
                seen.append(len(index))
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        _build(setup, folder, out, add=True, metadata=None)
    finally:
        stop.set()
        thread.join()
    assert not errors and seen and set(seen) <= {old, len(setup["rels"])}


def test_serve_keeps_the_index_and_answers_json_lines(setup, full, monkeypatch, capsys):
    lines = [
        QUERY,
        json.dumps({"query": QUERY, "top_k": 2, "filters": {"camera": "3"}}),
        "{broken",
        '{"query": ""}',
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    loads = []
    real = gi.GalleryIndex._load
    monkeypatch.setattr(
        gi.GalleryIndex, "_load", classmethod(lambda cls, *a: loads.append(1) or real.__func__(cls, *a))
    )
    gi._CACHE.clear()
    capsys.readouterr()
    assert cli.main(["serve", "--index", str(setup["root"] / "full"), "-k", "3"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert answers[0] == {"ready": True, "images": len(setup["rels"])}
    assert len(answers[1]["hits"]) == 3 and len(answers[2]["hits"]) == 2
    assert all(h["camera"] == "3" for h in answers[2]["hits"])
    assert "error" in answers[3] and "non-empty" in answers[4]["error"]
    assert len(loads) == 1  # loaded once for all queries


def test_pipeline_keeps_the_loaded_index_between_calls(setup, full, monkeypatch):
    """An index directory passed to every pipeline call is loaded once (``GalleryIndex.load``'s cache) and
    refreshed in place when the index changed on disk (here: its manifest rewritten, as ``--add`` does)."""
    from modeling_tagclip.retrieval.pipeline_tagclip import TagClipRetrievalPipeline

    loads = []
    real = gi.GalleryIndex._load
    monkeypatch.setattr(
        gi.GalleryIndex, "_load", classmethod(lambda cls, *a: loads.append(1) or real.__func__(cls, *a))
    )
    gi._CACHE.clear()
    search = TagClipRetrievalPipeline(model=setup["model"], processor=setup["processor"])
    path = str(setup["root"] / "full")
    first = search(QUERY, gallery=path, top_k=3)
    assert search(QUERY, gallery=path, top_k=3) == first and search([QUERY, QUERY], gallery=path, top_k=3)
    assert len(loads) == 1 and len(first) == 3
    manifest = setup["root"] / "full" / "manifest.json"
    stat = manifest.stat()
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # what a commit of --add changes
    assert search(QUERY, gallery=path, top_k=3) == first and len(loads) == 1  # refreshed, not reloaded


def test_bad_sidecars_are_clear_errors(setup, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"path": "nope.png", "camera": 1}]))
    with pytest.raises(
        gi.GalleryIndexError, match=r"metadata for images that are not being indexed: \['nope.png'\]"
    ):
        _build(setup, setup["images"], tmp_path / "a", metadata=bad)
    bad.write_text(json.dumps([{"path": setup["rels"][0], "colour": "red"}]))
    with pytest.raises(gi.GalleryIndexError, match=r"unknown columns \['colour'\]"):
        _build(setup, setup["images"], tmp_path / "b", metadata=bad)
    bad.write_text(json.dumps([{"path": setup["rels"][0], "view": "sideways"}]))
    with pytest.raises(ValueError, match="view must be 'aerial' or 'ground'"):
        _build(setup, setup["images"], tmp_path / "c", metadata=bad)
    bad.write_text(json.dumps([{"path": setup["rels"][0], "timestamp": "yesterday"}]))
    with pytest.raises(ValueError, match="neither epoch seconds nor an ISO 8601 time"):
        _build(setup, setup["images"], tmp_path / "d", metadata=bad)


def test_bad_metadata_fails_before_anything_is_encoded(setup, tmp_path, monkeypatch):
    encoded = []
    monkeypatch.setattr(index_build, "encode_batch", lambda *a: encoded.append(1))
    bad = {setup["rels"][0]: {"camera": "3", "view": "sideways"}}
    with pytest.raises(ValueError, match="view must be 'aerial' or 'ground'"):
        _build(setup, setup["images"], tmp_path / "idx", metadata=bad)
    assert encoded == [] and not (tmp_path / "idx" / "build").exists()


def _crops(out):
    with sqlite3.connect(out / "gallery.sqlite") as db:
        return db.execute("SELECT * FROM crops ORDER BY id").fetchall()


def _earlier_pending_build(setup, out):
    """An interrupted build as an earlier version left it: the sidecar's records in build/metadata.json."""
    stop = lambda done, total: (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        _build(setup, setup["images"], out, on_shard=stop)
    records = index_build.read_sidecar(setup["sidecar"])
    (out / "build" / index_commit.ROWS).unlink()
    (out / "build" / "metadata.json").write_text(json.dumps(records))


def test_a_pending_build_of_the_earlier_format_resumes(setup, full, tmp_path, monkeypatch):
    out = tmp_path / "idx"
    _earlier_pending_build(setup, out)
    encoded = []
    real = index_build.encode_batch
    monkeypatch.setattr(
        index_build, "encode_batch", lambda m, px, *a: encoded.append(len(px)) or real(m, px, *a)
    )
    resumed = _build(setup, setup["images"], out)
    assert sum(encoded) == len(setup["rels"]) - 3  # the first shard (3 crops) was kept
    assert resumed.paths == full.paths and _crops(out) == _crops(setup["root"] / "full")


def test_an_unreadable_pending_build_of_the_earlier_format_says_to_rebuild(setup, tmp_path, capsys):
    out = tmp_path / "idx"
    _earlier_pending_build(setup, out)
    (out / "build" / "metadata.json").write_text("[1, 2")
    with pytest.raises(
        gi.GalleryIndexError, match=r"no readable crop metadata: rebuild with --overwrite$"
    ) as error:
        _build(setup, setup["images"], out)
    assert "\n" not in str(error.value)
    args = [
        "index",
        "--model",
        str(setup["model_dir"]),
        "--images",
        str(setup["images"]),
        "--out",
        str(out),
        "--metadata",
        str(setup["sidecar"]),
        "--shard-size",
        "3",
        "--quiet",
        "--workers",
        "0",
    ]
    assert cli.main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the one line after the model's loading bar
    assert last.startswith("tagclip index: ") and last.endswith(
        "no readable crop metadata: rebuild with --overwrite"
    )
    assert cli.main([*args, "--overwrite"]) == 0 and _crops(out) == _crops(setup["root"] / "full")


@pytest.mark.slow
def test_torchrun_two_processes_write_the_same_index_as_one(setup, tmp_path):
    """Scale-out: 2 CPU ranks each encode their shards; rank 0 merges: byte-identical to 1 process."""
    common = [
        "-m",
        "modeling_tagclip.cli",
        "index",
        "--model",
        str(setup["model_dir"]),
        "--images",
        str(setup["images"]),
        "--batch-size",
        "2",
        "--shard-size",
        "3",
        "--workers",
        "0",
        "--quiet",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run(
        [sys.executable, *common, "--out", str(tmp_path / "one")],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29533",
    ]
    two = subprocess.run(
        [*torchrun, *common, "--out", str(tmp_path / "two")],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("indexed 20 images") == 1  # rank 0 reports
    for name in ("segments/seg_0000000000.safetensors", "gallery.sqlite"):
        if name.endswith(".sqlite"):
            dump = lambda p: list(sqlite3.connect(p).execute("SELECT * FROM crops ORDER BY id"))  # noqa: E731
            assert dump(tmp_path / "one" / name) == dump(tmp_path / "two" / name)
        else:
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_add_keeps_the_index_storage_dtype_and_ann_settings(setup, tmp_path):
    folder = _half_gallery(setup, tmp_path / "images")
    out = tmp_path / "idx"
    _build(setup, folder, out, metadata=None, store_dtype="fp16")
    shutil.copytree(setup["images"] / "test", folder / "test")
    with pytest.raises(gi.GalleryIndexError, match="ANN settings of .* are fixed"):
        _build(setup, folder, out, add=True, metadata=None, ann="ivf")
    grown = _build(setup, folder, out, add=True, metadata=None)  # default store_dtype would be fp32
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["segments"]) == 2 and grown.embeds["global"].dtype == torch.float16
