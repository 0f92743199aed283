"""The re-rank store of a gallery index: stored rows in fp32, fp16 or int8, read across segments without joining them.

- ``int8`` stores each embedding row as int8 codes and one float32 scale per row (``<key>_scale``:
  symmetric, ``max |x| / 127``), 1 byte a dimension instead of 2 (fp16); ``dequantize`` gives the float rows.
- ``SegmentedRows`` reads the rows of several tensors (the segments of a loaded index, memory-mapped) as one
  ``[N, ...]`` tensor by slice, index tensor or int: a gather touches only the rows it reads.
- ``release_free_heap`` hands the memory a load freed back to the system (glibc keeps up to 64 MiB of it).

Hub custom-code compatible: only the standard library and torch are imported.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import math
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "INT8_MAX",
    "STORE_DTYPES",
    "SCALE",
    "RowPlan",
    "SegmentedRows",
    "decoded",
    "dequantize",
    "dequantized",
    "embedding_keys",
    "joined",
    "non_finite_rows",
    "quantize_int8",
    "release_free_heap",
    "store_rows",
    "take",
]

STORE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
INT8_MAX = 127
SCALE = "_scale"  # ``global_scale``: the per-row scale of the int8 ``global`` rows


def quantize_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [N, D], float32 scales [N]) of float rows: symmetric per row, ``x ~= codes * scale``."""
    rows = rows.float()
    scale = rows.abs().amax(dim=1) / INT8_MAX
    codes = torch.round(rows / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return codes.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def store_rows(rows: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Encoded rows as a segment stores them: embeddings in ``dtype`` (int8: codes plus ``<key>_scale``),
    ``view_probs`` as they are."""
    out = {}
    for key, value in rows.items():
        if key == "view_probs" or key.endswith(SCALE):
            out[key] = value
        elif dtype == torch.int8:
            out[key], out[key + SCALE] = quantize_int8(value)
        else:
            out[key] = value.to(dtype)
    return out


def embedding_keys(rows: dict[str, Any]) -> list[str]:
    """The embedding keys of stored rows (``global``, ``local``), without view probabilities and scales."""
    return [key for key in rows if key != "view_probs" and not key.endswith(SCALE)]


def take(rows: Any, index: Any) -> torch.Tensor:
    """``rows[index]``; a 1-d tensor of row ids of a tensor is gathered by ``index_select``, which copies whole
    rows (on the CPU, half the time of advanced indexing for fp16 rows: the re-ranking's gather); a ``RowPlan``
    is read from the ``SegmentedRows`` it was made for."""
    if isinstance(index, RowPlan):
        if not isinstance(rows, SegmentedRows):
            raise TypeError(f"a RowPlan is read from SegmentedRows, not from {type(rows).__name__}")
        return rows.read(index)
    if isinstance(rows, torch.Tensor) and isinstance(index, torch.Tensor) and index.dim() == 1:
        if index.dtype == torch.bool:
            index = index.nonzero().squeeze(1)
        return rows.index_select(0, index.long())
    return rows[index]


def dequantize(rows: dict[str, Any], key: str, index: Any) -> torch.Tensor:
    """float32 ``rows[key][index]``: int8 codes times their row scales, fp16/fp32 converted. The codes' float
    copy is scaled in place (a second [rows, dim] product made the re-ranking of 600 candidates 7x slower)."""
    value = take(rows[key], index).float()
    scale = rows.get(key + SCALE)
    return value if scale is None else value.mul_(take(scale, index).float().unsqueeze(-1))


def dequantized(rows: dict[str, Any], keys: Sequence[str], index: Any) -> dict[str, torch.Tensor]:
    """``dequantize`` of each key at ``index``. Where the rows are ``SegmentedRows`` of one layout, a 1-d index
    tensor is located in the segments once for every key and scale (``SegmentedRows.plan``), not once each: the
    re-ranking of a gallery grown by many adds (``bench_add.py``'s ANN figure) then costs little more than one
    of a gallery built at once."""
    stored = [rows[key] for key in keys] + [rows[key + SCALE] for key in keys if key + SCALE in rows]
    if (
        isinstance(index, torch.Tensor)
        and index.dim() == 1
        and stored
        and all(isinstance(value, SegmentedRows) and value._starts == stored[0]._starts for value in stored)
    ):
        index = stored[0].plan(index)
    return {key: dequantize(rows, key, index) for key in keys}


def decoded(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored rows with float embeddings (int8 dequantised, the scale keys dropped)."""
    out = {key: dequantize(rows, key, slice(None)) for key in embedding_keys(rows)}
    return out | ({"view_probs": rows["view_probs"]} if "view_probs" in rows else {})


CHECK_CHUNK_BYTES = 1 << 20  # the rows ``non_finite_rows`` checks at once: its temporaries stay a few MiB


def non_finite_rows(embeds: dict[str, Any], chunk_bytes: int = CHECK_CHUNK_BYTES) -> torch.Tensor:
    """Bool [N]: rows with a NaN/inf value in any tensor, checked ``chunk_bytes`` of rows at a time (``isfinite``
    makes temporaries several times the rows it checks: a whole store at once would double a load's peak)."""
    size = embeds["global"].shape[0]
    bad = torch.zeros(size, dtype=torch.bool)
    for value in embeds.values():
        row_bytes = max(1, math.prod(value.shape[1:]) * torch.empty((), dtype=value.dtype).element_size())
        chunk = max(1, chunk_bytes // row_bytes)
        for start in range(0, size, chunk):
            part = value[start : start + chunk].reshape(min(chunk, size - start), -1)
            bad[start : start + chunk] |= ~torch.isfinite(part).all(dim=1)
    return bad


class RowPlan(NamedTuple):
    """Where asked rows sit in the parts of ``SegmentedRows`` with part boundaries ``starts``: one plan reads
    the same rows of every key (``SegmentedRows.read``)."""

    starts: list[int]
    count: int  # rows asked
    pieces: list[tuple[int, int, int, torch.Tensor]]  # (part, lo, hi, row ids in the part): output rows lo:hi
    inverse: torch.Tensor | None  # puts the rows, read ascending, back in the asked order (None: asked so)


class SegmentedRows:
    """Rows of several tensors (segments, in row order) read as one ``[N, ...]`` tensor: ``rows[a:b]`` (a view
    when inside one part), ``rows[index_tensor]`` (gathered part by part), ``rows[i]``; never joined whole."""

    def __init__(self, parts: Sequence[torch.Tensor]):
        parts = [part for part in parts if part.shape[0]] or list(parts[:1])
        if not parts:
            raise ValueError("SegmentedRows needs at least one part")
        self.parts = parts
        sizes = torch.tensor([part.shape[0] for part in parts], dtype=torch.long)
        self.starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        self._starts = self.starts.tolist()
        self.shape = torch.Size([int(self.starts[-1]), *parts[0].shape[1:]])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: Any) -> torch.Tensor:
        if isinstance(rows, slice):
            return self._slice(*rows.indices(len(self)))
        if isinstance(rows, int):
            if not -len(self) <= rows < len(self):
                raise IndexError(f"row index {rows} out of range for {len(self)} rows")
            row = rows % len(self)
            p = bisect.bisect_right(self._starts, row) - 1
            return self.parts[p][row - self._starts[p]]
        rows = torch.as_tensor(rows)
        if rows.dtype == torch.bool:
            rows = rows.nonzero().squeeze(1)
        return self.read(self.plan(rows.reshape(-1))).reshape(rows.shape + self.shape[1:])

    def plan(self, flat: torch.Tensor) -> RowPlan:
        """Where rows ``flat`` (1-d) sit in the parts. Ascending rows (the re-ranking sorts its candidates) are
        read as they are; others are sorted first and put back in the asked order after the read. A Boolean
        mask asks for the rows it marks."""
        flat = flat.nonzero().squeeze(1) if flat.dtype == torch.bool else flat.long()
        ascending = len(flat) < 2 or bool((flat[1:] >= flat[:-1]).all())
        rows, order = (flat, None) if ascending else flat.sort()
        if len(rows) and (int(rows[0]) < 0 or int(rows[-1]) >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        bounds = torch.searchsorted(rows, self.starts).tolist()
        pieces = [
            (p, lo, hi, rows[lo:hi] - self._starts[p])
            for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
            if hi > lo
        ]
        inverse = (
            None if order is None else torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))
        )
        return RowPlan(self._starts, len(rows), pieces, inverse)

    def read(self, plan: RowPlan) -> torch.Tensor:
        """The rows of ``plan``: one ``index_select`` into each part's slice of the output (``index_copy_`` and
        ``out[order] =`` are 6-8x slower for fp16 rows on the CPU)."""
        if plan.starts != self._starts:
            raise ValueError("a row plan is read from SegmentedRows with the part boundaries it was made for")
        out = self.parts[0].new_empty((plan.count, *self.shape[1:]))
        for p, lo, hi, ids in plan.pieces:
            torch.index_select(self.parts[p], 0, ids, out=out[lo:hi])
        return out if plan.inverse is None else out.index_select(0, plan.inverse)

    def _slice(self, start: int, stop: int, step: int) -> torch.Tensor:
        if step != 1:
            return self[torch.arange(start, stop, step)]
        pieces = []
        for p, part in enumerate(self.parts):
            lo, hi = int(self.starts[p]), int(self.starts[p + 1])
            if lo < stop and start < hi:
                pieces.append(part[max(start, lo) - lo : min(stop, hi) - lo])
        if not pieces:
            return self.parts[0][:0]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def float(self) -> torch.Tensor:
        """Every row as float32 (a copy: for small stores and tests)."""
        return self[:].float()


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor | SegmentedRows:
    """One part as itself, several as ``SegmentedRows`` (flattening parts that are ``SegmentedRows``)."""
    flat = [p for part in parts for p in (part.parts if isinstance(part, SegmentedRows) else [part])]
    return flat[0] if len(flat) == 1 else SegmentedRows(flat)


def release_free_heap() -> bool:
    """Return the C heap's free memory to the system (glibc ``malloc_trim``; elsewhere nothing); whether it could.

    A load frees its temporaries (read buffers, checks) after the rows are in place, and glibc keeps freed
    memory below its trim threshold (raised up to 64 MiB by large frees) in the process: measured, 71 MiB
    after reading a 100k-crop store, 17 MiB after mapping it (``benchmarks/bench_serving.py``)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.cache
def _glibc() -> Any:
    """glibc with ``malloc_trim`` (loaded once), or None (another OS, or musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
