"""Growing and refusing: a refused ``index_embeddings`` leaves nothing behind, ``--add`` refuses a storage dtype
other than the index's, reports what it added, and the under-2048 ANN warning is shown once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from fixtures import save_tiny_model, synthetic_gallery

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import ann as annlib
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build, index_commit


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("add")
    model_dir = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    return {"root": root, "model_dir": model_dir, "images": images}


def _cli(setup, images, out, *extra) -> int:
    args = ["index", "--model", str(setup["model_dir"]), "--images", str(images), "--out", str(out)]
    return cli.main([*args, "--batch-size", "4", "--workers", "0", "--quiet", *extra])


def _half_gallery(setup, folder):
    shutil.copytree(setup["images"], folder)
    shutil.rmtree(folder / "test")
    return folder


def _rows(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"global": torch.nn.functional.normalize(torch.randn(count, 8, generator=generator), dim=-1)}


def _paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:03d}.jpg" for i in range(start, stop)]


def _snapshot(folder) -> dict[str, bytes]:
    """Every file's bytes (not SQLite's -wal/-shm, which come and go with open connections)."""
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.endswith(("-wal", "-shm"))]
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


def test_refused_embeddings_leave_no_folder_and_an_index_unchanged(tmp_path):
    rows = _rows(4)
    rows["global"][2, 0] = float("nan")
    out = tmp_path / "idx"
    with pytest.raises(
        ValueError, match=r"non-finite \(NaN/inf\) global embedding for image 2 \(img/002.jpg\)"
    ):
        index_build.index_embeddings(out, rows, _paths(0, 4), tmp_path)
    assert not out.exists()  # was: index.json left behind, so `tagclip search` called it incomplete
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="non-finite"):
        index_build.index_embeddings(tmp_path / "empty", rows, _paths(0, 4), tmp_path)
    assert list((tmp_path / "empty").iterdir()) == []
    with pytest.raises(ValueError, match=r"4 paths but these embeds have other row counts: \{'global': 3\}"):
        index_build.index_embeddings(out, {"global": rows["global"][:3]}, _paths(0, 4), tmp_path)
    assert not out.exists()
    index_build.index_embeddings(out, _rows(4), _paths(0, 4), tmp_path)
    before = _snapshot(out)
    with pytest.raises(ValueError, match="non-finite"):
        index_build.index_embeddings(out, rows, _paths(4, 8), tmp_path)
    assert _snapshot(out) == before and len(gi.GalleryIndex.load(out, cache=False)) == 4


def test_adding_embeddings_refuses_other_fixed_settings(tmp_path):
    out = tmp_path / "idx"
    index_build.index_embeddings(out, _rows(4), _paths(0, 4), tmp_path, store_dtype="fp16")
    before = _snapshot(out)
    with pytest.raises(gi.GalleryIndexError, match=r"storage dtype of .* is fixed when it is built \(fp16\)"):
        index_build.index_embeddings(out, _rows(4, 1), _paths(4, 8), tmp_path, store_dtype="fp32")
    assert _snapshot(out) == before
    grown = index_build.index_embeddings(out, _rows(4, 1), _paths(4, 8), tmp_path)
    assert len(grown) == 8 and grown.embeds["global"].dtype == torch.float16


def test_add_with_another_store_dtype_is_refused_and_counts_are_reported(setup, tmp_path, capsys):
    folder = _half_gallery(setup, tmp_path / "images")
    out = tmp_path / "idx"
    train, total = len(gi.list_images(folder)), len(gi.list_images(setup["images"]))
    assert _cli(setup, folder, out, "--store-dtype", "fp16") == 0
    assert f"indexed {train} images" in capsys.readouterr().out
    shutil.copytree(setup["images"] / "test", folder / "test")
    before = _snapshot(out)
    assert _cli(setup, folder, out, "--add", "--store-dtype", "fp32") == 2  # was: silently stored fp16
    err = capsys.readouterr().err
    assert "storage dtype of" in err and "fixed when it is built (fp16)" in err and "--store-dtype" in err
    assert _snapshot(out) == before
    assert _cli(setup, folder, out, "--add", "--store-dtype", "fp16") == 0  # the index's own dtype is fine
    assert f"added {total - train} images from {folder} to {out}, now {total} " in capsys.readouterr().out
    assert _cli(setup, folder, out, "--add") == 0  # was: "indexed 20 images" although none was added
    assert f"added 0 images from {folder} to {out}, now {total} " in capsys.readouterr().out
    assert gi.GalleryIndex.load(out, cache=False).embeds["global"].dtype == torch.float16


@pytest.mark.slow
@pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")
def test_ann_not_built_warning_is_printed_once(setup, tmp_path):
    """In a real process (pytest would record the warning instead of printing it)."""
    args = [
        "index",
        "--model",
        str(setup["model_dir"]),
        "--images",
        str(setup["images"]),
        "--out",
        str(tmp_path / "idx"),
        "--workers",
        "0",
        "--quiet",
        "--ann",
        "ivf",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "modeling_tagclip.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    err = run.stderr
    assert run.returncode == 0 and err.count("not built yet") == 1, err  # was: warnings.warn's line + a print
    assert "tagclip index: warning: ANN index 'ivf' not built yet: 20 images < 2048" in err
    with pytest.warns(UserWarning, match="not built yet: 4 images"):  # the library still warns
        index_build.index_embeddings(tmp_path / "lib", _rows(4), _paths(0, 4), tmp_path, ann="ivf")
    assert json.loads((tmp_path / "lib" / "index.json").read_text())["ann"] is None


def _clustered(count: int, dim: int = 16) -> dict[str, torch.Tensor]:
    """Unit ``global`` and ``local`` rows around count / 8 identity centres."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(count // 8, 2 * dim, generator=generator).repeat_interleave(8, 0)
    rows = torch.nn.functional.normalize(
        centres + 0.3 * torch.randn(count, 2 * dim, generator=generator), dim=-1
    )
    unit = torch.nn.functional.normalize
    return {"global": unit(rows[:, :dim], dim=-1), "local": unit(rows[:, dim:], dim=-1)}


