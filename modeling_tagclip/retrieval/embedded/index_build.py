"""Build, resume and grow a gallery index (layout: ``index_store``): a DataLoader keeps the model busy, every
shard is checksummed, nothing is written per shard that grows with the gallery, N processes share the work.

- **Pipeline.** Decoding and the processor's resize/normalise run in ``num_workers`` DataLoader workers,
  batches are pinned on CUDA and copied with ``non_blocking``; the model runs under ``autocast(dtype)``. A
  writer thread checks batch i, copies it back and writes and hashes its shard while batch i+1 runs.
- **O(N) metadata.** The pending path list is written once (``build/paths.txt``); each shard adds one small
  ``shard_<j>.json`` (rows, SHA-256); the crop database and the manifest are written once at the end.
- **Resume and integrity.** A shard counts as done only if its JSON record, row count and checksum agree;
  anything else (missing middle shard, truncated file, a crash mid-write) is re-encoded. Batches are aligned
  to shard starts, so a resumed build is byte-identical to an uninterrupted one.
- **Scale-out.** Under ``torchrun``/``accelerate launch`` (``WORLD_SIZE`` > 1), rank r encodes shards j with
  j mod world == r into the same ``build/``; rank 0 merges them into one segment: the same index as one process.
- **Growing.** ``add=True`` encodes only images not yet in the index into a new segment (+ its own ANN index
  from the trained quantizer): O(new crops), no rebuild, and the returned index reads nothing until searched.
  Retraining and calibration of the ANN are in ``ann``. Crop metadata (view, camera, timestamp, tags) comes
  from a CSV/JSON sidecar. Image names the index cannot store (``index_store.unsafe_name``) are skipped with a
  warning.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..encode import DTYPES, encode_texts
from ..gallery_types import list_images, metadata_rows, model_fingerprint, read_sidecar, sidecar_for
from ..ingest import CropBatches, Ranks, encode_batch, progress_bar
from .ann import (
    ANN_ON,
    CALIBRATION_QUERIES,
    MAX_CALIBRATION_QUERIES,
    QUERIES_FILE,
    ann_spec,
    ann_vectors,
    check_calibration_queries,
    write_calibration_queries,
)
from .gallery_index import GalleryIndex
from .index_commit import (
    BUILD,
    ROWS,
    STORE_DTYPES,
    append_embeddings,
    check_storable,
    commit,
    commit_embeddings,
    read_pending,
    shard_name,
    start_pending,
    warner,
)
from .index_store import (
    DATABASE,
    HEADER,
    INDEX_FORMAT,
    INDEX_VERSION,
    FixedSettingError,
    GalleryIndexError,
    IndexMismatchError,
    UnindexedImagesError,
    check_finite,
    open_db,
    read_header,
    read_manifest,
    sha256_file,
    unsafe_name,
    write_json,
    write_tensors,
)
from .row_store import store_rows

CALIBRATION_TEXTS = CALIBRATION_QUERIES  # default person descriptions a new ANN index calibrates on

__all__ = [
    "CALIBRATION_TEXTS",
    "STORE_DTYPES",
    "build_index",
    "default_batch_size",
    "index_embeddings",
    "read_sidecar",
]


def default_batch_size(device: torch.device) -> int:
    """Images per forward: 256 on a GPU (bf16 ViT-B/16 fits easily), 32 on CPU."""
    return 256 if device.type == "cuda" else 32


# ---------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Encoding shards
# ---------------------------------------------------------------------------------------------------------


def _copied(device: torch.device) -> Any:
    """A CUDA event after the batch's copies were queued (None on CPU: the rows are ready)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class _ShardWriter:
    """Checks encoded batches and writes each complete shard (checksummed file + record) in a thread, so
    batch i's copy-back, checks and shard write and hash overlap batch i+1's forward; the bounded queue
    keeps at most ``depth`` batches in flight. An error in the thread is raised in the caller."""

    def __init__(self, files, batches, owner, shard_size, opts, build: Path, on_shard, depth: int = 2):
        self.files, self.batches, self.owner, self.shard_size = files, batches, owner, shard_size
        self.opts, self.build, self.on_shard = opts, build, on_shard
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tagclip-shard-writer", daemon=True)
        self.thread.start()

    def put(self, b: int, rows: dict[str, torch.Tensor], ready: Any, unreadable: dict[int, str]) -> None:
        self._raise()
        self.queue.put((b, rows, ready, unreadable))

    def close(self, ok: bool = True) -> None:
        """Wait for every queued batch (``ok``) or only the one being written, then raise its error."""
        if not ok:
            while not self.queue.empty():
                self.queue.get_nowait()
        self.queue.put(None)
        self.thread.join()
        if ok:
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        parts, unreadable = [], {}
        try:
            while (item := self.queue.get()) is not None:
                b, rows, ready, bad = item
                if ready is not None:
                    ready.synchronize()
                batch = self.batches[b]
                check_finite(rows, [self.files[i] for i in batch], first=batch.start)
                parts.append(rows)
                unreadable.update(bad)
                if b + 1 == len(self.batches) or self.owner[b + 1] != self.owner[b]:
                    self._write(self.owner[b], parts, unreadable)
                    parts, unreadable = [], {}
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which raises it
            self.error = error
            while self.queue.get() is not None:  # let the caller's puts and close go through
                pass

    def _write(self, j: int, parts: list[dict], unreadable: dict[int, str]) -> None:
        store = self.opts["store_dtype"]
        shard = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        shard = store_rows(shard, store)
        record = write_tensors(self.build / f"{shard_name(j)}.safetensors", shard)
        write_json(self.build / f"{shard_name(j)}.json", {**record, "unreadable": unreadable})
        if self.on_shard is not None:
            self.on_shard(min((j + 1) * self.shard_size, len(self.files)), len(self.files))


