"""Filtered search of the embedded gallery index: the rows a filter keeps, cached per filter; the ANN's nprobe
for the kept fraction; and the measured crossover below which an exact scan of the kept rows is cheaper.

A filter's rows come from one SQLite query. The row mask, its row ids and the faiss ``IDSelectorBitmap`` built
from it are cached per distinct filter (``SelectionCache``), keyed by the filter's SQL, the gallery's state and
how many rows are removed: a repeated filter costs one indexed ``COUNT``, no per-row Python. Inside the IVF scan
the selector keeps only those rows; so that the probed lists hold as many kept rows as an unfiltered search
sees, nprobe grows as the kept fraction shrinks (``filtered_nprobe``: nprobe / sqrt(kept fraction)). Below ``crossover`` rows the kept rows
are ranked exactly instead: the crossover is measured on the loaded index at its first filtered search (a
timed exact scan at two sizes against the filtered ANN at ``CROSSOVER_FRACTIONS`` of the rows), and
``GalleryIndex.describe`` reports it.

Hub custom-code compatible: only the standard library and torch are imported; faiss and numpy are optional.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..gallery_types import SearchFilter
from .index_store import filter_sql

__all__ = [
    "CROSSOVER_FRACTIONS",
    "FILTER_PROBE_POWER",
    "Selection",
    "SelectionCache",
    "crossover_rows",
    "filtered_nprobe",
    "measure_crossover",
    "removed_count",
    "selection_key",
]

# nprobe / kept_fraction ** this. On tests/retrieval/test_filtered_ann.py's gallery (nprobe 64 of 512 lists,
# unfiltered recall@10 0.83), 0 (no adaptation) gave 0.78 / 0.66 / 0.50 at 50 / 10 / 1% kept; 0.5 gave
# 0.84 / 0.91 / 1.00 (1.0, as many kept rows probed as unfiltered, costs twice the lists of 0.5 at 25% kept).
FILTER_PROBE_POWER = 0.5
CROSSOVER_FRACTIONS = (0.5, 0.1, 0.01, 0.001)  # kept fractions the filtered ANN is timed at
CROSSOVER_QUERIES = 5  # batch-1 queries timed per measurement (the median counts)
CROSSOVER_EXACT_ROWS = 8192  # the exact scan is timed over this many rows and an eighth of them
SELECTION_CACHE = 16  # distinct filters whose rows and selector are kept


class Selection:
    """The rows one filter keeps: ``mask`` (bool [N], None = every row), ``allowed`` (how many), and, built on
    first use and kept, their sorted ids and a faiss ``IDSelectorBitmap`` over them."""

    def __init__(self, mask: torch.Tensor | None, size: int):
        self.mask, self.size = mask, size
        self.allowed = size if mask is None else int(mask.sum())
        self._rows: torch.Tensor | None = None
        self._selector: Any = None
        self._bitmap: Any = None  # the packed bits the selector reads: kept alive with it

    @property
    def fraction(self) -> float:
        """The share of the gallery's rows kept (1.0 without a mask)."""
        return self.allowed / self.size if self.size else 1.0

    def rows(self) -> torch.Tensor:
        """The kept row ids, ascending."""
        if self._rows is None:
            self._rows = torch.arange(self.size) if self.mask is None else self.mask.nonzero().squeeze(1)
        return self._rows

    def selector(self, faiss: Any) -> Any:
        """A faiss ``IDSelectorBitmap`` of the kept rows (None without a mask)."""
        if self.mask is None:
            return None
        if self._selector is None:
            import numpy as np

            self._bitmap = np.packbits(self.mask.numpy(), bitorder="little")
            self._selector = faiss.IDSelectorBitmap(len(self._bitmap), faiss.swig_ptr(self._bitmap))
        return self._selector


class SelectionCache:
    """The ``Selection`` of the last ``SELECTION_CACHE`` distinct filters (least recently used dropped)."""

    def __init__(self, size: int = SELECTION_CACHE):
        self.size, self._entries = size, OrderedDict()

    def get(self, key: tuple, build: Callable[[], Selection]) -> Selection:
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = self._entries[key] = build()
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


def removed_count(db: sqlite3.Connection) -> int:
    """Rows flagged removed (an indexed count: what invalidates a cached selection besides a new commit)."""
    return int(db.execute("SELECT count(*) FROM crops WHERE removed = 1").fetchone()[0])


