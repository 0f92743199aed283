"""Commit encoded rows into a gallery index folder, all or nothing: pending shards in ``build/``, then the new
segment, its ANN file, its crop rows and the manifest (the commit of a build, of ``--add`` and of
``GalleryIndex.add``). Below both ``index_build`` and ``gallery_index``."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..encode import view_prediction
from ..gallery_types import metadata_rows
from ..ingest import unreadable_message
from .ann import ann_segments, remove_unreferenced
from .compaction import compact
from .index_store import (
    CROP_COLUMNS,
    DATABASE,
    HEADER,
    INDEX_FORMAT,
    MANIFEST,
    GalleryIndexError,
    atomic_write,
    check_embeddings,
    insert_crops,
    mark_removed,
    open_db,
    read_header,
    read_manifest,
    read_tensors,
    removed_ids,
    sha256_bytes,
    unsafe_name,
    write_json,
    write_tensors,
)
from .row_store import STORE_DTYPES, embedding_keys, store_rows

BUILD = "build"
ROWS = "rows.json"  # the pending crops' sidecar rows (``metadata_rows``), keyed by path


def shard_name(j: int) -> str:
    return f"shard_{j:07d}"


def read_pending(out: Path) -> dict | None:
    try:
        pending = json.loads((out / BUILD / "pending.json").read_text())
        paths = (out / BUILD / "paths.txt").read_bytes()
    except (OSError, ValueError):
        return None
    if sha256_bytes(paths) != pending.get("paths_sha256"):
        return None
    pending["paths"] = paths.decode().split("\n") if paths else []
    return pending


def start_pending(out: Path, start: int, rels: list[str], rows: dict[str, tuple], shard_size: int) -> None:
    """A pending build of ``rels`` at row ``start`` in ``out/build``, with their validated sidecar ``rows``."""
    shutil.rmtree(out / BUILD, ignore_errors=True)
    (out / BUILD).mkdir(parents=True)
    data = "\n".join(rels).encode()
    atomic_write(out / BUILD / "paths.txt", data)
    write_json(out / BUILD / ROWS, {r: rows[r] for r in rels if r in rows})
    pending = {
        "start": start,
        "count": len(rels),
        "shard_size": shard_size,
        "paths_sha256": sha256_bytes(data),
    }
    write_json(out / BUILD / "pending.json", pending)


def commit(out: Path, header: dict, pending: dict, warn: Callable[[str], None]) -> None:
    """Merge the pending shards into a new segment, (re)build ANN segments, insert crops, swap the manifest."""
    build, count, shard_size = out / BUILD, pending["count"], pending["shard_size"]
    n_shards = -(-count // shard_size)
    rows, unreadable = {}, {}
    for j in range(n_shards):  # copied into one preallocated tensor per key: memory = the segment + one shard
        size = min(shard_size, count - j * shard_size)
        try:  # read_tensors verifies the checksum and the row count while it reads (one pass over the file)
            record = json.loads((build / f"{shard_name(j)}.json").read_text())
            shard = read_tensors(build / f"{shard_name(j)}.safetensors", record["sha256"], size)
        except (OSError, ValueError, KeyError, TypeError, GalleryIndexError) as error:
            raise GalleryIndexError(
                f"shard {j} of the pending build in {build} is missing or corrupt; run again"
            ) from error
        for key, value in shard.items():
            target = rows.setdefault(key, value.new_empty((count, *value.shape[1:])))
            target[j * shard_size : j * shard_size + size] = value
        unreadable.update({int(i): reason for i, reason in record.get("unreadable", {}).items()})
    manifest = read_manifest(out) or {"format": INDEX_FORMAT, "num_rows": 0, "segments": []}
    start = pending["start"]
    (out / "segments").mkdir(exist_ok=True)
    file = f"segments/seg_{start:010d}.safetensors"
    segment = {"file": file, "start": start, **write_tensors(out / file, rows), "ann_file": None}
    segments = compact(out, [*manifest["segments"], segment], _removed(out))  # merged: new files, old kept
    manifest = {**manifest, "num_rows": start + count, "segments": segments}
    header = ann_segments(out, header, manifest, warn)
    crops = _crop_rows(pending["paths"], json.loads((build / ROWS).read_text()), rows.get("view_probs"))
    db = open_db(out / DATABASE)
    try:
        insert_crops(db, start, crops)
        mark_removed(db, ids=[start + i for i in unreadable])
    finally:
        db.close()
    if unreadable:
        warn(unreadable_message(pending["paths"], unreadable))
    header["embed_dims"] = {
        key: int(rows[key].shape[1]) for key in [*embedding_keys(rows), "view_probs"] if key in rows
    }
    write_json(out / HEADER, header)
    write_json(out / MANIFEST, manifest)  # the commit point: readers see the new rows from here on
    shutil.rmtree(build, ignore_errors=True)
    remove_unreferenced(out, header, manifest)


def _crop_rows(paths: Sequence[str], stored: dict[str, list], probs: torch.Tensor | None) -> list[tuple]:
    """Each crop's ``CROP_COLUMNS``: its stored sidecar row, with the predicted view where the row has none."""
    blank = [None] * len(CROP_COLUMNS)
    crops = []
    for i, rel in enumerate(paths):
        _, view, *rest = stored.get(rel) or blank
        crops.append((rel, view or view_prediction(probs, i)[0], *rest))
    return crops