def _shard_ok(build: Path, j: int, rows: int) -> dict | None:
    """The shard's record if it is complete and its checksum verifies, else None."""
    try:
        record = json.loads((build / f"{shard_name(j)}.json").read_text())
        ok = (
            record["rows"] == rows and sha256_file(build / f"{shard_name(j)}.safetensors") == record["sha256"]
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
        CropBatches(processor, files, batches),
        batch_size=None,
        num_workers=opts["num_workers"],
        pin_memory=device.type == "cuda",
    )
    bar = progress_bar(sum(len(b) for b in batches), opts["progress"])
    writer = _ShardWriter(files, batches, owner, shard_size, opts, build, on_shard)
    ok = False
    try:
        for b, (pixels, bad) in enumerate(loader):
            rows = encode_batch(model, pixels, device, opts["dtype"])
            writer.put(b, rows, _copied(device), bad)
            bar.update(len(batches[b]))
        ok = True
    finally:
        writer.close(ok)
        bar.close()


# ---------------------------------------------------------------------------------------------------------
# Sidecar metadata
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Pending builds
# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexRequest:
    """What a build or add asks of the index folder ``out`` (validated by ``_prepare`` on rank 0)."""

    folder: Path  # the images to index (resolved)
    out: Path  # the index directory
    overwrite: bool = False  # rebuild from scratch
    add: bool = False  # grow an existing index by the images not yet in it
    sidecar: dict[str, dict] = field(default_factory=dict)  # per-image metadata, keyed by path in ``folder``
    shard_size: int = 512
    store_dtype: str | None = None  # None: the index's (fp16 with ANN, else fp32 for a new one)
    model_name: str | None = None
    ann: str | None = None
    ann_params: dict[str, float] | None = None
    ann_on: str = ANN_ON
    calibration_queries: dict[str, torch.Tensor] | None = None  # text embeddings kept with a new ANN index


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


def _new_header(model: Any, request: IndexRequest, root: Path, store_dtype: str) -> dict:
    ann = (
        {"ann": request.ann, "params": request.ann_params or {}, "on": request.ann_on}
        if request.ann
        else None
    )
    config = getattr(model, "config", None)
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "model": request.model_name or str(getattr(config, "_name_or_path", "") or ""),
        "model_fingerprint": model_fingerprint(model) if model is not None else None,
        "image_root": str(root),
        "shard_size": request.shard_size,
        "store_dtype": store_dtype,
        "ann_request": ann,
        "ann": None,
    }


def _check_same(header: dict, new: dict, out: Path) -> None:
    for key, what in (
        ("model_fingerprint", "model"),
        ("image_root", "image folder"),
        ("store_dtype", "storage dtype"),
    ):
        if header.get(key) != new.get(key):
            raise IndexMismatchError(f"gallery index {out} was built with a different {what}")