def selection_key(spec: SearchFilter | None, generation: int, removed: int) -> tuple:
    """A hashable key of a filter's rows: its SQL and parameters, the index's generation and removed count."""
    where = None if spec is None else (lambda sql, params: (sql, tuple(params)))(*filter_sql(spec))
    track = None if spec is None else spec.track is not None  # a v2 database keeps no tracks
    return where, track, generation, removed


def filtered_nprobe(nprobe: int, nlist: int, fraction: float) -> int:
    """The lists to probe when ``fraction`` of the rows are kept: ``nprobe / fraction ** FILTER_PROBE_POWER``,
    at most every list."""
    if fraction >= 1.0:
        return min(nprobe, nlist)
    return min(nlist, math.ceil(nprobe / max(fraction, 1e-12) ** FILTER_PROBE_POWER))


def crossover_rows(size: int, exact_ms: dict[int, float], ann_ms: dict[float, float]) -> int:
    """The most kept rows at which an exact scan is no dearer than the filtered ANN. ``exact_ms``: measured
    ms of the exact scan at two row counts (a line through them); ``ann_ms``: ms of the filtered ANN per
    kept fraction, linear in log(fraction) between the measured ones and flat beyond them."""
    (n0, t0), (n1, t1) = sorted(exact_ms.items())
    per_row = max(0.0, (t1 - t0) / (n1 - n0)) if n1 != n0 else t1 / max(n1, 1)
    fixed = max(0.0, t0 - per_row * n0)
    known = sorted(ann_ms.items())
    logs = torch.tensor([math.log(f) for f, _ in known], dtype=torch.float64)
    costs = torch.tensor([ms for _, ms in known], dtype=torch.float64)
    counts = torch.logspace(0, math.log10(max(size, 1)), 4096, dtype=torch.float64).round().unique()
    where = torch.log(counts / size).clamp(float(logs[0]), float(logs[-1]))
    step = torch.searchsorted(logs, where).clamp(1, len(known) - 1) if len(known) > 1 else None
    if step is None:
        ann = costs.expand(len(counts))
    else:
        lo, hi = logs[step - 1], logs[step]
        share = ((where - lo) / (hi - lo)).clamp(0, 1)
        ann = costs[step - 1] + share * (costs[step] - costs[step - 1])
    dearer = (fixed + per_row * counts > ann).nonzero()
    if not len(dearer):
        return size
    first = int(dearer[0, 0])
    return int(counts[first - 1]) if first else 0


def measure_crossover(
    size: int,
    exact: Callable[[torch.Tensor], Any],
    ann: Callable[[Selection], Any],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Time ``exact(rows)`` (an exact scan of those row ids) at ``CROSSOVER_EXACT_ROWS`` rows and an eighth
    of them, and ``ann(selection)`` (the filtered ANN) at each of ``CROSSOVER_FRACTIONS`` of the rows (fixed
    random rows), each the median of ``CROSSOVER_QUERIES`` calls after a warm-up; returns the crossover and
    what was measured (ms)."""
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(size, generator=generator)
    big = min(size, CROSSOVER_EXACT_ROWS)
    exact_ms = {
        n: _median_ms(lambda n=n: exact(order[:n].sort().values), clock) for n in {max(1, big // 8), big}
    }
    if len(exact_ms) == 1:  # a gallery of one row
        exact_ms[0] = 0.0
    ann_ms = {}
    for fraction in CROSSOVER_FRACTIONS:
        mask = torch.zeros(size, dtype=torch.bool)
        mask[order[: max(1, round(fraction * size))]] = True
        picked = Selection(mask, size)
        ann_ms[fraction] = _median_ms(lambda picked=picked: ann(picked), clock)
    exact_ms = {n: round(ms, 4) for n, ms in sorted(exact_ms.items())}  # what is recorded is what decides
    ann_ms = {f: round(ms, 4) for f, ms in sorted(ann_ms.items())}
    rows = crossover_rows(size, exact_ms, ann_ms)
    return {
        "crossover_rows": rows,
        "crossover_fraction": round(rows / size, 6) if size else 0.0,
        "exact_ms": {str(n): ms for n, ms in exact_ms.items()},
        "ann_ms": {str(f): ms for f, ms in ann_ms.items()},
        "measured": f"at the first filtered search, wall clock, median of {CROSSOVER_QUERIES} batch-1 queries",
    }


def _median_ms(call: Callable[[], Any], clock: Callable[[], float]) -> float:
    call()
    times = []
    for _ in range(CROSSOVER_QUERIES):
        start = clock()
        call()
        times.append(1000 * (clock() - start))
    return sorted(times)[len(times) // 2]
