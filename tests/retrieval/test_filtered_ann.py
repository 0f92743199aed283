"""Filtered ANN search: filters applied inside the IVF scan hold recall at the unfiltered level at 50/10/1/0.1%
of the rows kept, also on a gallery grown by adds; the exact/ANN crossover (known answers, and the path a search
takes on either side of a measured one); a filter's rows are read from SQLite once, until a removal."""

from __future__ import annotations

import itertools

import pytest
import torch

from modeling_tagclip.retrieval.embedded import filtered as fl
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build

faiss = pytest.importorskip("faiss")

SIZE, DIM, START = 32768, 32, 1_700_000_000
FRACTIONS = (0.5, 0.1, 0.01, 0.001)
MARGIN = 0.02  # filtered recall@10 may trail the unfiltered one by this much


pytestmark = pytest.mark.usefixtures("faiss_one_thread")


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.fixture(scope="module")
def data():
    return make_data()


def make_data():
    """A clustered gallery (``global`` + TSE) with noisy text-like queries, and a random time per row (so a
    time window keeps a random share of the rows, spread over every IVF list) and a camera per row."""
    g = torch.Generator().manual_seed(0)
    centres = unit(torch.randn(SIZE // 8, 2 * DIM, generator=g))
    gallery = unit(centres.repeat_interleave(8, 0) + 0.5 * torch.randn(SIZE, 2 * DIM, generator=g) / DIM**0.5)
    picked = centres[torch.randint(0, centres.shape[0], (100,), generator=g)]
    queries = unit(picked + 0.9 * torch.randn(100, 2 * DIM, generator=g) / DIM**0.5)
    split = lambda x: {"global": unit(x[:, :DIM]), "local": unit(x[:, DIM:])}  # noqa: E731
    times = torch.randperm(SIZE, generator=g)
    return split(gallery), split(queries), times


def paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:06d}.jpg" for i in range(start, stop)]


def metadata(times: torch.Tensor, start: int, stop: int) -> dict[str, dict]:
    return {
        f"img/{i:06d}.jpg": {"camera": str(i % 7), "timestamp": START + int(times[i])}
        for i in range(start, stop)
    }


def build(out, data, cuts=(0, SIZE)) -> gi.GalleryIndex:
    """The gallery written by one commit per [cuts[j], cuts[j+1]) (the first trains the ``ivf`` preset)."""
    gallery, _, times = data
    for j, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        extra = {"ann": "ivf", "ann_params": {"nprobe": 24, "k_factor": 20}} if j == 0 else {}  # of 64 lists
        rows = {key: value[lo:hi] for key, value in gallery.items()}
        index_build.index_embeddings(
            out, rows, paths(lo, hi), out.parent, metadata=metadata(times, lo, hi), **extra
        )
    return gi.GalleryIndex.load(out, cache=False)


def recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    return float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean())


def window(fraction: float) -> dict:
    """A time window keeping ``fraction`` of the rows (their times are a permutation of 0..SIZE-1)."""
    return {"after": START + 1000, "before": START + 1000 + round(fraction * SIZE)}


def filtered_recalls(index: gi.GalleryIndex, queries, times, monkeypatch) -> dict[float, float]:
    """Recall@10 of the filtered ANN (the ANN path forced) against the exact filtered top-10, per kept share."""
    monkeypatch.setattr(index, "crossover_rows", lambda: 0)
    searched, real = [], index._ann
    monkeypatch.setattr(index, "_ann", lambda *a: searched.append(1) or real(*a))
    out = {}
    for fraction in FRACTIONS:
        spec = window(fraction)
        allowed = (times >= 1000) & (times < 1000 + round(fraction * SIZE))
        searched.clear()
        found = index.topk(queries, 10, filters=spec)[1]
        assert searched and allowed[found].all()
        out[fraction] = recall(found, gi.chunked_topk(queries, index.embeds, 10, mask=allowed)[1])
    return out


def test_filtered_ann_recall_holds_at_the_unfiltered_level_at_every_kept_share(data, tmp_path, monkeypatch):
    _, queries, times = data
    index = build(tmp_path / "idx", data)
    unfiltered = recall(index.topk(queries, 10)[1], gi.chunked_topk(queries, index.embeds, 10)[1])
    assert unfiltered >= 0.8
    found = filtered_recalls(index, queries, times, monkeypatch)
    assert all(value >= unfiltered - MARGIN for value in found.values()), (unfiltered, found)
    monkeypatch.setattr(fl, "FILTER_PROBE_POWER", 0.0)  # nprobe not adapted: recall falls with the kept share
    unadapted = filtered_recalls(index, queries, times, monkeypatch)
    assert unadapted[0.1] < unfiltered - 0.1 and unadapted[0.01] < unfiltered - 0.2, (unfiltered, unadapted)


