"""Build, resume and grow a gallery index (layout: ``index_store``): a DataLoader keeps the model busy, every
shard is checksummed, nothing is written per shard that grows with the gallery, N processes share the work.

- **Pipeline.** Decoding and the processor's resize/normalise run in ``num_workers`` DataLoader workers,
  batches are pinned on CUDA and copied with ``non_blocking``; the model runs under ``autocast(dtype)``.
- **O(N) metadata.** The pending path list is written once (``build/paths.txt``); each shard adds one small
  ``shard_<j>.json`` (rows, SHA-256); the crop database and the manifest are written once at the end.
- **Resume and integrity.** A shard counts as done only if its JSON record, row count and checksum agree;
  anything else (missing middle shard, truncated file, a crash mid-write) is re-encoded. Batches are aligned
  to shard starts, so a resumed build is byte-identical to an uninterrupted one.
- **Scale-out.** Under ``torchrun``/``accelerate launch`` (``WORLD_SIZE`` > 1), rank r encodes shards j with
  j mod world == r into the same ``build/``; rank 0 merges them into one segment: the same index as one process.
- **Growing.** ``add=True`` encodes only images not yet in the index into a new segment (+ its own ANN index
  from the trained quantizer): O(new crops), no rebuild. A preset's quantizer is retrained once the gallery
  calls for ``RETRAIN_GROWTH`` x its IVF lists, every segment's ANN file re-encoded from the stored rows under
  a new name (the committed files stay valid until the manifest swap). Crop metadata (view, camera,
  timestamp, tags) comes from a CSV/JSON sidecar.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from .encode import DTYPES, autocast, encode_texts, load_rgb, view_prediction, view_probabilities
from .gallery_index import (
    ANN_MIN_SIZE,
    ANN_ON,
    ANN_PRESETS,
    GalleryIndex,
    _set_search_params,
    ann_spec,
    ann_vectors,
    check_finite,
    faiss,
    ivf_lists,
    list_images,
    model_fingerprint,
)
from .index_store import (
    DATABASE,
    HEADER,
    INDEX_FORMAT,
    INDEX_VERSION,
    MANIFEST,
    GalleryIndexError,
    atomic_write,
    insert_crops,
    mark_removed,
    metadata_row,
    open_db,
    read_header,
    read_manifest,
    read_tensors,
    sha256_bytes,
    sha256_file,
    write_json,
    write_tensors,
)

__all__ = ["STORE_DTYPES", "build_index", "default_batch_size", "index_embeddings", "read_sidecar"]

STORE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
BUILD = "build"
ANN_ADD_CHUNK = 65536  # rows converted to float32 ANN vectors at once when adding to a faiss index
TRAIN_MAX = 131072  # training sample of a non-IVF ANN (e.g. the PCA of PCA..,HNSW..)
RETRAIN_GROWTH = 4  # a preset's quantizer is retrained when the gallery calls for this many times its lists


def default_batch_size(device: torch.device) -> int:
    """Images per forward: 256 on a GPU (bf16 ViT-B/16 fits easily), 32 on CPU."""
    return 256 if device.type == "cuda" else 32


# ---------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------


class _Ranks:
    """Rank and world size from ``torchrun`` / ``accelerate launch`` (gloo process group for barriers)."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------------------
# Encoding shards
# ---------------------------------------------------------------------------------------------------------


class _Batches(torch.utils.data.Dataset):
    """Item = one batch (rows of ``files``) decoded and preprocessed, in the DataLoader's workers, and the rows
    whose file could not be decoded ({row: reason}; encoded as a black image, flagged removed at commit)."""

    def __init__(self, processor, files: Sequence[Path], batches: Sequence[range]):
        self.processor, self.files, self.batches = processor, files, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, b: int) -> tuple[torch.Tensor, dict[int, str]]:
        images, unreadable = [], {}
        for i in self.batches[b]:
            try:
                images.append(load_rgb(self.files[i]))
            except ValueError as error:  # load_rgb's error for undecodable, truncated or too large files
                images.append(Image.new("RGB", (1, 1)))
                unreadable[i] = str(error)
        return self.processor(images=images)["pixel_values"], unreadable