def _crash_at_manifest(write_json):
    """``write_json`` that dies where the manifest would be replaced (the commit point)."""

    def write(path, obj, *args, **kwargs):
        if path.name == "manifest.json":
            raise OSError("killed before the manifest swap")
        return write_json(path, obj, *args, **kwargs)

    return write


def _lists(index) -> list[int]:
    return [annlib.faiss.extract_index_ivf(ann).nlist for ann in index.ann_indexes]


@pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")
def test_add_retrains_an_outgrown_ann_quantizer_and_a_crash_keeps_the_old_one(tmp_path, monkeypatch):
    """IVF16 trained at 2048 rows stays at 2304 (16 lists wanted) and is retrained at 8192 (32 = 2x): every
    segment re-encoded from its stored rows under new file names, the old files deleted after the commit."""
    threads = annlib.faiss.omp_get_max_threads()
    annlib.faiss.omp_set_num_threads(1)
    rows, out = _clustered(8192), tmp_path / "idx"
    part = lambda a, b: {key: value[a:b] for key, value in rows.items()}  # noqa: E731
    try:
        index_build.index_embeddings(out, part(0, 2048), _paths(0, 2048), tmp_path, ann="ivf")
        trained = (out / "ann_trained.faiss").read_bytes()
        first = json.loads((out / "index.json").read_text())["ann"]
        assert first["params"]["nprobe"] in annlib._probe_grid(16) and first["calibration"]["queries"] > 0
        assert (first["trainings"], first["calibrations"], first["calibrated_rows"]) == (1, 1, 2048)
        kept = index_build.index_embeddings(out, part(2048, 2304), _paths(2048, 2304), tmp_path)
        assert _lists(kept) == [16] and kept.meta["ann"]["calibrations"] == 1  # 1.125x: kept, not calibrated
        assert (out / "ann_trained.faiss").read_bytes() == trained
        real = index_commit.write_json
        monkeypatch.setattr(index_commit, "write_json", _crash_at_manifest(real))
        with pytest.raises(OSError, match="killed"):
            index_build.index_embeddings(out, part(2304, 8192), _paths(2304, 8192), tmp_path)
        before = gi.GalleryIndex.load(out, cache=False)  # the committed index, its files untouched
        assert len(before) == 2304 and _lists(before) == [16]
        old_rows = torch.arange(0, 2304, 97)  # searchable, though index.json already names the IVF32 retrain
        assert torch.equal(before.topk({k: v[old_rows] for k, v in rows.items()}, 1)[1][:, 0], old_rows)
        monkeypatch.setattr(index_commit, "write_json", real)

        grown = index_build.index_embeddings(out, part(2304, 8192), _paths(2304, 8192), tmp_path)
    finally:
        annlib.faiss.omp_set_num_threads(threads)
    header = json.loads((out / "index.json").read_text())
    assert "IVF32," in header["ann"]["factory"]  # retrained, and calibrated again for 32 lists
    assert (
        header["ann"]["params"]["nprobe"] in annlib._probe_grid(32)
        and header["ann"]["calibration"]["queries"]
    )
    assert (header["ann"]["trainings"], header["ann"]["calibrations"]) == (2, 2)
    assert header["ann"]["trained_rows"] == header["ann"]["calibrated_rows"] == 8192
    manifest = json.loads((out / "manifest.json").read_text())
    names = [s["ann_file"] for s in manifest["segments"]]
    assert names == [f"segments/seg_{start:010d}.ivf32.faiss" for start in (0, 2048, 2304)]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.faiss"))
    assert on_disk == sorted([*names, "ann_trained.ivf32.faiss"])  # the IVF16 files are gone
    assert _lists(grown) == [32] and grown.faiss_index.ntotal == 8192  # the segments' lists, merged
    picked = torch.arange(0, 8192, 97)
    queries = {key: value[picked] for key, value in rows.items()}
    assert torch.equal(grown.topk(queries, 1)[1][:, 0], picked)  # old and new rows find themselves
    exact = gi.chunked_topk(queries, grown.embeds, 10)[1]
    found = grown.topk(queries, 10)[1]
    assert float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean()) >= 0.95


@pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")
def test_nprobe_above_the_list_count_probes_every_list(tmp_path):
    """`--ann-param nprobe=256` on an IVF16 gallery (or index.json's nprobe after a retrain the manifest did not
    reach): faiss's FastScan IVF returned wrong rows for nprobe > nlist; now it probes all 16 lists."""
    rows = _clustered(2048)
    index = index_build.index_embeddings(
        tmp_path / "idx", rows, _paths(0, 2048), tmp_path, ann="ivf", ann_params={"nprobe": 256}
    )
    assert index.meta["ann"]["params"]["nprobe"] == 256
    assert [annlib.faiss.extract_index_ivf(ann).nprobe for ann in index.ann_indexes] == [16]
    picked = torch.arange(0, 2048, 41)
    assert torch.equal(index.topk({k: v[picked] for k, v in rows.items()}, 1)[1][:, 0], picked)
