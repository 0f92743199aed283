"""The gallery index against its own files and odd names: unstorable names skipped at ``--add`` (or refused
before committing), one bad row (tampered path, NaN row with a matching checksum) reported and skipped, search
on a read-only filesystem, a planted SQLite trigger refused, no file outside the image root opened, ``add``
through the ``GalleryStore`` protocol reading only what changed, CLI hints outside the library's errors."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess

import pytest
import torch
from fixtures import save_tiny_model, synthetic_gallery
from PIL import Image

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build, index_store
from modeling_tagclip.retrieval.embedded.index_store import sha256_file, write_tensors
from modeling_tagclip.retrieval.store import GalleryStore


def _rows(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"global": torch.nn.functional.normalize(torch.randn(count, 8, generator=generator), dim=-1)}


def _paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:04d}.jpg" for i in range(start, stop)]


def _snapshot(folder) -> dict[str, bytes]:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.endswith(("-wal", "-shm"))]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


@pytest.fixture
def small(tmp_path):
    rows = _rows(64)
    index_build.index_embeddings(tmp_path / "idx", rows, _paths(0, 64), tmp_path / "root")
    return tmp_path / "idx", rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny model and an index of its synthetic gallery (through ``tagclip index``)."""
    root = tmp_path_factory.mktemp("robust")
    model_dir = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    out = root / "idx"
    assert _index(model_dir, images, out) == 0
    return {"root": root, "model": model_dir, "images": images, "out": out}


def _index(model_dir, images, out, *extra) -> int:
    args = ["index", "--model", str(model_dir), "--images", str(images), "--out", str(out)]
    return cli.main([*args, "--batch-size", "4", "--workers", "0", "--quiet", *extra])


def test_add_skips_names_the_index_cannot_store_and_the_index_stays_usable(built, tmp_path, capsys):
    images, out = tmp_path / "images", tmp_path / "idx"
    shutil.copytree(built["images"], images)
    shutil.copytree(built["out"], out)
    header = json.loads((out / "index.json").read_text())
    header["image_root"] = str(images.resolve())  # the copy's own root
    (out / "index.json").write_text(json.dumps(header))
    source = gi.list_images(images)[0]
    odd = ["back\\slash.png", "tab\there.png", os.fsdecode(b"latin\xe9.png"), "fine name ok.png"]
    for name in odd:
        shutil.copy(source, images / name)
    before = len(gi.GalleryIndex.load(out, cache=False))
    capsys.readouterr()
    assert _index(built["model"], images, out, "--add") == 0
    err = capsys.readouterr().err
    assert "3 image(s) skipped, their names cannot be stored" in err
    assert "a backslash" in err and "a control character" in err and "not valid UTF-8" in err
    index = gi.GalleryIndex.load(out, cache=False)
    assert len(index) == before + 1 and index.paths[-1].endswith("fine name ok.png")
    query = {key: value[-1:].float() for key, value in index.embeds.items() if key != "view_probs"}
    hits = index.search(query, top_k=2)[0]  # the new row is a copy of row 0: both rank first
    assert {hit["index"] for hit in hits} == {0, before}
    assert cli.main(["remove", "--index", str(out), "fine name ok.png"]) == 0  # remove and --add still work
    assert _index(built["model"], images, out, "--add") == 0


def test_unstorable_names_are_refused_before_anything_is_committed(small):
    out, _ = small
    before = _snapshot(out)
    for name in ("a\\b.jpg", "new\nline.jpg", "ctrl\x01.jpg", os.fsdecode(b"x\xff.jpg"), "../up.jpg"):
        with pytest.raises(gi.GalleryIndexError, match="cannot be stored"):
            index_build.index_embeddings(out, _rows(1, 5), [name], out.parent / "root")
    assert _snapshot(out) == before


def test_a_tampered_path_row_is_reported_and_skipped(small):
    out, rows = small
    db = sqlite3.connect(out / "gallery.sqlite")
    db.execute("UPDATE crops SET path = '../../etc/passwd' WHERE id = 5")
    db.commit()
    db.close()
    with pytest.warns(UserWarning, match=r"1 row\(s\) skipped .* rows \[5\]"):
        index = gi.GalleryIndex.load(out, cache=False)
        hits = index.search({"global": rows["global"][5:6]}, top_k=64)[0]
    assert len(hits) == 63 and 5 not in {hit["index"] for hit in hits} and index.paths[5] is None


