"""Camera and capture-time metadata of the synthetic set's crops: the sidecar files ``tagclip index --metadata``
reads, so that filtered search (``--view``, ``--camera``, ``--after``/``--before``) has something to filter.

The scene is one site watched for a day (2026-01-01, 08:00-17:00 UTC) by six street cameras (``1``-``6``,
ground view) and three drones (``7``-``9``, aerial view). Each identity passes once: it arrives at a random time
and each of its crops is taken within ``VISIT_S`` seconds of that, by a camera of the crop's view. Every draw
comes from its own random stream, so pixels and captions are the same with or without metadata.

``metadata/<split>.csv`` has one row per crop of ``images/<split>``: ``path`` (relative to that folder),
``view``, ``camera`` and ``timestamp`` (ISO 8601, UTC)::

    tagclip index --model M --images data/synthetic/images/test --metadata data/synthetic/metadata/test.csv \\
        --output gallery.idx
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from modeling_tagclip.atomic_io import atomic_write
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND, VIEW_NAMES

CAMERAS = {GROUND: ("1", "2", "3", "4", "5", "6"), AERIAL: ("7", "8", "9")}
DAY_START = datetime(2026, 1, 1, 8, 0, tzinfo=timezone.utc)
DAY_S = 9 * 3600  # arrivals between 08:00 and 17:00
VISIT_S = 20 * 60  # an identity's crops are taken within 20 minutes of its arrival
COLUMNS = ("path", "view", "camera", "timestamp")


def crop_metadata(seed: int, identity: int, view: int, index: int) -> dict[str, str]:
    """``view``, ``camera`` and ``timestamp`` of crop ``index`` of ``identity`` seen from ``view``."""
    arrival = np.random.default_rng([seed, 3, identity]).uniform(0, DAY_S)
    rng = np.random.default_rng([seed, 4, identity, view, index])
    camera = CAMERAS[view][int(rng.integers(len(CAMERAS[view])))]
    moment = DAY_START + timedelta(seconds=int(arrival + rng.uniform(0, VISIT_S)))
    return {"view": VIEW_NAMES[view], "camera": camera, "timestamp": moment.strftime("%Y-%m-%dT%H:%M:%SZ")}


def write_sidecars(
    root: str | Path, crops: Iterable[tuple[str, str, int, int, int]], seed: int
) -> list[Path]:
    """``root/metadata/<split>.csv`` from ``(split, path under images/<split>, identity, view, index)`` rows."""
    rows: dict[str, list[dict[str, str]]] = {}
    for split, path, identity, view, index in crops:
        rows.setdefault(split, []).append({"path": path, **crop_metadata(seed, identity, view, index)})
    written = []
    for split, records in sorted(rows.items()):
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        target = Path(root) / "metadata" / f"{split}.csv"
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, text.getvalue().encode())
        written.append(target)
    return written