def _removed(out: Path) -> torch.Tensor:
    """The ids removed so far (what a merge purges); none before the crop database exists."""
    if not (out / DATABASE).is_file():
        return torch.empty(0, dtype=torch.long)
    db = open_db(out / DATABASE, read_only=True)
    try:
        return removed_ids(db)
    finally:
        db.close()


def warner(rank: int) -> Callable[[str], None]:
    def warn(message: str) -> None:
        if rank == 0:  # the CLI shows it as one "tagclip index: warning: ..." line
            warnings.warn(message, stacklevel=3)

    return warn


def append_embeddings(
    out: Path, embeds: dict[str, torch.Tensor], rels: list[str], metadata: dict[str, dict] | None = None
) -> None:
    """Commit encoded rows as one more segment of the index at ``out`` (the commit path of an add: the new
    segment, its ANN file, its crop rows, then the manifest), all or nothing."""
    header = read_header(out)
    if read_manifest(out) is None:
        raise GalleryIndexError(f"gallery index {out} is incomplete: finish its first build before adding")
    check_storable(embeds, rels)
    commit_embeddings(out, header, embeds, rels, metadata)


def check_storable(embeds: dict[str, torch.Tensor], rels: Sequence[str]) -> None:
    """``check_embeddings``, and every path a name the index can store."""
    check_embeddings(embeds, rels)
    for rel in rels:
        reason = unsafe_name(rel) or ("a newline" if "\n" in rel else None)
        if reason:
            raise GalleryIndexError(f"image path {rel!r} cannot be stored in the index: {reason}")
    if len(set(rels)) != len(rels):
        raise GalleryIndexError("image paths must be unique")


def commit_embeddings(
    out: Path, header: dict, embeds: dict[str, torch.Tensor], rels: list[str], metadata: dict | None
) -> None:
    """One pending shard of ``embeds`` in ``out/build``, committed as a new segment."""
    manifest = read_manifest(out)
    start = manifest["num_rows"] if manifest else 0
    try:
        records = metadata or {}
        rows = metadata_rows({rel: records[rel] for rel in rels if rel in records})
        start_pending(out, start, rels, rows, max(1, len(rels)))
        shard = store_rows(embeds, STORE_DTYPES[header["store_dtype"]])
        write_json(
            out / BUILD / f"{shard_name(0)}.json",
            write_tensors(out / BUILD / f"{shard_name(0)}.safetensors", shard),
        )
        commit(out, header, read_pending(out), warner(0))
    finally:  # nothing to resume: the rows are not re-encoded from images
        shutil.rmtree(out / BUILD, ignore_errors=True)