@torch.inference_mode()
def _encode(model, pixels: torch.Tensor, device: torch.device, dtype: str | None) -> dict[str, torch.Tensor]:
    with autocast(device, dtype):
        out = model.get_image_features(pixel_values=pixels.to(device, non_blocking=True))
    rows = {"global": torch.nn.functional.normalize(out.pooler_output.float(), dim=-1).cpu()}
    if out.local_embeds is not None:
        rows["local"] = torch.nn.functional.normalize(out.local_embeds.float(), dim=-1).cpu()
    probs = view_probabilities(out.view_logits)
    if probs is not None:
        rows["view_probs"] = probs.cpu()
    return rows


def _shard_name(j: int) -> str:
    return f"shard_{j:07d}"


def _shard_ok(build: Path, j: int, rows: int) -> dict | None:
    """The shard's record if it is complete and its checksum verifies, else None."""
    try:
        record = json.loads((build / f"{_shard_name(j)}.json").read_text())
        ok = (
            record["rows"] == rows
            and sha256_file(build / f"{_shard_name(j)}.safetensors") == record["sha256"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if ok else None


def _encode_shards(model, processor, files, todo, shard_size, batch_size, opts, build, on_shard) -> None:
    """Encode shards ``todo`` (indices into ``files``) with one DataLoader, one checksummed file each."""
    batches, owner = [], []
    for j in todo:
        stop = min((j + 1) * shard_size, len(files))
        for start in range(j * shard_size, stop, batch_size):
            batches.append(range(start, min(start + batch_size, stop)))
            owner.append(j)
    device = opts["device"]
    loader = torch.utils.data.DataLoader(
        _Batches(processor, files, batches), batch_size=None, num_workers=opts["num_workers"],
        pin_memory=device.type == "cuda",
    )  # fmt: skip
    bar = _bar(sum(len(b) for b in batches), opts["progress"])
    parts: list[dict] = []
    unreadable: dict[int, str] = {}
    for b, (pixels, bad) in enumerate(loader):
        unreadable.update(bad)
        rows = _encode(model, pixels, device, opts["dtype"])
        check_finite(rows, [files[i] for i in batches[b]], first=batches[b].start)
        parts.append(rows)
        bar.update(len(batches[b]))
        if b + 1 == len(batches) or owner[b + 1] != owner[b]:
            j = owner[b]
            shard = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
            shard = {key: v.to(opts["store_dtype"]) if key != "view_probs" else v for key, v in shard.items()}
            record = write_tensors(build / f"{_shard_name(j)}.safetensors", shard)
            write_json(build / f"{_shard_name(j)}.json", {**record, "unreadable": unreadable})
            parts, unreadable = [], {}
            if on_shard is not None:
                on_shard(min((j + 1) * shard_size, len(files)), len(files))
    bar.close()


def _bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="indexing", unit="img", disable=not enabled)


# ---------------------------------------------------------------------------------------------------------
# Sidecar metadata
# ---------------------------------------------------------------------------------------------------------


def read_sidecar(path: str | os.PathLike) -> dict[str, dict]:
    """Per-image metadata from a CSV (header with ``path`` and any of view, camera, timestamp, tags 'a;b')
    or JSON file (a list of objects with ``path``, or ``{path: {...}}``), keyed by path."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".csv":
            with open(path, newline="") as handle:
                records = list(csv.DictReader(handle))
        else:
            records = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as error:
        raise GalleryIndexError(f"cannot read metadata file {path}: {error}") from error
    if isinstance(records, dict):
        records = [
            {**(value if isinstance(value, dict) else {}), "path": key} for key, value in records.items()
        ]
    if not isinstance(records, list) or not all(isinstance(r, dict) and r.get("path") for r in records):
        raise GalleryIndexError(f"metadata file {path}: every record needs a 'path'")
    unknown = {key for r in records for key in r} - {"path", "view", "camera", "timestamp", "tags"}
    if unknown:
        raise GalleryIndexError(f"metadata file {path}: unknown columns {sorted(unknown)}")
    return {Path(str(r["path"])).as_posix(): r for r in records}


def _sidecar_for(sidecar: dict[str, dict], folder: Path, root: Path, rels: Sequence[str]) -> dict[str, dict]:
    """Sidecar records re-keyed relative to the index root; entries matching no pending image are errors."""
    prefix = folder.relative_to(root).as_posix()
    keyed = {(r if prefix == "." else f"{prefix}/{r}"): record for r, record in sidecar.items()}
    unknown = sorted(set(keyed) - set(rels))
    if unknown:
        raise GalleryIndexError(f"metadata for images that are not being indexed: {unknown[:5]}")
    return keyed


# ---------------------------------------------------------------------------------------------------------
# Pending builds
# ---------------------------------------------------------------------------------------------------------


def _pending(out: Path) -> dict | None:
    try:
        pending = json.loads((out / BUILD / "pending.json").read_text())
        paths = (out / BUILD / "paths.txt").read_bytes()
    except (OSError, ValueError):
        return None
    if sha256_bytes(paths) != pending.get("paths_sha256"):
        return None
    pending["paths"] = paths.decode().split("\n") if paths else []
    return pending


def _start_pending(out: Path, start: int, rels: list[str], records: dict[str, dict], shard_size: int) -> None:
    shutil.rmtree(out / BUILD, ignore_errors=True)
    (out / BUILD).mkdir(parents=True)
    data = "\n".join(rels).encode()
    atomic_write(out / BUILD / "paths.txt", data)
    write_json(out / BUILD / "metadata.json", {r: records[r] for r in rels if r in records})
    pending = {
        "start": start,
        "count": len(rels),
        "shard_size": shard_size,
        "paths_sha256": sha256_bytes(data),
    }
    write_json(out / BUILD / "pending.json", pending)


def _commit(out: Path, header: dict, pending: dict, warn: Callable[[str], None]) -> None:
    """Merge the pending shards into a new segment, (re)build ANN segments, insert crops, swap the manifest."""
    build, count, shard_size = out / BUILD, pending["count"], pending["shard_size"]
    n_shards = -(-count // shard_size)
    rows, unreadable = {}, {}
    for j in range(n_shards):  # copied into one preallocated tensor per key: memory = the segment + one shard
        size = min(shard_size, count - j * shard_size)
        try:  # read_tensors verifies the checksum and the row count while it reads (one pass over the file)
            record = json.loads((build / f"{_shard_name(j)}.json").read_text())
            shard = read_tensors(build / f"{_shard_name(j)}.safetensors", record["sha256"], size)
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
    manifest = {**manifest, "num_rows": start + count, "segments": [*manifest["segments"], segment]}
    header = _ann_segments(out, header, manifest, warn)
    records = json.loads((build / "metadata.json").read_text())
    probs = rows.get("view_probs")
    crops = [metadata_row(rel, records.get(rel), view_prediction(probs, i)[0])
             for i, rel in enumerate(pending["paths"])]  # fmt: skip
    db = open_db(out / DATABASE)
    try:
        insert_crops(db, start, crops)
        mark_removed(db, ids=[start + i for i in unreadable])
    finally:
        db.close()
    if unreadable:
        listed = "; ".join(f"{pending['paths'][i]}: {reason}" for i, reason in sorted(unreadable.items())[:5])
        warn(
            f"{len(unreadable)} unreadable image(s) skipped (kept as removed rows, never returned): {listed}"
        )
    header["embed_dims"] = {key: int(value.shape[1]) for key, value in rows.items()}
    write_json(out / HEADER, header)
    write_json(out / MANIFEST, manifest)  # the commit point: readers see the new rows from here on
    shutil.rmtree(build, ignore_errors=True)
    _remove_unreferenced(out, header, manifest)


def _ann_segments(out: Path, header: dict, manifest: dict, warn: Callable[[str], None]) -> dict:
    """Give every segment its approximate index, training the quantizer once the gallery is large enough and
    again (all segments re-encoded from their stored rows) when a preset's quantizer is outgrown."""
    if not header.get("ann_request"):
        return header
    total = manifest["num_rows"]
    if total < ANN_MIN_SIZE:
        warn(f"--ann {header['ann_request']['ann']} not built yet: {total} images < {ANN_MIN_SIZE}, search is "
             "exact; it is built when --add grows the gallery past that size")  # fmt: skip
        return header
    request = header["ann_request"]
    on = request["on"]
    if header.get("ann") is None or _outgrown(header["ann"], request, total):
        header["ann"] = _train_ann(out, manifest, request, on, retrain=header.get("ann") is not None)
    tag = header["ann"].get("tag", "")
    trained = out / f"ann_trained{tag}.faiss"
    template = faiss.read_index(str(trained))
    if sha256_file(trained) != header["ann"]["trained_sha256"]:
        raise GalleryIndexError(f"{trained} is corrupt (checksum mismatch)")
    for segment in manifest["segments"]:
        ann_file = segment["file"].replace(".safetensors", f"{tag}.faiss")
        if segment.get("ann_file") == ann_file:  # else new, or encoded by an outgrown quantizer
            continue
        index = faiss.clone_index(template)
        if faiss.try_extract_index_ivf(index) is None:
            index = faiss.IndexIDMap2(index)
        _set_search_params(index, header["ann"]["params"])
        stored = _read_segment(out, segment)
        for start in range(0, segment["rows"], ANN_ADD_CHUNK):  # fp32 vectors of one chunk at a time
            rows = slice(start, min(start + ANN_ADD_CHUNK, segment["rows"]))
            ids = torch.arange(segment["start"] + rows.start, segment["start"] + rows.stop)
            index.add_with_ids(ann_vectors({k: v[rows] for k, v in stored.items()}, on).numpy(), ids.numpy())
        del stored
        data = faiss.serialize_index(index).tobytes()
        atomic_write(out / ann_file, data)  # a new name: the committed manifest's files stay valid
        segment["ann_file"], segment["ann_sha256"] = ann_file, sha256_bytes(data)
    return header


def _outgrown(ann: dict, request: dict, total: int) -> bool:
    """Whether a preset's IVF quantizer has ``RETRAIN_GROWTH`` x fewer lists than ``total`` rows call for
    (``ivf_lists``); a factory string the user gave is never retrained."""
    trained = re.search(r"IVF(\d+)", ann["factory"])
    if request["ann"] not in ANN_PRESETS or trained is None:
        return False
    return ivf_lists(total) >= RETRAIN_GROWTH * int(trained.group(1))


def _remove_unreferenced(out: Path, header: dict, manifest: dict) -> None:
    """After a commit: delete ANN files of an outgrown quantizer that neither header nor manifest names."""
    keep = {out / s["ann_file"] for s in manifest["segments"] if s.get("ann_file")}
    if header.get("ann"):
        keep.add(out / f"ann_trained{header['ann'].get('tag', '')}.faiss")
    for path in [*out.glob("ann_trained*.faiss"), *(out / "segments").glob("*.faiss")]:
        if path not in keep:
            path.unlink(missing_ok=True)


def _read_segment(out: Path, segment: dict) -> dict[str, torch.Tensor]:
    return read_tensors(out / segment["file"], segment["sha256"], segment["rows"])


def _train_ann(out: Path, manifest: dict, request: dict, on: str, retrain: bool = False) -> dict:
    """Resolve the requested ANN (preset or factory) for the gallery, train it on a fixed sample of rows
    (read segment by segment: memory bounded by the sample) and save it as ``ann_trained.faiss`` (when
    retrained: ``ann_trained.ivf<lists>.faiss``, its ``tag`` also naming the segments' files)."""
    total, segments = manifest["num_rows"], manifest["segments"]
    first = _read_segment(out, segments[0])
    dim = ann_vectors({k: v[:1] for k, v in first.items()}, on).shape[1]
    del first
    spec = ann_spec(request["ann"], total, dim, request.get("params"), on)
    template = faiss.index_factory(dim, spec["factory"], faiss.METRIC_INNER_PRODUCT)
    if not template.is_trained:
        picked, parts = _training_rows(total, template), []
        for segment in segments:
            stop = segment["start"] + segment["rows"]
            local = picked[(picked >= segment["start"]) & (picked < stop)] - segment["start"]
            if len(local):
                stored = _read_segment(out, segment)
                parts.append(ann_vectors({k: v[local] for k, v in stored.items()}, on))
                del stored
        template.train(torch.cat(parts).numpy())
    ivf = faiss.try_extract_index_ivf(template)
    tag = f".ivf{ivf.nlist}" if retrain and ivf is not None else ""
    data = faiss.serialize_index(template).tobytes()
    atomic_write(out / f"ann_trained{tag}.faiss", data)
    return {**spec, "trained_sha256": sha256_bytes(data), "tag": tag}


def _training_rows(size: int, index: Any) -> torch.Tensor:
    """A fixed random subset of rows for training: 40 per IVF list, else ``TRAIN_MAX`` (all rows when fewer)."""
    ivf = faiss.try_extract_index_ivf(index)
    count = min(size, 40 * ivf.nlist if ivf is not None else TRAIN_MAX)
    return torch.randperm(size, generator=torch.Generator().manual_seed(0))[:count].sort().values


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


def _check_options(batch_size, shard_size, dtype, store_dtype, num_workers) -> None:
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES and dtype is not None:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store_dtype must be one of {sorted(STORE_DTYPES)}, got {store_dtype!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")


def _new_header(model, model_name, root, shard_size, store_dtype, ann, ann_params, ann_on=ANN_ON) -> dict:
    request = {"ann": ann, "params": ann_params or {}, "on": ann_on} if ann is not None else None
    config = getattr(model, "config", None)
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "model": model_name or str(getattr(config, "_name_or_path", "") or ""),
        "model_fingerprint": model_fingerprint(model) if model is not None else None,
        "image_root": str(root),
        "shard_size": shard_size,
        "store_dtype": store_dtype,
        "ann_request": request,
        "ann": None,
    }


def _check_same(header: dict, new: dict, out: Path) -> None:
    for key, what in (("model_fingerprint", "model"), ("image_root", "image folder"),
                      ("store_dtype", "storage dtype")):  # fmt: skip
        if header.get(key) != new.get(key):
            raise GalleryIndexError(
                f"gallery index {out} was built with a different {what}; pass --overwrite to rebuild it"
            )


def _check_fixed(header: dict, out: Path, ann: str | None, ann_params: dict | None, store_dtype: str | None):
    """Refuse settings that differ from those ``out`` was built with (None: keep the index's)."""
    request = header.get("ann_request") or {}
    if ann is not None and (ann, ann_params or {}) != (request.get("ann"), request.get("params", {})):
        raise GalleryIndexError(
            f"the ANN settings of {out} are fixed when it is built ({request or 'exact'}); "
            "run --add without --ann/--ann-param, or rebuild with --overwrite"
        )
    if store_dtype is not None and store_dtype != header.get("store_dtype"):
        raise GalleryIndexError(
            f"the storage dtype of {out} is fixed when it is built ({header.get('store_dtype')}); "
            "run --add without --store-dtype, or rebuild with --overwrite"
        )


def build_index(
    model,
    processor,
    images: str | os.PathLike,
    out: str | os.PathLike,
    batch_size: int | None = None,
    shard_size: int = 512,
    overwrite: bool = False,
    use_faiss: bool | None = None,
    progress: bool = True,
    model_name: str | None = None,
    on_shard: Callable[[int, int], None] | None = None,
    ann: str | None = None,
    ann_params: dict[str, float] | None = None,
    *,
    ann_on: str = ANN_ON,
    add: bool = False,
    metadata: str | os.PathLike | dict | None = None,
    dtype: str | None = None,
    store_dtype: str | None = None,
    num_workers: int = 0,
    device: str | torch.device | None = None,
) -> GalleryIndex:
    """Encode every image under ``images`` into the index directory ``out`` (resuming an interrupted build),
    or with ``add=True`` the images not yet in it (``images`` = the index's image root or a folder inside).

    ``ann``: "ivf" (``ANN_PRESETS``) or a faiss index_factory string over ``ann_vectors(.., ann_on)``, with
    ``ann_params`` (``nprobe``, ``k_factor``, ...) kept in ``index.json``; built once the gallery has
    ``ANN_MIN_SIZE`` images (a warning says so before). A resumed build is byte-identical to an
    uninterrupted one when run with the same batch size, dtype and torch thread count. ``store_dtype``: "fp32" (default for exact search)
    or "fp16" (default with ``ann``). ``metadata``: CSV/JSON sidecar path or ``{path: record}``.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    batch_size = batch_size if batch_size is not None else default_batch_size(device)
    _check_options(batch_size, shard_size, dtype, store_dtype or "fp32", num_workers)
    if ann is not None:  # fail fast on a bad option, before encoding
        if use_faiss is False:
            raise GalleryIndexError(f"ann={ann!r} needs faiss (use_faiss=False given)")
        dim = ann_vectors(encode_texts(model, processor, "a person"), ann_on).shape[1]
        ann_spec(ann, 1_000_000, dim, ann_params, ann_on)
    out, folder = Path(out), Path(images).resolve()
    sidecar = read_sidecar(metadata) if isinstance(metadata, (str, os.PathLike)) else dict(metadata or {})
    ranks = _Ranks()
    warn = _warner(ranks.rank)
    if ranks.rank == 0:
        header = _prepare(model, processor, folder, out, overwrite, add, sidecar, shard_size, store_dtype,
                          model_name, ann, ann_params, ann_on, warn)  # fmt: skip
    ranks.barrier()
    header_now = read_header(out)  # an existing index keeps its storage dtype (also for --add)
    opts = {"device": device, "dtype": dtype, "num_workers": num_workers, "progress": progress and ranks.rank == 0,
            "store_dtype": STORE_DTYPES[header_now["store_dtype"]]}  # fmt: skip
    pending = _pending(out)
    if pending is not None:
        root, size = Path(header_now["image_root"]), pending["shard_size"]
        files = [root / rel for rel in pending["paths"]]
        n_shards = -(-len(files) // size)
        todo = [j for j in range(ranks.rank, n_shards, ranks.world)
                if _shard_ok(out / BUILD, j, min(size, len(files) - j * size)) is None]  # fmt: skip
        _encode_shards(model, processor, files, todo, size, batch_size, opts, out / BUILD, on_shard)
    ranks.barrier()
    if ranks.rank == 0 and pending is not None:
        _commit(out, header, pending, warn)
    ranks.barrier()
    return GalleryIndex.load(out, cache=False)


def _warner(rank: int) -> Callable[[str], None]:
    def warn(message: str) -> None:
        if rank == 0:  # the CLI shows it as one "tagclip index: warning: ..." line
            warnings.warn(message, stacklevel=3)

    return warn


def _prepare(model, processor, folder, out, overwrite, add, sidecar, shard_size, store_dtype, model_name, ann,
             ann_params, ann_on, warn) -> dict:  # fmt: skip
    """Rank 0: validate the request against ``out`` and leave a pending build in ``out/build`` (or none)."""
    if overwrite and add:
        raise GalleryIndexError("--add grows an existing index; it cannot be combined with --overwrite")
    if out.is_dir() and not (out / HEADER).exists() and any(out.iterdir()):
        raise GalleryIndexError(
            f"{out} is a non-empty folder that holds no gallery index; choose another --out"
        )
    if overwrite and out.exists():
        shutil.rmtree(out)
    files = list_images(folder)
    if add:
        header = read_header(out)
        root = Path(header["image_root"])
        if not folder.is_relative_to(root):
            raise GalleryIndexError(f"--add images must be under the index's image root {root}, got {folder}")
        _check_same(header, {**header, "model_fingerprint": model_fingerprint(model)}, out)
        _check_fixed(header, out, ann, ann_params, store_dtype)
    else:
        root = folder
        store_dtype = store_dtype or ("fp16" if ann else "fp32")
        header = _new_header(model, model_name, root, shard_size, store_dtype, ann, ann_params, ann_on)
        if (out / HEADER).exists():
            old = read_header(out)
            _check_same(old, header, out)
            header = old
        else:
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / HEADER, header)
    rels = [f.relative_to(root).as_posix() for f in files]
    bad = [rel for rel in rels if "\n" in rel]
    if bad:
        raise GalleryIndexError(f"image file names with a newline are not supported: {bad[:3]}")
    manifest = read_manifest(out)
    done = manifest["num_rows"] if manifest else 0
    pending = _pending(out)
    if pending is not None and pending["start"] != done:  # left over from a build that was committed
        shutil.rmtree(out / BUILD, ignore_errors=True)
        pending = None
    db = open_db(out / DATABASE)
    try:
        indexed = {rel for (rel,) in db.execute("SELECT path FROM crops WHERE id < ?", (done,))}
    finally:
        db.close()
    new = [rel for rel in rels if rel not in indexed]
    if not add and manifest is not None and new:
        raise GalleryIndexError(
            f"gallery index {out} is complete and {len(new)} images under {folder} are not in it: use --add "
            "to add them, or --overwrite to rebuild"
        )
    if pending is not None:
        if not add and pending["paths"] != new:
            raise GalleryIndexError(
                f"gallery index {out} was started with a different image list; pass --overwrite to rebuild it"
            )
        if add and pending["paths"] != new:
            warn(f"finishing an interrupted --add of {len(pending['paths'])} images first; run --add again "
                 "for the images it did not include")  # fmt: skip
        return header
    if new:
        _start_pending(out, done, new, _sidecar_for(sidecar, folder, root, new), shard_size)
    elif sidecar:
        raise GalleryIndexError("--metadata given but there are no new images to index")
    return header


def index_embeddings(
    out: str | os.PathLike,
    embeds: dict[str, torch.Tensor],
    paths: Sequence[str],
    image_root: str | os.PathLike,
    *,
    ann: str | None = None,
    ann_params: dict[str, float] | None = None,
    ann_on: str = ANN_ON,
    store_dtype: str | None = None,
    metadata: dict[str, dict] | None = None,
    fingerprint: str | None = None,
) -> GalleryIndex:
    """Write already-encoded rows (``global``, ``local``, ``view_probs``) as a new index at ``out``, or as
    one more segment when ``out`` holds an index: the same files ``build_index`` writes (for benchmarks,
    tests and embeddings computed elsewhere). ``paths`` are relative to ``image_root``."""
    out, rels = Path(out), [Path(p).as_posix() for p in paths]
    _check_embeddings(embeds, rels)  # fail before writing anything
    if (out / HEADER).exists():
        header = read_header(out)
        _check_fixed(header, out, ann, ann_params, store_dtype)
        _commit_embeddings(out, header, embeds, rels, metadata)
        return GalleryIndex.load(out, cache=False)
    store_dtype = store_dtype or ("fp16" if ann else "fp32")
    if ann is not None:
        dim = ann_vectors({k: v[:1] for k, v in embeds.items()}, ann_on).shape[1]
        ann_spec(ann, 1_000_000, dim, ann_params, ann_on)
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store_dtype must be one of {sorted(STORE_DTYPES)}, got {store_dtype!r}")
    header = {**_new_header(None, "", Path(image_root).resolve(), len(rels), store_dtype, ann, ann_params, ann_on),
              "model_fingerprint": fingerprint}  # fmt: skip
    if out.is_dir() and any(out.iterdir()):
        raise GalleryIndexError(f"{out} is a non-empty folder that holds no gallery index; choose another out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        write_json(out / HEADER, header)
        _commit_embeddings(out, header, embeds, rels, metadata)
    except BaseException:  # leave nothing behind: the folder as it was (absent or empty)
        shutil.rmtree(out, ignore_errors=True)
        if not created:
            out.mkdir()
        raise
    return GalleryIndex.load(out, cache=False)


def _check_embeddings(embeds: dict[str, torch.Tensor], rels: Sequence[str]) -> None:
    """Rows ``index_embeddings`` can store: a ``global`` key, one row per path, finite values."""
    if "global" not in embeds:
        raise ValueError(f"embeds needs a 'global' tensor, got keys {sorted(embeds)}")
    wrong = {key: int(value.shape[0]) for key, value in embeds.items() if value.shape[0] != len(rels)}
    if wrong:
        raise ValueError(f"{len(rels)} paths but these embeds have other row counts: {wrong}")
    check_finite(embeds, rels)


def _commit_embeddings(
    out: Path, header: dict, embeds: dict[str, torch.Tensor], rels: list[str], metadata: dict | None
) -> None:
    """One pending shard of ``embeds`` in ``out/build``, committed as a new segment."""
    manifest = read_manifest(out)
    start = manifest["num_rows"] if manifest else 0
    try:
        _start_pending(out, start, rels, dict(metadata or {}), max(1, len(rels)))
        shard = {
            k: v.to(STORE_DTYPES[header["store_dtype"]]) if k != "view_probs" else v for k, v in embeds.items()
        }
        write_json(
            out / BUILD / f"{_shard_name(0)}.json",
            write_tensors(out / BUILD / f"{_shard_name(0)}.safetensors", shard),
        )
        _commit(out, header, _pending(out), _warner(0))
    finally:  # nothing to resume: the rows are not re-encoded from images
        shutil.rmtree(out / BUILD, ignore_errors=True)