def test_a_nan_row_with_a_matching_checksum_never_ranks(small):
    out, rows = small
    manifest = json.loads((out / "manifest.json").read_text())
    segment = manifest["segments"][0]
    tampered = {"global": rows["global"].clone()}
    tampered["global"][7] = float("nan")
    segment.update(write_tensors(out / segment["file"], tampered))  # checksum recomputed: the file "verifies"
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert segment["sha256"] == sha256_file(out / segment["file"])
    with pytest.warns(UserWarning, match=r"non-finite embedding.*rows \[7\]"):
        index = gi.GalleryIndex.load(out, cache=False)
        hits = index.search({"global": rows["global"][:3]}, top_k=5)
    assert [h[0]["index"] for h in hits] == [0, 1, 2]
    assert all(hit["index"] != 7 and hit["score"] == hit["score"] for h in hits for hit in h)


@pytest.mark.slow
def test_search_works_on_a_read_only_filesystem(small, tiny_disk):
    out, rows = small
    mount = tiny_disk(4096)
    shutil.copytree(out, mount / "idx")
    assert subprocess.run(["mount", "-o", "remount,ro", str(mount)]).returncode == 0
    index = gi.GalleryIndex.load(mount / "idx", cache=False)
    assert index.search({"global": rows["global"][3:4]}, top_k=1)[0][0]["index"] == 3
    with pytest.raises(gi.GalleryIndexError):  # the writer reports the read-only database, nothing else
        index.remove(ids=[3])
    assert sorted(p.name for p in (mount / "idx").iterdir()) == sorted(p.name for p in out.iterdir())


def test_search_opens_the_database_read_only_and_immutable_when_the_folder_is_not_writable(
    small, monkeypatch
):
    out, rows = small
    connects = []
    real = sqlite3.connect
    monkeypatch.setattr(
        sqlite3, "connect", lambda target, **kw: connects.append(target) or real(target, **kw)
    )
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as on a read-only folder as another user
    index = gi.GalleryIndex.load(out, cache=False)
    assert index.search({"global": rows["global"][9:10]}, top_k=1)[0][0]["index"] == 9
    assert connects == [f"{(out / 'gallery.sqlite').resolve().as_uri()}?mode=ro&immutable=1"]


def test_a_planted_trigger_is_refused_and_never_runs(small, capsys):
    out, _ = small
    db = sqlite3.connect(out / "gallery.sqlite")
    db.execute("CREATE TRIGGER wipe AFTER UPDATE ON crops BEGIN DELETE FROM crops; END")
    db.commit()
    db.close()
    assert cli.main(["remove", "--index", str(out), "img/0001.jpg"]) == 2
    assert "trigger 'wipe'" in capsys.readouterr().err
    db = sqlite3.connect(out / "gallery.sqlite")
    assert db.execute("SELECT COUNT(*), SUM(removed) FROM crops").fetchone() == (64, 0)  # nothing ran
    db.close()
    with pytest.raises(gi.GalleryIndexError, match="does not have the schema this index writes"):
        gi.GalleryIndex.load(out, cache=False)


def test_a_hit_replaced_by_a_non_image_renders_a_blank_tile(built, tmp_path):
    out, images = tmp_path / "idx", tmp_path / "images"
    shutil.copytree(built["out"], out)
    shutil.copytree(built["images"], images)
    args = ["search", "--index", str(out), "--model", str(built["model"]), "--image-root", str(images)]
    index = gi.GalleryIndex.load(out, image_root=images, cache=False)
    for path in index.paths:
        with open(path, "wb") as handle:
            handle.write(b"not an image")
    assert cli.main([*args, "-k", "3", "--png", str(tmp_path / "s.png"), "a person"]) == 0
    assert Image.open(tmp_path / "s.png").size[0] > 0


