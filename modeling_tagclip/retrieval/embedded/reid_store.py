"""Reid (ViSA) embeddings of an embedded gallery index, in the index folder beside TAG-CLIP's.

``reid/manifest.json`` names the ViSA model (path and ``model_fingerprint``), the embedding width and the
committed segments ``reid/seg_<start>.safetensors`` in row order, each with its row count and SHA-256. A
segment holds, for index rows ``start..start + rows``, ``reid`` [rows, d] unit embeddings, ``valid`` (False
for a removed crop or an unreadable image: never returned) and ``key``, the ``path_id`` of the row's path,
checked against the crop database on load (reid rows of another build of the index are refused).

Rows are added shard by shard (``add_reid_embeddings``): the segment file, then the manifest, each replaced
atomically, so a killed run leaves the previous state and a rerun goes on from the last committed shard. The
TAG-CLIP segments are never rewritten and no TAG-CLIP embedding is computed: the crops are read once, for ViSA.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..gallery_types import GalleryIndexError, IndexNotFoundError, model_fingerprint, path_id
from ..reid_encode import check_reid_model, reid_embeddings, reid_width
from .gallery_index import GalleryIndex, chunked_topk, image_file
from .index_store import (
    DATABASE,
    crop_metadata,
    open_db,
    read_header,
    read_manifest,
    read_tensors,
    removed_rows,
    row_paths,
    write_json,
    write_tensors,
)

__all__ = ["REID_DIR", "EmbeddedReid", "add_reid_embeddings", "read_reid_manifest"]

REID_DIR, REID_FORMAT = "reid", "tagclip-reid-embeddings"


def read_reid_manifest(out: str | os.PathLike) -> dict | None:
    """``reid/manifest.json`` of the index at ``out``, or None when it has no reid embeddings."""
    path = Path(out) / REID_DIR / "manifest.json"
    if not path.is_file():
        return None
    import json

    try:
        manifest = json.loads(path.read_text())
        rows = sum(int(s["rows"]) for s in manifest["segments"])
        ok = (
            manifest.get("format") == REID_FORMAT
            and rows == manifest["num_rows"]
            and int(manifest["dim"]) > 0
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise GalleryIndexError(f"corrupt reid manifest {path}: {error}") from error
    if not ok:
        raise GalleryIndexError(f"corrupt reid manifest {path}: not a {REID_FORMAT} manifest")
    return manifest


def _new_manifest(model: Any, model_name: str) -> dict:
    return {
        "format": REID_FORMAT,
        "version": 1,
        "model": model_name,
        "dim": reid_width(model),
        "model_fingerprint": model_fingerprint(model),
        "num_rows": 0,
        "segments": [],
    }


def add_reid_embeddings(
    out: str | os.PathLike,
    model: Any,
    model_name: str,
    shard_size: int = 512,
    batch_size: int = 32,
    image_root: str | os.PathLike | None = None,
    progress: bool = False,
) -> int:
    """Embed with ViSA ``model`` the rows of the index at ``out`` that have no reid embedding yet, committing
    every ``shard_size`` rows; returns the rows embedded (0: nothing to do). Another ViSA model than the one
    that embedded the earlier rows is refused."""
    out = Path(out)
    header, committed = read_header(out), read_manifest(out)
    if committed is None:
        raise IndexNotFoundError(
            f"gallery index {out} has no committed rows yet; finish `tagclip index` first"
        )
    manifest = read_reid_manifest(out) or _new_manifest(model, model_name)
    if manifest["segments"]:
        check_reid_model(manifest, model, f"gallery index {out}")
    root = Path(image_root) if image_root is not None else Path(header["image_root"])
    total, done = committed["num_rows"], manifest["num_rows"]
    (out / REID_DIR).mkdir(exist_ok=True)
    db = open_db(out / DATABASE, read_only=True)
    try:
        for start in range(done, total, shard_size):
            stop = min(start + shard_size, total)
            segment = _embed_rows(db, root, model, range(start, stop), batch_size)
            name = f"{REID_DIR}/seg_{start:09d}.safetensors"
            entry = {"file": name, "start": start, **write_tensors(out / name, segment)}
            manifest = {**manifest, "segments": [*manifest["segments"], entry], "num_rows": stop}
            write_json(out / REID_DIR / "manifest.json", manifest)
            if progress:
                print(f"reid embeddings: {stop} of {total} rows", flush=True)
    finally:
        db.close()
    return total - done


def _embed_rows(db: Any, root: Path, model: Any, rows: range, batch_size: int) -> dict[str, torch.Tensor]:
    """One segment: the reid embeddings, validity and path keys of index ``rows`` (removed crops and unreadable
    images are not embedded: zeros, ``valid`` False)."""
    from ..encode import load_rgb

    ids = list(rows)
    paths, gone, meta = row_paths(db, ids), removed_rows(db, ids), crop_metadata(db, ids)
    images, views, where = [], [], []
    for i, row in enumerate(ids):
        file = None if row in gone else image_file(_under(root, paths.get(row)), root, f"row {row}")
        try:
            image = load_rgb(file) if file is not None else None
        except ValueError:
            image = None
        if image is not None:
            images.append(image)
            views.append((meta.get(row) or {}).get("view"))
            where.append(i)
    found = reid_embeddings(model, images, views, batch_size)
    vectors = torch.zeros(len(ids), int(found.shape[1]) if len(where) else reid_width(model))
    valid = torch.zeros(len(ids), dtype=torch.bool)
    if where:
        vectors[torch.tensor(where)] = found
        valid[torch.tensor(where)] = True
    keys = torch.tensor([path_id(paths[row]) if paths.get(row) else 0 for row in ids], dtype=torch.int64)
    return {"reid": vectors, "valid": valid, "key": keys}


def _under(root: Path, rel: str | None) -> str | None:
    return str(root / rel) if rel else None


class EmbeddedReid:
    """An embedded ``GalleryIndex`` searched by its reid embeddings (cosine), with its filters and hits."""

    def __init__(self, index: GalleryIndex):
        if index.folder is None:
            raise GalleryIndexError("an in-memory gallery has no reid embeddings")
        self.index, self.where, self.root = index, f"gallery index {index.folder}", index.root
        manifest = read_reid_manifest(index.folder)
        if manifest is None:
            raise GalleryIndexError(
                f"{self.where} has no reid embeddings; add them with `tagclip index --add-embeddings reid "
                f"--reid-model VISA --out {index.folder}`"
            )
        if manifest["num_rows"] != len(index):
            raise GalleryIndexError(
                f"the reid embeddings of {self.where} cover {manifest['num_rows']} of its {len(index)} crops; "
                f"embed the rest with `tagclip index --add-embeddings reid --reid-model VISA --out {index.folder}`"
            )
        self.meta = manifest
        parts = [read_tensors(index.folder / s["file"], s["sha256"], s["rows"]) for s in manifest["segments"]]
        self.vectors = torch.cat([p["reid"] for p in parts]) if parts else torch.empty(0, manifest["dim"])
        self.valid = torch.cat([p["valid"] for p in parts]) if parts else torch.empty(0, dtype=torch.bool)
        self._check_keys(torch.cat([p["key"] for p in parts]) if parts else torch.empty(0, dtype=torch.int64))

    def _check_keys(self, keys: torch.Tensor) -> None:
        paths = row_paths(self.index.db, list(range(len(keys))))
        expected = [path_id(paths[row]) if paths.get(row) else 0 for row in range(len(keys))]
        if keys.tolist() != expected:
            raise GalleryIndexError(
                f"the reid embeddings of {self.where} belong to another build of the index; delete "
                f"{self.index.folder / REID_DIR} and run `tagclip index --add-embeddings reid` again"
            )

    def check_model(self, model: Any) -> None:
        """``GalleryIndexError`` unless ``model`` is the ViSA model that made the reid embeddings."""
        check_reid_model(self.meta, model, self.where)

    def search(
        self, query: dict[str, torch.Tensor], top_k: int = 10, filters: Any = None
    ) -> list[list[dict]]:
        """Hits by cosine of unit query embeddings ``global`` [n, d] among the crops ``filters`` allow."""
        vectors = query["global"].float()
        if vectors.shape[1] != self.vectors.shape[1]:
            raise GalleryIndexError(
                f"query embeddings have {vectors.shape[1]} dims, the reid embeddings of {self.where} "
                f"{self.vectors.shape[1]}"
            )
        allowed = self.index.mask(filters)
        allowed = self.valid if allowed is None else allowed & self.valid
        scores, rows = chunked_topk({"global": vectors}, {"global": self.vectors}, top_k, mask=allowed)
        return [self.index.hits(s, r) for s, r in zip(scores, rows, strict=True)]

    def crop_embeddings(self, ids: list[str]) -> dict[str, torch.Tensor]:
        """The reid embeddings of the crops with these hit ids, in that order."""
        return self._rows(self.index.id_rows(ids), ", ".join(ids))

    def track_embeddings(self, camera: str | None, track: str) -> dict[str, torch.Tensor]:
        """The reid embeddings of every crop of a track (those with one), in path order."""
        rows = [row for row in self.index.track_rows(camera, track) if bool(self.valid[row])]
        return self._rows(rows, f"track {camera or ''}:{track}")

    def _rows(self, rows: list[int], what: str) -> dict[str, torch.Tensor]:
        if not rows or not all(bool(self.valid[row]) for row in rows):
            raise GalleryIndexError(
                f"{what} in {self.where} has no reid embedding (its image was unreadable)"
            )
        return {"global": self.vectors[torch.tensor(rows, dtype=torch.long)]}
