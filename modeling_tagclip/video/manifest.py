"""``manifest.csv`` of an ingest crops folder: the gallery's metadata sidecar (path, view, camera, timestamp,
tags) plus the ingest fields track, source, frame, box ("x1 y1 x2 y2"), t_start and t_end; rewritten atomically,
one row per crop, sorted by path."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from pathlib import Path

from modeling_tagclip.atomic_io import atomic_write

__all__ = ["COLUMNS", "MANIFEST", "read_manifest", "replace_rows"]

MANIFEST = "manifest.csv"
COLUMNS = (
    "path",
    "view",
    "camera",
    "timestamp",
    "tags",
    "track",
    "source",
    "frame",
    "box",
    "t_start",
    "t_end",
)


def read_manifest(crops: Path) -> list[dict[str, str]]:
    """The rows of ``crops/manifest.csv`` ([] when there is none yet)."""
    path = Path(crops) / MANIFEST
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(
                f"{path}: not an ingest manifest (columns {reader.fieldnames}, expected {list(COLUMNS)})"
            )
        return list(reader)


def replace_rows(crops: Path, folder: str, rows: Iterable[dict[str, str]], keep: bool = False) -> None:
    """Rewrite the manifest with ``rows`` in place of the rows under ``folder`` (``keep``: add to them)."""
    new = list(rows)
    paths = {row["path"] for row in new}
    prefix = folder.rstrip("/") + "/"
    old = [
        r
        for r in read_manifest(crops)
        if r["path"] not in paths and (keep or not r["path"].startswith(prefix))
    ]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(sorted(old + new, key=lambda row: row["path"]))
    atomic_write(Path(crops) / MANIFEST, buffer.getvalue().encode("utf-8"))