def test_add_through_the_store_protocol_reads_only_what_changed(small, monkeypatch):
    out, rows = small
    index = gi.GalleryIndex.load(out)  # cached, as a server holds it
    assert isinstance(index, GalleryStore) and index.fingerprint is None
    assert index.search({"global": rows["global"][:1]}, top_k=1)[0][0]["index"] == 0  # segments read
    read = []
    real, mapped = index_store._read_hashed, index_store.map_tensors
    monkeypatch.setattr(
        index_store, "_read_hashed", lambda path, sha: read.append(path.name) or real(path, sha)
    )
    monkeypatch.setattr(  # the served index maps its segments: opening one counts as reading it
        index_store, "map_tensors", lambda path, sha, n: read.append(path.name) or mapped(path, sha, n)
    )
    new = _rows(10, seed=9)
    assert index.add(new, [f"new/{i}.jpg" for i in range(10)], [{"camera": "c9"}] * 10) == 10
    assert read == ["shard_0000000.safetensors", "seg_0000000064.safetensors"]  # the new rows only
    assert gi.GalleryIndex.load(out) is index and len(index) == 74
    hit = index.search({"global": new["global"][4:5]}, top_k=1, filters={"camera": "c9"})[0][0]
    assert hit["index"] == 68 and hit["camera"] == "c9" and hit["path"].endswith("new/4.jpg")
    fresh = gi.GalleryIndex.load(out, cache=False)
    assert torch.equal(fresh.embeds["global"], index.embeds["global"]) and fresh.paths == index.paths


def test_in_memory_add_appends_rows():
    index = gi.GalleryIndex(_rows(5), [f"{i}.jpg" for i in range(5)])
    assert isinstance(index, GalleryStore)
    new = _rows(2, seed=3)
    assert index.add(new, ["a.jpg", "b.jpg"]) == 2 and len(index) == 7
    assert index.search(new, top_k=1)[1][0] | {"path": "b.jpg"} == index.search(new, top_k=1)[1][0]
    with pytest.raises(gi.GalleryIndexError, match="cannot be stored"):
        index.add(_rows(1), ["c\\d.jpg"])


def test_library_errors_name_no_cli_flag_and_the_cli_adds_the_hint(built, tmp_path, capsys):
    out = tmp_path / "idx"
    shutil.copytree(built["out"], out)
    extra = tmp_path / "more"
    shutil.copytree(built["images"], extra)
    model, processor = cli.load_model(str(built["model"]))
    with pytest.raises(index_store.IndexMismatchError) as caught:
        index_build.build_index(model, processor, extra, out, progress=False)
    assert "--" not in str(caught.value)
    assert _index(built["model"], extra, out) == 2
    err = capsys.readouterr().err
    assert "different image folder; pass --overwrite to rebuild it" in err
    with pytest.raises(gi.GalleryIndexError) as caught:
        index_build.build_index(model, processor, extra, out, add=True, overwrite=True, progress=False)
    assert "--" not in str(caught.value)


HOSTILE_PATHS = [
    "ok/a.jpg",
    "café/ünïcode.jpg",  # safe, outside ASCII: checked in Python, kept
    "",
    "/etc/passwd",
    "a/../../b.jpg",
    "a\\b.jpg",
    "tab\there.jpg",
    "del\x7f.jpg",
    "c1\x85.jpg",
    "x..y/ok.jpg",  # '..' inside a name is safe
    "//double.jpg",
]


@pytest.mark.parametrize("outside", [False, True])
def test_row_paths_flag_exactly_the_rows_without_a_usable_path(tmp_path, outside):
    db = index_store.open_db(":memory:")
    rows = [(i, p) for i, p in enumerate(HOSTILE_PATHS)] + [
        (len(HOSTILE_PATHS) + 1, b"\xff.jpg")
    ]  # a gap, a blob
    db.executemany("INSERT INTO crops (id, path) VALUES (?, ?)", rows)
    size = len(HOSTILE_PATHS) + 3  # the last id has no row at all
    paths = index_store.RowPaths(lambda: db, tmp_path, size, allow_outside_root=outside)
    paths.CHUNK = 4  # several chunks, one partly absent
    expected = [p is None for p in paths]
    assert paths.missing(0, size).tolist() == expected
    assert paths.missing(3, size).tolist() == expected[3:]
    unsafe = {i for i, p in enumerate(HOSTILE_PATHS) if gi.unsafe_name(p)}
    gaps = {len(HOSTILE_PATHS), len(HOSTILE_PATHS) + 1, len(HOSTILE_PATHS) + 2}
    assert {i for i, bad in enumerate(expected) if bad} == (gaps if outside else unsafe | gaps)
    assert paths[1] == str(tmp_path / "café/ünïcode.jpg") and paths[-1] is None and len(paths) == size