def _check_fixed(header: dict, out: Path, ann: str | None, ann_params: dict | None, store_dtype: str | None):
    """Refuse settings that differ from those ``out`` was built with (None: keep the index's)."""
    request = header.get("ann_request") or {}
    if ann is not None and (ann, ann_params or {}) != (request.get("ann"), request.get("params", {})):
        raise FixedSettingError(
            f"the ANN settings of {out} are fixed when it is built ({request or 'exact'}) and cannot change "
            "when it grows"
        )
    if store_dtype is not None and store_dtype != header.get("store_dtype"):
        raise FixedSettingError(
            f"the storage dtype of {out} is fixed when it is built ({header.get('store_dtype')}) and cannot "
            "change when it grows"
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
    calibration_texts: Sequence[str] | None = None,
) -> GalleryIndex:
    """Encode every image under ``images`` into the index directory ``out`` (resuming an interrupted build),
    or with ``add=True`` the images not yet in it (``images`` = the index's image root or a folder inside).

    ``ann``: "ivf" (``ANN_PRESETS``) or a faiss index_factory string over ``ann_vectors(.., ann_on)``, with
    ``ann_params`` (``nprobe``, ``k_factor``, ...; those not given are calibrated) kept in ``index.json``;
    built once the gallery has ``ANN_MIN_SIZE`` images (a warning says so before). A resumed build is
    byte-identical to an uninterrupted one when run with the same batch size, dtype and torch thread count.
    ``store_dtype``: "fp32" (default for exact search) or "fp16" (default with ``ann``). ``metadata``: CSV/JSON
    sidecar path or ``{path: record}``. Images whose name the index cannot store (``unsafe_name``) are skipped
    with a warning. ``calibration_texts``: captions whose text embeddings a new ANN index keeps and calibrates
    on, beside held-out gallery rows (default: ``CALIBRATION_TEXTS`` synthetic person descriptions,
    ``data.synthetic.person_descriptions``; ``()``: the rows alone). Returns the index, whose files are read
    when first searched.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    batch_size = batch_size if batch_size is not None else default_batch_size(device)
    _check_options(batch_size, shard_size, dtype, store_dtype or "fp32", num_workers)
    if ann is not None:  # fail fast on a bad option, before encoding
        if use_faiss is False:
            raise GalleryIndexError(f"ann={ann!r} needs faiss (use_faiss=False given)")
        dim = ann_vectors(encode_texts(model, processor, "a person"), ann_on).shape[1]
        ann_spec(ann, 1_000_000, dim, ann_params, ann_on)
    out = Path(out)
    ranks = Ranks()
    queries = _calibration_queries(model, processor, out, ann, add, overwrite, calibration_texts, ranks.rank)
    sidecar = read_sidecar(metadata) if isinstance(metadata, (str, os.PathLike)) else dict(metadata or {})
    request = IndexRequest(
        Path(images).resolve(),
        out,
        overwrite,
        add,
        sidecar,
        shard_size,
        store_dtype,
        model_name,
        ann,
        ann_params,
        ann_on,
        queries,
    )
    warn = warner(ranks.rank)
    if ranks.rank == 0:
        header = _prepare(model, request, warn)
    ranks.barrier()
    header_now = read_header(out)  # an existing index keeps its storage dtype (also for --add)
    opts = {
        "device": device,
        "dtype": dtype,
        "num_workers": num_workers,
        "progress": progress and ranks.rank == 0,
        "store_dtype": STORE_DTYPES[header_now["store_dtype"]],
    }
    pending = read_pending(out)
    if pending is not None:
        root, size = Path(header_now["image_root"]), pending["shard_size"]
        files = [root / rel for rel in pending["paths"]]
        n_shards = -(-len(files) // size)
        todo = [
            j
            for j in range(ranks.rank, n_shards, ranks.world)
            if _shard_ok(out / BUILD, j, min(size, len(files) - j * size)) is None
        ]
        _encode_shards(model, processor, files, todo, size, batch_size, opts, out / BUILD, on_shard)
    ranks.barrier()
    if ranks.rank == 0 and pending is not None:
        commit(out, header, pending, warn)
    ranks.barrier()
    return GalleryIndex.load(
        out, cache=False, lazy=True
    )  # reads nothing more until searched: O(1) after an add


def _calibration_queries(
    model, processor, out: Path, ann: str | None, add: bool, overwrite: bool, texts: Any, rank: int
) -> dict[str, torch.Tensor] | None:
    """Rank 0, a new ANN index: the text embeddings of ``texts`` (None: the default person descriptions) its
    calibration keeps; None otherwise. Texts given to an add are refused: they are fixed when it is built."""
    if texts is not None:  # a generator is read once: into a list first
        texts = None if isinstance(texts, (str, bytes)) else list(texts)
        if texts is None or not all(isinstance(t, str) for t in texts):
            raise ValueError("calibration_texts must be a list of captions")
    new = overwrite or not (out / HEADER).exists()
    if add and texts is not None and not new:
        raise FixedSettingError(f"the calibration texts of {out} are given when it is built, not on an add")
    if ann is None or not new or rank != 0 or (texts is not None and not texts):
        return None
    if texts is None:
        from ...data.synthetic import person_descriptions

        texts = person_descriptions(CALIBRATION_TEXTS)
    if len(texts) > MAX_CALIBRATION_QUERIES:
        raise ValueError(f"calibration_texts: at most {MAX_CALIBRATION_QUERIES} captions, got {len(texts)}")
    with torch.inference_mode():
        embedded = encode_texts(model, processor, list(texts))
    return check_calibration_queries({key: embedded[key] for key in ("global", "local") if key in embedded})


def _check_location(request: IndexRequest) -> None:
    out = request.out
    if request.overwrite and request.add:
        raise GalleryIndexError("an index cannot be grown (add) and rebuilt from scratch (overwrite) at once")
    if out.is_dir() and not (out / HEADER).exists() and not all(map(_started, out.iterdir())):
        raise GalleryIndexError(f"{out} is a non-empty folder that holds no gallery index")


def _started(path: Path) -> bool:
    """Whether ``path`` is what a new ANN index writes before ``index.json`` (its calibration queries, or their
    temporary file): left by a build killed at its start, replaced by the next one."""
    name = path.name
    return name == QUERIES_FILE or (name.startswith(f".{QUERIES_FILE}.") and name.endswith(".tmp"))


def _header_for(model: Any, request: IndexRequest) -> tuple[dict, Path]:
    """(header, image root) of the index ``request.out`` will hold, written now for a new index."""
    out, folder = request.out, request.folder
    if request.add:
        header = read_header(out)
        root = Path(header["image_root"])
        if not folder.is_relative_to(root):
            raise GalleryIndexError(
                f"images to add must be under the index's image root {root}, got {folder}"
            )
        _check_same(header, {**header, "model_fingerprint": model_fingerprint(model)}, out)
        _check_fixed(header, out, request.ann, request.ann_params, request.store_dtype)
        return header, root
    store_dtype = request.store_dtype or ("fp16" if request.ann else "fp32")
    header = _new_header(model, request, folder, store_dtype)
    if (out / HEADER).exists():
        old = read_header(out)
        _check_same(old, header, out)
        return old, folder
    out.mkdir(parents=True, exist_ok=True)
    for stale in filter(_started, out.iterdir()):  # left by a build killed before its index.json
        stale.unlink()
    if request.ann and request.calibration_queries is not None:
        header["ann_request"]["queries"] = write_calibration_queries(out, request.calibration_queries)
    write_json(out / HEADER, header)
    return header, folder


def _storable(files: Sequence[Path], root: Path, warn: Callable[[str], None]) -> list[str]:
    """Paths relative to ``root`` of the files whose name the index can store; the others are reported."""
    rels, skipped = [], []
    for file in files:
        rel = file.relative_to(root).as_posix()
        reason = unsafe_name(rel) or ("a newline" if "\n" in rel else None)
        (skipped.append(f"{rel!r} ({reason})") if reason else rels.append(rel))
    if skipped:
        warn(f"{len(skipped)} image(s) skipped, their names cannot be stored: {'; '.join(skipped[:5])}")
    return rels


def _prepare(model: Any, request: IndexRequest, warn: Callable[[str], None]) -> dict:
    """Rank 0: validate ``request`` against its folder and leave a pending build in ``out/build`` (or none)."""
    out, folder = request.out, request.folder
    _check_location(request)
    if request.overwrite and out.exists():
        shutil.rmtree(out)
    files = list_images(folder)
    header, root = _header_for(model, request)
    rels = _storable(files, root, warn)
    manifest = read_manifest(out)
    done = manifest["num_rows"] if manifest else 0
    pending = read_pending(out)
    if pending is not None and pending["start"] != done:  # left over from a build that was committed
        shutil.rmtree(out / BUILD, ignore_errors=True)
        pending = None
    new = _not_indexed(out, rels, done)
    if not request.add and manifest is not None and new:
        raise UnindexedImagesError(
            f"gallery index {out} is complete and {len(new)} images under {folder} are not in it"
        )
    if pending is not None:
        if not request.add and pending["paths"] != new:
            raise IndexMismatchError(f"gallery index {out} was started with a different image list")
        if request.add and pending["paths"] != new:
            warn(
                f"finishing an interrupted add of {len(pending['paths'])} images first; add again for the "
                "images it did not include"
            )
        _upgrade_pending(out)
        return header
    if new:
        rows = metadata_rows(sidecar_for(request.sidecar, folder, root, new))
        start_pending(out, done, new, rows, request.shard_size)
    elif request.sidecar:  # a scheduled `--add --metadata` when nothing arrived: nothing to do, not an error
        warn("no new images to index: the metadata file is not read")
    return header


def _upgrade_pending(out: Path) -> None:
    """A pending build started by an earlier version kept sidecar records (``metadata.json``), not rows."""
    build = out / BUILD
    if (build / ROWS).is_file():
        return
    try:
        records = json.loads((build / "metadata.json").read_text())
    except (OSError, ValueError):
        records = None
    if not isinstance(records, dict):
        raise GalleryIndexError(
            f"the interrupted build in {build} has no readable crop metadata: rebuild with --overwrite"
        )
    write_json(build / ROWS, metadata_rows(records))


def _not_indexed(out: Path, rels: Sequence[str], done: int) -> list[str]:
    """``rels`` not yet among the committed crops (looked up in batches: memory grows with ``rels``)."""
    db = open_db(out / DATABASE)
    try:
        known: set[str] = set()
        for start in range(0, len(rels), 512):
            batch = rels[start : start + 512]
            sql = f"SELECT path FROM crops WHERE id < ? AND path IN ({', '.join('?' * len(batch))})"
            known.update(rel for (rel,) in db.execute(sql, (done, *batch)))
    finally:
        db.close()
    return [rel for rel in rels if rel not in known]


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
    calibration_queries: dict[str, torch.Tensor] | None = None,
) -> GalleryIndex:
    """Write already-encoded rows (``global``, ``local``, ``view_probs``) as a new index at ``out``, or as
    one more segment when ``out`` holds an index: the same files ``build_index`` writes (for benchmarks,
    tests and embeddings computed elsewhere). ``paths`` are relative to ``image_root``.
    ``calibration_queries``: text query embeddings (``global``, ``local``) the ANN's calibration must reach its
    recall target on (``ann.check_calibration_queries``), kept with a new index; given only when it is built."""
    out, rels = Path(out), [Path(p).as_posix() for p in paths]
    if (out / HEADER).exists():
        header = read_header(out)
        _check_fixed(header, out, ann, ann_params, store_dtype)
        if calibration_queries is not None:
            raise FixedSettingError(
                f"the calibration queries of {out} are given when it is built, not on an add"
            )
        append_embeddings(out, embeds, rels, metadata)
        return GalleryIndex.load(out, cache=False, lazy=True)
    check_storable(embeds, rels)  # fail before writing anything
    store_dtype = store_dtype or ("fp16" if ann else "fp32")
    if ann is not None:
        dim = ann_vectors({k: v[:1] for k, v in embeds.items()}, ann_on).shape[1]
        ann_spec(ann, 1_000_000, dim, ann_params, ann_on)
    if calibration_queries is not None:
        if ann is None:
            raise GalleryIndexError("calibration queries calibrate an ANN index: give ann= too")
        dims = {key: embeds[key].shape[1] for key in ("global", "local") if key in embeds}
        calibration_queries = check_calibration_queries(calibration_queries, dims)
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store_dtype must be one of {sorted(STORE_DTYPES)}, got {store_dtype!r}")
    request = IndexRequest(
        Path(image_root).resolve(),
        out,
        shard_size=len(rels),
        store_dtype=store_dtype,
        model_name="",
        ann=ann,
        ann_params=ann_params,
        ann_on=ann_on,
    )
    header = {**_new_header(None, request, request.folder, store_dtype), "model_fingerprint": fingerprint}
    if out.is_dir() and any(out.iterdir()):
        raise GalleryIndexError(f"{out} is a non-empty folder that holds no gallery index")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        if calibration_queries is not None:
            header["ann_request"]["queries"] = write_calibration_queries(out, calibration_queries)
        write_json(out / HEADER, header)
        commit_embeddings(out, header, embeds, rels, metadata)
    except BaseException:  # leave nothing behind: the folder as it was (absent or empty)
        shutil.rmtree(out, ignore_errors=True)
        if not created:
            out.mkdir()
        raise
    return GalleryIndex.load(out, cache=False, lazy=True)
