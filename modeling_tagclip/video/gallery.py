"""Ingested crops into a gallery: the one place ``tagclip ingest`` calls the index-building entry points.

The crops folder is the gallery's image root. Every call indexes the crops under it that the gallery does not
hold yet (an embedded index at ``out`` through ``build_index``, or a Milvus collection through
``index_into_milvus``), so a re-run after a kill adds exactly what is missing and nothing twice, each crop with
its manifest row: camera, view, time and the footage fields (track, source, frame, box, t_start, t_end).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modeling_tagclip.retrieval.gallery_types import CROP_COLUMNS

from .manifest import read_manifest
from .state import checkpoint

__all__ = ["GalleryTarget", "add_to_gallery"]


@dataclass(frozen=True)
class GalleryTarget:
    """Where the crops go: an embedded index folder ``out``, or ``milvus_uri`` + ``collection``."""

    out: Path | None = None
    milvus_uri: str | None = None
    collection: str | None = None
    batch_size: int = 32
    device: str = "cpu"
    model_name: str = ""


def _sidecar(rows: Sequence[dict[str, str]]) -> dict[str, dict]:
    return {row["path"]: {key: row[key] for key in CROP_COLUMNS if key in row} for row in rows}


def _indexed(out: Path, paths: Sequence[str]) -> set[str]:
    """Which of ``paths`` the embedded index at ``out`` holds (committed rows)."""
    from modeling_tagclip.retrieval.embedded.index_store import DATABASE
    from modeling_tagclip.retrieval.embedded.index_store import read_manifest as read_index_manifest

    manifest = read_index_manifest(out) if (out / DATABASE).exists() else None
    if manifest is None:
        return set()
    db = sqlite3.connect(f"file:{out / DATABASE}?mode=ro", uri=True)
    try:
        known: set[str] = set()
        for start in range(0, len(paths), 512):
            batch = list(paths[start : start + 512])
            sql = f"SELECT path FROM crops WHERE id < ? AND path IN ({', '.join('?' * len(batch))})"
            known.update(path for (path,) in db.execute(sql, (manifest["num_rows"], *batch)))
    finally:
        db.close()
    return known


def _into_index(model: Any, processor: Any, crops: Path, rows: list[dict], target: GalleryTarget) -> None:
    from modeling_tagclip.retrieval.embedded.index_build import build_index
    from modeling_tagclip.retrieval.embedded.index_commit import read_pending
    from modeling_tagclip.retrieval.embedded.index_store import HEADER

    out = Path(target.out)
    for _ in range(2):  # a build a kill interrupted is finished first, then the crops it did not include
        interrupted = read_pending(out) is not None if (out / HEADER).exists() else False
        indexed = _indexed(out, [row["path"] for row in rows])
        build_index(
            model,
            processor,
            crops,
            out,
            batch_size=target.batch_size,
            progress=True,
            model_name=target.model_name,
            add=(out / HEADER).exists(),
            device=target.device,
            on_shard=lambda *_: checkpoint("index"),
            metadata=_sidecar([row for row in rows if row["path"] not in indexed]),
        )
        if not interrupted:
            return


def add_to_gallery(model: Any, processor: Any, crops: Path, target: GalleryTarget) -> None:
    """Index every crop under ``crops`` not yet in the gallery, with its manifest row's metadata."""
    rows = read_manifest(crops)
    if not rows:
        return
    if target.milvus_uri:
        from modeling_tagclip.retrieval.milvus import index_into_milvus

        index_into_milvus(
            model,
            processor,
            crops,
            target.milvus_uri,
            target.collection,
            batch_size=target.batch_size,
            model_name=target.model_name,
            metadata=_sidecar(rows),
            device=target.device,
            progress=True,
        )
    else:
        _into_index(model, processor, crops, rows, target)
