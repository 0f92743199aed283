"""ANN growth: a gallery grown 8x by many small adds is retrained whenever it calls for more IVF lists and
calibrated again at every doubling, so it answers as well as one built at once; a factory string the user gave
is calibrated again but never retrained; a kill during a retrain or a recalibration loses nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from fixtures import repo_env

from modeling_tagclip.retrieval.embedded import ann as annlib
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build, index_commit

pytestmark = pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")

START, GROWN, ADD = 2048, 16384, 256  # 2k rows grown 8x by 56 adds
GLOBAL, LOCAL, RANK = 32, 64, 16


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.fixture(scope="module")
def gallery():
    """(rows, queries): bench_search.py's generator at 32 + 64 dims: 2 images per identity, identities in a
    16-d subspace plus a direction every crop shares, and noisier text queries of 300 identities across a
    modality gap. Before retraining and recalibrating on growth, the grown index lost 0.03 of recall@10 here."""
    g = torch.Generator().manual_seed(0)
    common = _unit(torch.randn(GLOBAL, generator=g))
    basis = torch.linalg.qr(torch.randn(GLOBAL, RANK, generator=g)).Q
    lift = torch.linalg.qr(torch.randn(LOCAL, GLOBAL, generator=g)).Q
    offsets = torch.linalg.qr(torch.randn(GLOBAL + LOCAL, 4, generator=g)).Q.T
    low = _unit(torch.randn(GROWN // 2, RANK, generator=g) @ basis.T)
    ids = _unit(low + 0.5 * _unit(torch.randn(GROWN // 2, GLOBAL, generator=g)) + 0.4 * common)

    def embed(x: torch.Tensor, noise: float, offset: int) -> dict[str, torch.Tensor]:
        glob = (
            x
            + noise * torch.randn(len(x), GLOBAL, generator=g) / GLOBAL**0.5
            + 1.6 * offsets[offset, :GLOBAL]
        )
        local = x @ lift.T + noise * torch.randn(len(x), LOCAL, generator=g) / LOCAL**0.5
        return {"global": _unit(glob), "local": _unit(local + 1.6 * offsets[offset + 1, GLOBAL:])}

    rows = embed(ids.repeat_interleave(2, 0), 0.6, 0)
    return rows, embed(ids[torch.randperm(GROWN // 2, generator=g)[:300]], 1.5, 2)


def _paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:05d}.jpg" for i in range(start, stop)]


def _part(rows: dict, start: int, stop: int) -> dict:
    return {key: value[start:stop] for key, value in rows.items()}


def _grow(out, rows, stop: int = GROWN, **ann) -> gi.GalleryIndex:
    """An index of ``START`` rows grown by adds of ``ADD`` rows up to ``stop``."""
    index = index_build.index_embeddings(out, _part(rows, 0, START), _paths(0, START), out.parent, **ann)
    for start in range(START, stop, ADD):
        index = index_build.index_embeddings(
            out, _part(rows, start, start + ADD), _paths(start, start + ADD), out.parent
        )
    return index


def _recall(index: gi.GalleryIndex, queries: dict) -> float:
    exact = gi.chunked_topk(queries, index.embeds, 10)[1]
    found = index.topk(queries, 10)[1]
    return float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean())


def _lists(index: gi.GalleryIndex) -> list[int]:
    return [annlib.faiss.extract_index_ivf(ann).nlist for ann in index.ann_indexes]


@pytest.fixture
def one_thread():
    threads = annlib.faiss.omp_get_max_threads()
    annlib.faiss.omp_set_num_threads(1)
    yield
    annlib.faiss.omp_set_num_threads(threads)


def test_retrain_and_recalibration_schedule_is_logarithmic():
    """10k rows grown to 110k by 1,000 adds of 100 (bench_add.py's run): the preset is retrained each time the
    gallery calls for twice its lists (32 -> 64 at 32,768 rows: the lists a fresh build of 110k has) and
    calibrated at each training and at 1.25x the rows of the last calibration (so the settings in use were
    calibrated on at least 0.8x the rows); a user's factory string is only calibrated."""
    for request, expected in (
        (
            "ivf",
            (
                [32_800],
                [12_500, 15_700, 19_700, 24_700, 30_900, 32_800, 41_000, 51_300, 64_200, 80_300, 100_400],
                64,
            ),
        ),
        (
            "PCA128,IVF128,PQ128x4fsr",
            ([], [12_500, 15_700, 19_700, 24_700, 30_900, 38_700, 48_400, 60_500, 75_700, 94_700], 128),
        ),
    ):
        ann = {**annlib.ann_spec(request, 10_000, 1536), "calibrated_rows": 10_000}
        trained, calibrated = [], []
        for total in range(10_100, 110_001, 100):
            if annlib._outgrown(ann, {"ann": request}, total):
                ann = {**annlib.ann_spec(request, total, 1536), "calibrated_rows": total}
                trained.append(total)
                calibrated.append(total)
            elif annlib._calibration_stale(ann, total):
                ann["calibrated_rows"] = total
                calibrated.append(total)
        assert (
            trained,
            calibrated,
            annlib.faiss.extract_index_ivf(annlib.faiss.index_factory(1536, ann["factory"])).nlist,
        ) == expected
    assert annlib.ivf_lists(110_000) == 64
    fixed = {**annlib.ann_spec("ivf", 10_000, 1536, {"nprobe": 8, "k_factor": 20}), "calibrated_rows": 1}
    assert not annlib._calibration_stale(fixed, 10**9)  # nothing left to calibrate
    assert annlib._calibration_stale({**fixed, "fixed": ["nprobe"]}, 2) and not annlib._calibration_stale(
        {**fixed, "fixed": ["nprobe"]}, 1
    )


def test_preset_grown_8x_by_small_adds_answers_as_a_fresh_build(gallery, tmp_path, one_thread):
    rows, queries = gallery
    grown = _grow(tmp_path / "grown", rows, ann="ivf")
    fresh = index_build.index_embeddings(tmp_path / "fresh", rows, _paths(0, GROWN), tmp_path, ann="ivf")
    ann = json.loads((tmp_path / "grown" / "index.json").read_text())["ann"]
    assert _lists(grown) == _lists(fresh) == [annlib.ivf_lists(GROWN)] == [32]
    # trained at 2048 and 8192 rows (16, then 32 lists: where ivf_lists doubles), each training calibrated, and
    # calibrated again at the first add reaching 1.25x the rows of the last: 2560, 3328, 4352, 5632, 7168, then
    # 10240, 12800 and 16128 rows
    assert (ann["trainings"], ann["calibrations"]) == (2, 10)
    assert (ann["trained_rows"], ann["calibrated_rows"]) == (8192, 16128)
    assert ann["calibration"]["recall_at_10"] >= annlib.CALIBRATION_TARGET
    assert len(grown._segments) <= 8 and grown.faiss_index.ntotal == GROWN
    recall_grown, recall_fresh = _recall(grown, queries), _recall(fresh, queries)
    assert recall_fresh >= 0.95 and abs(recall_grown - recall_fresh) <= 0.02, (recall_grown, recall_fresh)


def test_a_users_factory_is_calibrated_again_as_it_grows_but_never_retrained(gallery, tmp_path, one_thread):
    rows, queries = gallery
    factory = "PCA96,IVF32,PQ96x4fsr"
    grown = _grow(tmp_path / "grown", rows, ann=factory)
    trained = (tmp_path / "grown" / "ann_trained.faiss").read_bytes()
    fresh = index_build.index_embeddings(tmp_path / "fresh", rows, _paths(0, GROWN), tmp_path, ann=factory)
    ann = json.loads((tmp_path / "grown" / "index.json").read_text())["ann"]
    assert _lists(grown) == [32] and ann["factory"] == factory and ann["tag"] == ""
    assert [p.name for p in (tmp_path / "grown").glob("ann_trained*")] == ["ann_trained.faiss"]
    assert (tmp_path / "grown" / "ann_trained.faiss").read_bytes() == trained
    # calibrated at 2048, then without retraining at the first add reaching 1.25x the rows of the last: 2560,
    # 3328, 4352, 5632, 7168, 8960, 11264 and 14080 rows
    assert (ann["trainings"], ann["calibrations"], ann["calibrated_rows"]) == (1, 9, 14080)
    assert ann["calibration"]["recall_at_10"] >= annlib.CALIBRATION_TARGET
    # about the choice of a build of the same rows (whose quantizer is trained on all of them, not the first 2k)
    grid, chosen = annlib._probe_grid(32), (ann["params"]["nprobe"], fresh.meta["ann"]["params"]["nprobe"])
    assert abs(grid.index(chosen[0]) - grid.index(chosen[1])) <= 1, chosen
    recall_grown, recall_fresh = _recall(grown, queries), _recall(fresh, queries)
    assert recall_fresh >= 0.95 and abs(recall_grown - recall_fresh) <= 0.02, (recall_grown, recall_fresh)


def _crash_at_manifest(write_json):
    def write(path, obj, *args, **kwargs):
        if path.name == "manifest.json":
            raise OSError("killed before the manifest swap")
        return write_json(path, obj, *args, **kwargs)

    return write


def test_a_crash_during_a_recalibration_keeps_the_committed_index(gallery, tmp_path, monkeypatch, one_thread):
    """The add that takes a factory-string gallery to 1.25x the rows of its last calibration (4352 rows, from
    3328) recalibrates, which writes no file but index.json (before the manifest, as every commit); killed before
    its manifest, the committed 4096 rows and their ANN files answer (with the new search parameters), and the
    rerun ends as an uninterrupted add does."""
    rows, queries = gallery
    factory = "PCA96,IVF32,PQ96x4fsr"
    for name in ("crashed", "clean"):
        _grow(tmp_path / name, rows, stop=4352 - ADD, ann=factory)
    files = sorted(p.name for p in (tmp_path / "crashed").rglob("*.faiss"))
    real = index_commit.write_json
    monkeypatch.setattr(index_commit, "write_json", _crash_at_manifest(real))
    with pytest.raises(OSError, match="killed"):
        index_build.index_embeddings(
            tmp_path / "crashed", _part(rows, 4096, 4352), _paths(4096, 4352), tmp_path
        )
    committed = gi.GalleryIndex.load(tmp_path / "crashed", cache=False)
    assert len(committed) == 4096 and committed.faiss_index.ntotal == 4096
    assert committed.meta["ann"]["calibrated_rows"] == 4352  # index.json went first
    now = {p.name for p in (tmp_path / "crashed").rglob("*.faiss")}
    assert set(files) <= now and {n for n in now if "trained" in n} == {
        "ann_trained.faiss"
    }  # kept, not retrained
    picked = torch.arange(0, 4096, 61)
    assert torch.equal(committed.topk(_part(rows, 0, 4096), 1)[1][picked, 0], picked)
    assert _recall(committed, queries) >= 0.95
    monkeypatch.setattr(index_commit, "write_json", real)
    for name in ("crashed", "clean"):
        index_build.index_embeddings(tmp_path / name, _part(rows, 4096, 4352), _paths(4096, 4352), tmp_path)
    headers = [json.loads((tmp_path / n / "index.json").read_text())["ann"] for n in ("crashed", "clean")]
    assert headers[0] == headers[1] and headers[1]["calibrated_rows"] == 4352
    assert (headers[1]["trainings"], headers[1]["calibrations"]) == (1, 4)  # at 2048, 2560, 3328 and 4352
    manifests = [json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("crashed", "clean")]
    assert manifests[0] == manifests[1]


KILLER = """
import os, signal, sys, torch
from pathlib import Path
from modeling_tagclip.retrieval.embedded import ann, index_build
written = []
real = ann.atomic_write
def atomic_write(path, data):
    real(path, data)
    written.append(Path(path).name)
    if len(written) == 2:  # the new quantizer and one re-encoded segment on disk, the manifest not
        os.kill(os.getpid(), signal.SIGKILL)
ann.atomic_write = atomic_write
out, rows = Path(sys.argv[1]), torch.load(sys.argv[2])
index_build.index_embeddings(out, rows, [f"img/{i:05d}.jpg" for i in range(2560, 8192)], out.parent)
"""


@pytest.mark.slow
def test_kill_9_during_a_retrain_then_rerun_equals_an_uninterrupted_add(gallery, tmp_path):
    """A real SIGKILL while the preset is retrained (IVF16 -> IVF32 at 8192 rows): the committed index still
    loads and answers with its old files, and the rerun gives the files and answers of an uninterrupted add."""
    rows, queries = gallery
    for name in ("killed", "clean"):
        out = tmp_path / name
        index_build.index_embeddings(out, _part(rows, 0, 2048), _paths(0, 2048), tmp_path, ann="ivf")
        index_build.index_embeddings(out, _part(rows, 2048, 2560), _paths(2048, 2560), tmp_path)
    torch.save(_part(rows, 2560, 8192), tmp_path / "new.pt")
    before = gi.GalleryIndex.load(tmp_path / "killed", cache=False).topk(queries, 10)[1]
    run = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path / "killed"), str(tmp_path / "new.pt")],
        env=repo_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert (tmp_path / "killed" / "ann_trained.ivf32.faiss").is_file()  # the retrain had begun
    committed = gi.GalleryIndex.load(tmp_path / "killed", cache=False)
    assert len(committed) == 2560 and _lists(committed) == [16]
    assert torch.equal(committed.topk(queries, 10)[1], before)
    for name in ("killed", "clean"):
        index_build.index_embeddings(tmp_path / name, _part(rows, 2560, 8192), _paths(2560, 8192), tmp_path)
    files = [
        {p.relative_to(tmp_path / n).as_posix(): p.read_bytes() for p in (tmp_path / n).rglob("*.faiss")}
        for n in ("killed", "clean")
    ]
    assert files[0] == files[1] and "ann_trained.ivf32.faiss" in files[0]
    answers = [
        gi.GalleryIndex.load(tmp_path / n, cache=False).topk(queries, 10)[1] for n in ("killed", "clean")
    ]
    assert torch.equal(answers[0], answers[1])
