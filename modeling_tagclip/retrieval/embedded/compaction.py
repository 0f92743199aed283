"""Segment merging of the embedded gallery index: size tiers keep the number of searched segments bounded.

Every commit (a build, an ``--add``, ``GalleryIndex.add``) appends one segment. A segment's tier is
``floor(log_F(rows))`` (F = ``MERGE_FANOUT``); when the newest ``F`` segments share a tier, they are merged
into one segment of the next tier (its rows concatenated, ids unchanged, its ANN index encoded again by the
shared quantizer), and so on up. A gallery of N rows therefore keeps at most about (F - 1) log_F(N)
segments, each row is rewritten O(log N) times over the gallery's life, and a merge reads at most
``MERGE_MAX_ROWS`` rows. Merging happens inside the commit, before the manifest is swapped: a kill during a
merge leaves the previous manifest and its files, and the next commit merges again. A merge purges the rows
removed (``tagclip remove``, unreadable images) from the file it writes and from its ANN index: the segment
keeps its id span, lists the purged ids (``purged`` ranges) and stores only the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from .index_store import id_ranges, read_segment, write_tensors

__all__ = ["MERGE_FANOUT", "MERGE_MAX_ROWS", "compact", "merge_run", "tier"]

MERGE_FANOUT = 4
MERGE_MAX_ROWS = 1 << 20  # rows a merge may read into memory (the segments it writes are no larger)


def tier(rows: int, fanout: int = MERGE_FANOUT) -> int:
    """The size tier of a segment of ``rows`` rows: floor(log_fanout(rows)) (0 for an empty one)."""
    return int(math.log(rows, fanout) + 1e-9) if rows > 0 else 0


def merge_run(sizes: Sequence[int], fanout: int = MERGE_FANOUT, max_rows: int = MERGE_MAX_ROWS) -> int:
    """How many of the newest segments to merge now (0: none): the newest ``fanout`` when they share a tier
    and together hold at most ``max_rows`` rows."""
    if len(sizes) < fanout:
        return 0
    newest = sizes[-fanout:]
    if len({tier(size, fanout) for size in newest}) != 1 or sum(newest) > max_rows:
        return 0
    return fanout


def merged_name(first: dict, last: dict) -> str:
    """The file of a merged segment: named by the rows it covers, never the name of a segment it replaces."""
    end = last["start"] + last["rows"]
    return f"segments/seg_{first['start']:010d}-{end:010d}.safetensors"


def compact(out: Path, segments: list[dict], removed: torch.Tensor | None = None) -> list[dict]:
    """``segments`` with their newest runs merged while ``merge_run`` asks (new files written; the old ones
    stay until the manifest that no longer names them is committed), the ``removed`` ids (ascending) purged
    from what a merge writes. A merged segment has no ANN file yet (``ann.ann_segments`` encodes it) and lists
    the checksums of the segments it holds, in order (``merged_from``), so a loaded index knows it holds rows
    it has read already."""
    segments = list(segments)
    removed = torch.empty(0, dtype=torch.long) if removed is None else removed
    while count := merge_run([s["rows"] for s in segments]):
        run = segments[-count:]
        parts = [read_segment(out, s) for s in run]
        rows = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        del parts
        start, stop = run[0]["start"], run[-1]["start"] + run[-1]["rows"]
        purged = removed[(removed >= start) & (removed < stop)]
        if len(purged):
            kept = torch.ones(stop - start, dtype=torch.bool)
            kept[purged - start] = False
            rows = {key: value[kept] for key, value in rows.items()}
        file = merged_name(run[0], run[-1])
        stored = write_tensors(out / file, rows)
        merged = {
            "file": file,
            "start": start,
            "sha256": stored["sha256"],
            "rows": stop - start,
            "ann_file": None,
            **({"purged": id_ranges(purged)} if len(purged) else {}),
            "merged_from": [sha for s in run for sha in s.get("merged_from", [s["sha256"]])],
        }
        segments[-count:] = [merged]
    return segments