def test_filtered_ann_on_segments_after_adds_answers_as_well(data, tmp_path, monkeypatch):
    _, queries, times = data
    grown = build(tmp_path / "idx", data, (0, 16384, 20480, 24576, 28672, SIZE))
    assert len(grown.ann_indexes) == 1 and grown.faiss_index.ntotal == SIZE
    unfiltered = recall(grown.topk(queries, 10)[1], gi.chunked_topk(queries, grown.embeds, 10)[1])
    found = filtered_recalls(grown, queries, times, monkeypatch)
    assert all(value >= unfiltered - MARGIN for value in found.values()), (unfiltered, found)
    again = gi.GalleryIndex.load(tmp_path / "idx", cache=False)  # a fresh reader: the same answers
    monkeypatch.setattr(again, "crossover_rows", lambda: 0)
    spec = {"camera": ["2", "5"], **window(0.1)}
    assert torch.equal(again.topk(queries, 10, filters=spec)[1], grown.topk(queries, 10, filters=spec)[1])


def near(value: int, expected: int) -> bool:
    """Within the 0.5% step of the row counts ``crossover_rows`` tries."""
    return abs(value - expected) <= 0.005 * expected


def test_crossover_rows_known_answers():
    exact = {1000: 1.0, 8000: 8.0}  # 1 us a row, no fixed cost
    assert near(fl.crossover_rows(100_000, exact, {0.001: 5.0, 0.5: 5.0}), 5000)  # flat ANN: 5 ms = 5000 rows
    assert near(fl.crossover_rows(100_000, exact, {0.001: 0.5, 0.5: 0.5}), 500)
    assert fl.crossover_rows(100_000, exact, {0.001: 200.0, 0.5: 200.0}) == 100_000  # exact is always cheaper
    assert fl.crossover_rows(100_000, {1000: 3.0, 8000: 10.0}, {0.001: 1.0}) == 0  # 2 ms fixed: never exact
    # ANN 20 ms at 1%, 2 ms at 10%: linear in log(kept share) between, they meet at 6 ms: 20 - 18 log10(6) = 6
    assert near(fl.crossover_rows(100_000, exact, {0.01: 20.0, 0.1: 2.0}), 6000)


def test_filtered_nprobe_known_answers():
    assert fl.filtered_nprobe(16, 256, 1.0) == 16
    assert fl.filtered_nprobe(16, 256, 0.25) == 32  # nprobe / sqrt(kept share)
    assert fl.filtered_nprobe(16, 256, 0.01) == 160
    assert fl.filtered_nprobe(16, 256, 0.001) == 256  # at most every list


def test_the_recorded_timings_reproduce_the_recorded_crossover():
    """The crossover is decided on the rounded timings it records, so a reader recomputes the same rows
    (it was decided on unrounded ones: 1997 recorded, 1992 recomputed, on a CI run)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):  # random timings with more digits than recorded, around a real crossover
        durations = (torch.rand(64, generator=generator, dtype=torch.float64) * 1e-3).tolist()
        clock = iter(itertools.accumulate(durations)).__next__
        measured = fl.measure_crossover(SIZE, lambda rows: None, lambda picked: None, clock=clock)
        exact = {int(n): ms for n, ms in measured["exact_ms"].items()}
        ann = {float(f): ms for f, ms in measured["ann_ms"].items()}
        assert measured["crossover_rows"] == fl.crossover_rows(SIZE, exact, ann), measured


def test_the_crossover_is_measured_once_recorded_and_chooses_the_path(data, tmp_path, monkeypatch):
    _, queries, _ = data
    index = build(tmp_path / "idx", data)
    described = index.describe()["filtered_search"]
    assert (
        set(described["ann_ms"]) == {str(f) for f in fl.CROSSOVER_FRACTIONS}
        and len(described["exact_ms"]) == 2
    )
    assert (
        described["crossover_rows"]
        == fl.crossover_rows(
            SIZE,
            {int(n): ms for n, ms in described["exact_ms"].items()},
            {float(f): ms for f, ms in described["ann_ms"].items()},
        )
        and 0 <= described["crossover_fraction"] <= 1
    )
    index.crossover = {**described, "crossover_rows": 1000}  # as if measured: 1000 rows
    searched, real = [], index._ann
    monkeypatch.setattr(index, "_ann", lambda *a: searched.append(1) or real(*a))
    index.topk(queries, 10, filters=window(1000 / SIZE))  # 1000 rows: exact
    assert not searched
    index.topk(queries, 10, filters=window(1001 / SIZE))  # 1001 rows: the filtered ANN
    assert searched


def test_a_filter_is_read_from_sqlite_once_until_a_removal(data, tmp_path, monkeypatch):
    _, queries, _ = data
    index = build(tmp_path / "idx", data)
    calls, real = [], gi.allowed_mask
    monkeypatch.setattr(gi, "allowed_mask", lambda *a: calls.append(1) or real(*a))
    spec = {"camera": "3", **window(0.5)}
    first = index.topk(queries, 10, filters=spec)[1]
    assert torch.equal(index.topk(queries, 10, filters=dict(spec))[1], first) and len(calls) == 1
    index.topk(queries, 10, filters={"view": None, "camera": ["3"], **window(0.5)})  # the same SQL
    assert len(calls) == 1
    index.topk(queries, 10, filters={"camera": "4"})
    assert len(calls) == 2
    writer = gi.GalleryIndex.load(tmp_path / "idx", cache=False)
    writer.remove(ids=[int(first[0, 0])])
    again = index.topk(queries, 10, filters=spec)[1]
    assert len(calls) == 3 and int(first[0, 0]) not in again[0].tolist()
