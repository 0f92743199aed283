"""Gallery index for TAG-CLIP text-to-person search: open a built index, filter, search exactly or approximately.

The layers, one module each: on-disk format (header, manifest of checksummed segments, SQLite crop metadata)
in ``index_store``; the approximate index (presets, training, calibration, faiss files) in ``ann``; building,
resuming, ``--add`` and multi-process encoding in ``index_build``; search here. ``GalleryIndex`` implements
``store.GalleryStore``. Exact search ranks with TAG-PR Eq. 14 gallery chunk by gallery chunk, so a [queries, N] matrix
is never materialised. With an approximate index (``ann="ivf"``) each segment's faiss index proposes
``k_factor x k`` candidates per query, re-ranked exactly from the stored vectors (fp16 by default for ANN
indexes): serving holds the stored vectors and the PQ codes, no second fp32 copy. Filters (view, camera,
time window, tag; removed crops; rows skipped as unsafe) select rows before ranking: a boolean row mask in
exact search, a faiss ``IDSelectorBitmap`` inside the IVF scan with nprobe adapted to the kept fraction, exact
search over the selected rows when they are fewer than the measured crossover (``filtered``); the rows and
selector of a filter are cached per distinct filter; never over-fetch-and-drop.

Hub custom-code compatible (shipped beside ``pipeline_tagclip.py``): only the standard library, torch,
safetensors, PIL and tqdm are imported; faiss is optional.
"""

from __future__ import annotations

import itertools
import math
import os
import sqlite3
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..encode import encode_images, encode_texts, eq14_similarity, view_prediction
from ..gallery_types import (
    IMAGE_EXTENSIONS,
    VIEW_NAMES,
    GalleryIndexError,
    Hit,
    IncompleteIndexError,
    ModelMismatchError,
    SearchFilter,
    check_embeddings,
    check_finite,
    crop_file,
    crop_id,
    decode_metadata,
    gallery_root,
    list_images,
    metadata_row,
    model_fingerprint,
    parse_crop_id,
    unsafe_name,
)
from .ann import (
    ANN_MIN_SIZE,
    ANN_PRESETS,
    IVF_K_FACTOR,
    ann_spec,
    ann_vectors,
    candidates,
    faiss,
    merge_ann,
    read_faiss,
    set_search_params,
)
from .filtered import (
    FILTER_PROBE_POWER,
    Selection,
    SelectionCache,
    filtered_nprobe,
    measure_crossover,
    removed_count,
    selection_key,
)
from .index_store import (
    DATABASE,
    INDEX_FORMAT,
    INDEX_VERSION,
    RowPaths,
    allowed_mask,
    crop_keys,
    crop_metadata,
    insert_crops,
    map_segment,
    mark_removed,
    open_db,
    read_header,
    read_manifest,
    read_segment,
    removed_rows,
    row_paths,
    track_rows,
)
from .row_store import (
    SegmentedRows,
    dequantize,
    dequantized,
    embedding_keys,
    joined,
    non_finite_rows,
    release_free_heap,
)

__all__ = [
    "ANN_MIN_SIZE",
    "ANN_PRESETS",
    "IMAGE_EXTENSIONS",
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "GalleryIndex",
    "GalleryIndexError",
    "SearchFilter",
    "ann_spec",
    "check_finite",
    "chunked_topk",
    "encode_images",
    "encode_texts",
    "list_images",
    "model_fingerprint",
    "read_meta",
]


EXACT_SUBSET_MAX = 65536  # an exact search gathers at most this many selected rows (else a masked full scan)
read_meta = read_header


def _concat(parts: Iterator[dict[str, torch.Tensor]], total: int) -> dict[str, torch.Tensor]:
    """Segments' tensors (read one at a time from ``parts``) joined per key into buffers of ``total`` rows,
    each part freed once copied: memory is the rows plus one segment, never twice the rows (one segment: no
    copy at all)."""
    part = next(parts, None)
    if part is None or _rows(part) == total:
        return part or {}
    out = {key: value.new_empty((total, *value.shape[1:])) for key, value in part.items()}
    start = 0
    while part is not None:
        for key, value in part.items():
            out[key][start : start + _rows(part)] = value
        start += _rows(part)
        part = next(parts, None)
    return out


def _rows(part: dict[str, Any]) -> int:
    return next(iter(part.values())).shape[0]


GROWTH = 1.125  # a grown gallery's buffer keeps 1/8 spare rows: appends cost O(added) amortised


def _grow(
    buffer: dict[str, torch.Tensor], size: int, parts: list[dict[str, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(rows, buffer): the first ``size`` rows of ``buffer`` with ``parts`` appended, as views of a buffer
    reallocated with ``GROWTH`` spare capacity only when full (a server's index grows without copying itself
    on every add)."""
    added = sum(next(iter(p.values())).shape[0] for p in parts)
    capacity = next(iter(buffer.values())).shape[0]
    if size + added > capacity:
        capacity = max(size + added, int(GROWTH * (size + added)))
        grown = {key: value.new_empty((capacity, *value.shape[1:])) for key, value in buffer.items()}
        for key, value in grown.items():
            value[:size] = buffer[key][:size]
        buffer = grown
    start = size
    for part in parts:
        rows = next(iter(part.values())).shape[0]
        for key, value in part.items():
            buffer[key][start : start + rows] = value
        start += rows
    return {key: value[:start] for key, value in buffer.items()}, buffer


# ---------------------------------------------------------------------------------------------------------
# Exact search
# ---------------------------------------------------------------------------------------------------------


def _scores(query: dict[str, torch.Tensor], gallery: dict[str, Any], rows: Any) -> torch.Tensor:
    """TAG-PR Eq. 14 scores of the queries against gallery ``rows`` (a slice or an index tensor), in float32
    (an int8 store dequantised row by row)."""
    keys = ["global", "local"] if "local" in gallery and "local" in query else ["global"]
    stored = dequantized(gallery, keys, rows)
    return eq14_similarity(query["global"], stored["global"], query.get("local"), stored.get("local"))


def chunked_topk(
    query: dict[str, torch.Tensor],
    gallery: dict[str, torch.Tensor],
    k: int,
    chunk_size: int = 16384,
    query_chunk: int = 256,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` TAG-PR Eq. 14 scores and gallery rows [n_queries, k'] among the rows ``mask`` allows (all
    without a mask; k' = min(k, allowed rows)), holding at most query_chunk x chunk_size scores at once."""
    size = gallery["global"].shape[0]
    k = min(k, size if mask is None else int(mask.sum()))
    n_queries = query["global"].shape[0]
    if k == 0:
        return torch.empty(n_queries, 0), torch.empty(n_queries, 0, dtype=torch.long)
    all_scores, all_indices = [], []
    for q0 in range(0, n_queries, query_chunk):
        part = {key: value[q0 : q0 + query_chunk] for key, value in query.items()}
        best_s = torch.empty(part["global"].shape[0], 0)
        best_i = torch.empty(part["global"].shape[0], 0, dtype=torch.long)
        for start in range(0, size, chunk_size):
            stop = min(start + chunk_size, size)
            chunk = _scores(part, gallery, slice(start, stop))
            if mask is not None:
                chunk = chunk.masked_fill(~mask[start:stop], -math.inf)
            scores = torch.cat([best_s, chunk], dim=1)
            ids = torch.cat([best_i, torch.arange(start, stop).expand(scores.shape[0], -1)], dim=1)
            best_s, pos = scores.topk(min(k, scores.shape[1]), dim=1)
            best_i = ids.gather(1, pos)
        all_scores.append(best_s)
        all_indices.append(best_i)
    return torch.cat(all_scores), torch.cat(all_indices)


def rerank(
    query: dict[str, torch.Tensor], gallery: dict[str, torch.Tensor], candidates: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact TAG-PR Eq. 14 top-``k`` among each query's candidate rows [n_queries, C] (-1 = no candidate).
    The candidates are read in ascending row order: nearer pages, and one slice per segment of the store."""
    candidates = candidates.sort(dim=1).values
    scores = torch.full(candidates.shape, -math.inf)
    for q in range(candidates.shape[0]):  # one small gather + matmul per query: C x D, never N x D
        valid = candidates[q] >= 0
        one = {key: value[q : q + 1] for key, value in query.items()}
        scores[q, valid] = _scores(one, gallery, candidates[q, valid])[0]
    best, pos = scores.topk(min(k, scores.shape[1]), dim=1)
    return best, candidates.gather(1, pos)


# ---------------------------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------------------------

_CACHE: dict[tuple, tuple[tuple, GalleryIndex]] = {}


def _state(path: Path) -> tuple:
    """What changes when an index directory is rebuilt or grown (removals are read from SQLite per search)."""
    return tuple(
        (f.stat().st_mtime_ns, f.stat().st_size) if f.exists() else None
        for f in (path / "index.json", path / "manifest.json")
    )


class GalleryIndex:
    """Encoded gallery: embeddings, router view probabilities, image paths and per-crop metadata (SQLite).

    Implements ``store.GalleryStore``. An index loaded from a folder reads its segments, paths and faiss
    files on first use (``len``, ``meta`` and ``fingerprint`` need none of them) and, reloaded from the cache
    after an add, reads only the new segments. Rows whose path is unsafe or whose embedding is not finite are
    reported once and never returned.
    """

    def __init__(
        self,
        embeds: dict[str, torch.Tensor],
        paths: Sequence[str] | None = None,
        meta: dict | None = None,
        db: sqlite3.Connection | None = None,
    ):
        if "global" not in embeds:
            raise GalleryIndexError("gallery embeddings need a 'global' tensor")
        self._embeds: dict[str, torch.Tensor] | None = embeds
        self._paths = list(paths) if paths is not None else None
        self.meta = dict(meta or {})
        self.folder: Path | None = None  # the index directory of a loaded index
        self.root: Path | None = None  # its image root
        self.allow_outside_root = False
        self._ann_indexes: list[Any] = []  # what a search probes: one merged index when the segments allow
        self._ann_files: list[str] = []  # the checksums of the segments' ANN files held there
        self._ann_merged = False
        self.ann_params: dict[str, float] = {}
        self.bad: torch.Tensor | None = None  # rows never returned (unsafe path, non-finite embedding)
        self._segments: list[dict] = []  # manifest segments read into ``_embeds`` (loaded index)
        self._buffer: dict[str, torch.Tensor] | None = None  # rows + spare capacity once grown (``_grow``)
        self._mapped = False  # rows memory-mapped from the segment files (a loaded index)
        self._filtering()
        self._keys: dict[int, int] | None = None  # {path_id: row}, built by the first query by hit id
        if self._paths is not None and len(self._paths) != len(self):
            raise GalleryIndexError(f"{len(self._paths)} paths for {len(self)} embeddings")
        self.db = db if db is not None else self._memory_db()

    def __len__(self) -> int:
        if self._embeds is None:
            return int(self.meta["num_rows"])
        return self._embeds["global"].shape[0]

    @property
    def fingerprint(self) -> str | None:
        """``model_fingerprint`` of the model that built the index (None when unknown)."""
        return self.meta.get("model_fingerprint")

    @property
    def store(self) -> dict[str, Any]:
        """The stored rows as search reads them: tensors, memory-mapped for a loaded index, ``SegmentedRows``
        where it has several segments; an int8 store holds codes and ``<key>_scale`` rows (``row_store``)."""
        if self._embeds is None:
            self._read()
        return self._embeds

    @property
    def embeds(self) -> dict[str, torch.Tensor]:
        """``store`` as tensors (several memory-mapped segments joined: a copy, for small galleries and tests)."""
        return {
            key: value[:] if isinstance(value, SegmentedRows) else value for key, value in self.store.items()
        }

    @property
    def paths(self) -> Sequence[str | None] | None:
        """Each row's image path (None: missing or unsafe); a loaded index reads them from its crop database
        on access (``RowPaths``), an index built in memory holds the list it was given."""
        if self._embeds is None:
            self._read()
        return self._paths

    @property
    def ann_indexes(self) -> list[Any]:
        """The approximate indexes a search probes: one, holding every segment's rows, when the segments are IVF
        indexes of one quantizer (the presets), else one per segment; empty for exact search."""
        if self._embeds is None:
            self._read()
        return self._ann_indexes

    def _memory_db(self) -> sqlite3.Connection:
        db = open_db(":memory:")
        names = self._paths or [f":{i}" for i in range(len(self))]
        views = [view_prediction(self._embeds.get("view_probs"), i)[0] for i in range(len(self))]
        insert_crops(db, 0, [metadata_row(p, None, v) for p, v in zip(names, views, strict=True)])
        return db

    @property
    def faiss_index(self) -> Any:
        """The first approximate index a search probes (None for exact search)."""
        return self.ann_indexes[0] if self.ann_indexes else None

    @classmethod
    def from_images(
        cls, model, processor, images: Sequence, batch_size: int = 32, progress: bool = False, **encode_kwargs
    ) -> GalleryIndex:
        """Encode a list of PIL images or paths in memory (``encode_kwargs``: dtype, num_workers, ...)."""
        paths = [str(image) if not isinstance(image, Image.Image) else None for image in images]
        embeds = encode_images(model, processor, images, batch_size, progress, **encode_kwargs)
        check_finite(embeds, [p or f"PIL image {i}" for i, p in enumerate(paths)])
        meta = {"model_fingerprint": model_fingerprint(model)}
        return cls(embeds, paths if all(p is not None for p in paths) else None, meta)

    @classmethod
    def from_folder(
        cls,
        model,
        processor,
        folder: str | os.PathLike,
        batch_size: int = 32,
        progress: bool = False,
        **kwargs,
    ) -> GalleryIndex:
        """Encode every image under ``folder`` in memory."""
        return cls.from_images(model, processor, list_images(folder), batch_size, progress, **kwargs)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        image_root: str | os.PathLike | None = None,
        allow_outside_root: bool = False,
        cache: bool = True,
        lazy: bool = False,
        mmap: bool = True,
    ) -> GalleryIndex:
        """Load an index directory written by ``index_build.build_index``, verifying every checksum (with
        ``lazy``, its segments, paths and faiss files are read on first use). The crop database is opened
        read-only.

        With ``cache``, an index already loaded from ``path`` is returned as is while unchanged on disk, and
        after an add reads only the new segments (a server reloads nothing between queries; removals apply
        immediately). Image paths must stay inside the image root unless ``allow_outside_root``.

        With ``mmap`` (the default) fp16 and int8 stores (the ANN indexes') are memory-mapped
        (``index_store.map_tensors``): loading reads each file once to verify it and holds no copy; resident
        memory is what searches touch. Other stores are read into memory (the rows plus one segment at the
        peak): an fp32 store is scanned whole by exact search, and rows in their own aligned buffer give
        scores bit-identical to a gallery built in memory (a matmul over rows at a file offset can differ in
        the last bit).
        """
        path = Path(path).resolve()
        key = (str(path), str(image_root), allow_outside_root, mmap)
        state = _state(path)
        if cache and key in _CACHE:
            cached_state, index = _CACHE[key]
            if cached_state != state:
                index._refresh()
                _CACHE[key] = (state, index)
            return index
        index = cls._load(path, image_root, allow_outside_root)
        index._mapped = mmap and index.meta.get("store_dtype", "fp32") != "fp32"
        if not lazy:
            index._read()
        if cache:
            _CACHE[key] = (state, index)
        return index

    @classmethod
    def _load(cls, path: Path, image_root: Any, allow_outside_root: bool) -> GalleryIndex:
        header, manifest = _committed(path)
        index = cls.__new__(cls)
        index._embeds, index._paths, index._segments, index._buffer = None, None, [], None
        index.meta = {**header, "num_rows": manifest["num_rows"]}
        index.folder, index.allow_outside_root = path, allow_outside_root
        index.root = Path(image_root) if image_root is not None else Path(header["image_root"])
        if not allow_outside_root:
            gallery_root(index.root, f"gallery index {path}")
        index._ann_indexes, index._ann_files, index._ann_merged, index.ann_params = [], [], False, {}
        index.bad, index._keys = None, None
        index._filtering()
        index.db = open_db(path / DATABASE, read_only=True)
        index._manifest = manifest
        return index

    def _read(self) -> None:
        """Read the committed segments not read yet, their paths and ANN files (all on first use). Segments
        merged from ones already read (``compaction``) hold rows already in memory: they are not read again."""
        manifest = self._manifest
        unread = _unread(self._segments, manifest["segments"], len(self) if self._embeds is not None else 0)
        if unread is None:  # rebuilt, not grown: read everything again
            self._embeds, self._paths, self._segments, self.bad = None, None, [], None
            self._buffer, unread = None, (manifest["segments"], 0)
        new, skip = unread
        if self._embeds is not None and not new:
            if self._segments != manifest["segments"]:  # merged on disk, no new rows
                self._segments = list(manifest["segments"])
                self._read_ann()
            return
        start = new[0]["start"] + skip if new else 0
        bad = (
            self._map(new, skip) if self._mapped else self._load_rows(new, skip, manifest["num_rows"] - start)
        )
        self._paths = RowPaths(self._connection, self.root, manifest["num_rows"], self.allow_outside_root)
        bad |= self._paths.missing(start, manifest["num_rows"])
        self._report(bad, start)
        self.bad = bad if self.bad is None else torch.cat([self.bad, bad])
        self._segments = list(manifest["segments"])
        self._generation += 1
        self._read_ann()
        release_free_heap()  # the load's freed buffers go back to the system, not kept by the allocator

    def _map(self, new: list[dict], skip: int) -> torch.Tensor:
        """Map the ``new`` segments (the first ``skip`` rows of the first one are read already) after the rows
        held; Bool [new rows]: those with a non-finite value (found while verifying, no page kept resident)."""
        mapped = [map_segment(self.folder, s) for s in new]
        parts, bads = [m[0] for m in mapped], [m[1] for m in mapped]
        if skip:  # a segment merged from read rows and new ones: keep the new ones
            parts[0], bads[0] = {key: value[skip:] for key, value in parts[0].items()}, bads[0][skip:]
        held = self._embeds or {}
        self._embeds = {
            key: joined([*([held[key]] if key in held else []), *(p[key] for p in parts)]) for key in parts[0]
        }
        return torch.cat(bads)

    def _load_rows(self, new: list[dict], skip: int, added: int) -> torch.Tensor:
        """Read the ``new`` segments into memory after the rows held; Bool [new rows] of non-finite rows."""
        parts = (read_segment(self.folder, s) for s in new)
        if skip:  # a segment merged from read rows and new ones: keep the new ones
            first = next(parts)
            parts = itertools.chain([{key: value[skip:] for key, value in first.items()}], parts)
        start = len(self) if self._embeds is not None else 0
        if self._embeds is None:
            self._embeds, self._buffer = _concat(parts, added), None
        else:
            self._embeds, self._buffer = _grow(self._buffer or self._embeds, len(self), list(parts))
        return non_finite_rows({k: v[start:] for k, v in self._embeds.items()})

    def _connection(self) -> sqlite3.Connection:
        return self.db

    def _report(self, bad: torch.Tensor, start: int) -> None:
        if bad.any():
            rows = (bad.nonzero().squeeze(1) + start).tolist()
            warnings.warn(
                f"gallery index {self.folder}: {len(rows)} row(s) skipped (unsafe or missing path, or a "
                f"non-finite embedding), never returned: rows {rows[:5]}",
                stacklevel=4,
            )

    def _read_ann(self) -> None:
        header, segments = self.meta, self._segments
        if not (header.get("ann") and any(s.get("ann_file") for s in segments)):
            self._ann_indexes, self._ann_files, self._ann_merged = [], [], False
            return
        if faiss is None:
            raise GalleryIndexError(
                f"gallery index {self.folder} has an approximate index: pip install faiss-cpu"
            )
        files, known = [s["ann_sha256"] for s in segments], self._ann_files
        if self._ann_merged and files[: len(known)] == known:  # grown: merge the new segments' files in
            indexes = [*self._ann_indexes, *(self._faiss(s) for s in segments[len(known) :])]
        else:
            reuse = {} if self._ann_merged else dict(zip(known, self._ann_indexes, strict=False))
            indexes = [reuse.get(s["ann_sha256"]) or self._faiss(s) for s in segments]
        self._ann_indexes, self._ann_merged = merge_ann(indexes)
        self._ann_files, self.crossover = files, None  # new lists: the crossover is measured again
        self.ann_params = dict(header["ann"]["params"])
        for ann_index in self._ann_indexes:
            set_search_params(ann_index, self.ann_params)

    def _faiss(self, segment: dict) -> Any:
        return read_faiss(self.folder / segment["ann_file"], segment["ann_sha256"])

    def _refresh(self) -> None:
        """Take the index's new committed state (after an add: only new segments are read, when used)."""
        header, manifest = _committed(self.folder)
        self.meta = {**header, "num_rows": manifest["num_rows"]}
        self._manifest, self._keys = manifest, None
        self.db.close()  # a rebuilt index has a new database file
        self.db = open_db(self.folder / DATABASE, read_only=True)
        if self._embeds is not None and len(self._segments):
            self._read()

    def check_model(self, model) -> None:
        """Raise ``ModelMismatchError`` unless ``model`` is the model that built the index."""
        built_with = self.meta.get("model_fingerprint")
        current = model_fingerprint(model)
        if built_with is not None and built_with != current:
            raise ModelMismatchError(
                f"gallery index was built with a different model (fingerprint {built_with}, "
                f"model {self.meta.get('model', '?')}) than the one querying it (fingerprint {current})"
            )

    def _filtering(self) -> None:
        """Filtered-search state: cached selections per filter, the generation that keys them, the crossover."""
        self._selections, self._generation = SelectionCache(), 0
        self.crossover: dict[str, Any] | None = None  # ``filtered.measure_crossover`` of the loaded ANN

    def selection(self, filters: SearchFilter | dict | None = None) -> Selection:
        """The rows a search with ``filters`` may return (``mask``), cached per distinct filter until a commit
        or a removal changes them."""
        spec = SearchFilter.of(filters)
        key = selection_key(spec, self._generation, removed_count(self.db))
        return self._selections.get(key, lambda: Selection(self.mask(spec), len(self)))

    def mask(self, filters: SearchFilter | dict | None = None) -> torch.Tensor | None:
        """Bool [N] of the rows a search may return (not removed, not skipped, matching ``filters``); None = all."""
        mask = allowed_mask(self.db, len(self), SearchFilter.of(filters))
        if self.bad is not None and bool(self.bad.any()):
            mask = ~self.bad if mask is None else mask & ~self.bad
        return mask

    def topk(
        self, query: dict[str, torch.Tensor], k: int, chunk_size: int = 16384, filters: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (scores, rows) for normalised query embeddings among the rows ``filters`` allow: exact, or
        ANN candidates re-ranked exactly. Fewer than k columns when fewer rows match."""
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        self._check_query(query)  # reads the segments on first use: ``bad`` rows are known from here on
        chosen = self.selection(filters)
        if not self.ann_indexes or (chosen.mask is not None and chosen.allowed <= self.crossover_rows()):
            return self._exact(query, k, chunk_size, chosen)
        scores, ids = self._ann(query, min(k, chosen.allowed), chosen)
        short = (ids < 0).any(dim=1) | torch.isinf(scores).any(dim=1)
        if short.any():  # the probed lists held fewer than k matches: answer those queries exactly
            rows = {key: value[short] for key, value in query.items()}
            scores[short], ids[short] = chunked_topk(rows, self.store, k, chunk_size, mask=chosen.mask)
        return scores, ids

    def crossover_rows(self) -> int:
        """Kept rows at or below which a filtered search scans them exactly rather than through the ANN:
        measured on this index at its first filtered search (``filtered.measure_crossover``)."""
        return min(self.crossover_plan()["crossover_rows"], EXACT_SUBSET_MAX)

    def crossover_plan(self) -> dict[str, Any]:
        """The measured crossover and its timings (measured once per loaded ANN)."""
        if self.crossover is None:
            self.crossover = self._measure_crossover()
        return self.crossover

    def _measure_crossover(self) -> dict[str, Any]:
        usable = (~self.bad).nonzero().squeeze(1) if self.bad is not None else torch.arange(len(self))
        row = int(usable[0]) if len(usable) else 0
        query = {key: dequantize(self.store, key, slice(row, row + 1)) for key in embedding_keys(self.store)}
        exact = lambda rows: self._exact(query, 10, 16384, Selection(None, len(rows)), rows)  # noqa: E731
        return measure_crossover(len(self), exact, lambda picked: self._ann(query, 10, picked))

    def _exact(self, query, k, chunk_size, chosen: Selection, rows: torch.Tensor | None = None):
        """Exact top-k over the kept rows: gathered when at most ``EXACT_SUBSET_MAX`` (or ``rows`` given),
        else a masked scan of every row."""
        if rows is None and (chosen.mask is None or chosen.allowed > EXACT_SUBSET_MAX):
            return chunked_topk(query, self.store, k, chunk_size, mask=chosen.mask)
        rows = chosen.rows() if rows is None else rows  # few rows: gather them and rank only those
        scores, pos = chunked_topk(
            query, {key: value[rows] for key, value in self.store.items()}, k, chunk_size
        )
        return scores, rows[pos]

    def _ann(self, query, k, chosen: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates from the ANN indexes among the kept rows (nprobe adapted to the kept fraction), re-ranked
        exactly."""
        vectors = ann_vectors(query, self.meta["ann"]["on"])
        wanted = k * int(self.ann_params.get("k_factor", IVF_K_FACTOR))
        fraction = chosen.fraction
        nprobe = lambda ivf: filtered_nprobe(ivf.nprobe, ivf.nlist, fraction)  # noqa: E731
        found = candidates(self.ann_indexes, vectors, wanted, chosen.selector(faiss), nprobe)
        return rerank(query, self.store, found, k)

    def _check_query(self, query: dict[str, torch.Tensor]) -> None:
        for key in ("global", "local"):
            if key in query and key in self.store and query[key].shape[1] != self.store[key].shape[1]:
                raise GalleryIndexError(
                    f"query {key} embeddings have {query[key].shape[1]} dims, the gallery index "
                    f"{self.store[key].shape[1]}: the index was built with another model"
                )
        check_finite(query, list(range(query["global"].shape[0])), "query")

    def view(self, i: int) -> tuple[str | None, float | None]:
        """Predicted view name and its probability for gallery item ``i`` (None without a view router)."""
        probs = self.store.get("view_probs")
        return view_prediction(None if probs is None else probs[i : i + 1], 0)

    def hits(self, scores: torch.Tensor, indices: torch.Tensor) -> list[Hit]:
        """One query's ranked hits (``Hit``): rank, score, row, path, the crop's metadata and the router's view
        prediction with its probability."""
        ids = indices.tolist()
        meta, rels = crop_metadata(self.db, ids), row_paths(self.db, ids)
        out = []
        for rank, (score, i) in enumerate(zip(scores.tolist(), ids, strict=True), start=1):
            predicted, probability = self.view(i)
            path = self._hit_path(i, rels)
            fields = meta.get(i) or decode_metadata({})
            head = {"rank": rank, "score": score, "id": crop_id(rels.get(i, f":{i}")), "index": i}
            head |= {"path": path, "view": fields.pop("view")}
            out.append({**head, "predicted_view": predicted, "predicted_view_score": probability, **fields})
        return out

    def _hit_path(self, row: int, rels: dict[int, str]) -> str | None:
        """The image path of a hit's ``row`` (``rels``: the hits' stored paths, read once for all of them)."""
        paths = self.paths
        if isinstance(paths, RowPaths):
            return paths.full(rels.get(row))
        return paths[row] if paths is not None else None

    def search(
        self, query: dict[str, torch.Tensor], top_k: int = 10, filters: SearchFilter | dict | None = None
    ) -> list[list[Hit]]:
        """Ranked hits for every query row; ``filters`` e.g. ``{"view": "aerial", "camera": "7",
        "after": "2026-01-01T10:00", "before": ..., "tag": ...}`` (exact pre-filtering, see module doc)."""
        scores, indices = self.topk(query, top_k, filters=filters)
        return [self.hits(s, i) for s, i in zip(scores, indices, strict=True)]

    def crop_embeddings(self, ids: Sequence[str]) -> dict[str, torch.Tensor]:
        """The stored TAG-PR Eq. 14 embeddings (``global``, ``local``; float32 [len(ids), d]) of the crops with these hit
        ids, in that order (a query from the gallery itself: no image is read); ``GalleryIndexError`` naming an
        id that no searchable crop has."""
        return self.row_embeddings(self.id_rows(ids))

    def id_rows(self, ids: Sequence[str]) -> list[int]:
        """The rows of the searchable crops with these hit ids, in that order; ``GalleryIndexError`` naming an
        id that no searchable crop has."""
        keys = [parse_crop_id(i) for i in ids]
        self._read_if_needed()
        if self._keys is None:  # one pass over the paths; dropped when the index changes (_refresh, add)
            self._keys = crop_keys(self.db, 0, len(self))
        rows = [self._keys.get(key) for key in keys]
        gone = removed_rows(self.db, [r for r in rows if r is not None])
        for hit_id, row in zip(ids, rows, strict=True):
            if row is None or row in gone or self._skipped(row):
                raise GalleryIndexError(f"no crop with hit id {hit_id} in {self._where()}")
        return rows

    def track_embeddings(self, camera: str | None, track: str) -> dict[str, torch.Tensor]:
        """The stored TAG-PR Eq. 14 embeddings of every searchable crop of ``track`` on ``camera`` (None: crops without
        a camera), in path order; ``GalleryIndexError`` when there is no such track."""
        return self.row_embeddings(self.track_rows(camera, track))

    def track_rows(self, camera: str | None, track: str) -> list[int]:
        """The rows of every searchable crop of ``track`` on ``camera``, in path order; ``GalleryIndexError``
        when there is no such track."""
        self._read_if_needed()
        rows = [row for row in track_rows(self.db, len(self), camera, track) if not self._skipped(row)]
        if not rows:
            raise GalleryIndexError(f"no track {camera or ''}:{track} in {self._where()}")
        return rows

    def _read_if_needed(self) -> None:
        if self._embeds is None:
            self._read()

    def _skipped(self, row: int) -> bool:
        return self.bad is not None and bool(self.bad[row])

    def row_embeddings(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """The stored TAG-PR Eq. 14 embeddings (float32 ``global``, ``local``) of gallery ``rows``, in that order."""
        index = torch.tensor(rows, dtype=torch.long)
        return dequantized(self.store, [key for key in ("global", "local") if key in self.store], index)

    def _where(self) -> str:
        return f"gallery index {self.folder}" if self.folder else "the gallery"

    def count(self) -> int:
        """Crops a search can return: rows not removed nor skipped (reads the segments on first use)."""
        if self._embeds is None:
            self._read()
        mask = self.mask()
        return len(self) if mask is None else int(mask.sum())

    def describe(self) -> dict[str, Any]:
        """Backend, location, model, fingerprint, image root, rows, searchable crops and, with an ANN, the
        filtered-search crossover (kept rows at or below which a filter is scanned exactly)."""
        filtered = None
        if self.ann_indexes:
            filtered = {
                **self.crossover_plan(),
                "exact_gather_max": EXACT_SUBSET_MAX,
                "nprobe_rule": f"nprobe / kept_fraction ** {FILTER_PROBE_POWER} (at most every list)",
            }
        return {
            "backend": "embedded",
            "location": str(self.folder) if self.folder else None,
            "model": self.meta.get("model"),
            "model_fingerprint": self.fingerprint,
            "image_root": str(self.root) if self.root else None,
            "rows": len(self),
            "searchable": self.count(),
            "filtered_search": filtered,
        }

    def close(self) -> None:
        """Close the crop database (a cached index is dropped from the cache: the next load opens it again)."""
        for key in [key for key, (_, index) in _CACHE.items() if index is self]:
            del _CACHE[key]
        self.db.close()

    def remove(self, paths: Sequence[str] = (), ids: Sequence[int] = ()) -> int:
        """Remove crops (paths relative to the image root or absolute under it, or row ids) from search
        results at once and for good (a flag in the crop database); returns how many were removed."""
        root = (self.root or Path(self.meta.get("image_root", ""))).resolve()
        rels = []
        for p in paths:
            try:
                rels.append(
                    Path(p).resolve().relative_to(root).as_posix() if Path(p).is_absolute() else str(p)
                )
            except ValueError as error:
                raise GalleryIndexError(f"{p} is not under the index's image root {root}") from error
        known = lambda rel: self.db.execute("SELECT 1 FROM crops WHERE path = ?", (rel,)).fetchone()  # noqa: E731
        missing = [rel for rel in rels if not known(rel)] + [i for i in ids if not 0 <= int(i) < len(self)]
        if missing:
            raise GalleryIndexError(f"not in the gallery index: {missing[:5]}")
        if self.folder is None:
            return mark_removed(self.db, rels, ids)
        try:  # the writer; searches keep their read-only connection
            db = open_db(self.folder / DATABASE)
            try:
                return mark_removed(db, rels, ids)
            finally:
                db.close()
        except sqlite3.Error as error:
            raise GalleryIndexError(
                f"cannot record the removal in {self.folder / DATABASE}: {error}"
            ) from error

    def add(
        self,
        embeds: dict[str, torch.Tensor],
        paths: Sequence[str],
        records: Sequence[dict[str, Any] | None] | None = None,
    ) -> int:
        """Append encoded crops (``paths`` relative to the image root; ``records``: view, camera, timestamp,
        tags), all or nothing; a loaded index commits them as a new segment (the commit of ``--add``)."""
        rels = [Path(p).as_posix() for p in paths]
        if records is not None and len(records) != len(rels):
            raise ValueError(f"{len(rels)} paths but {len(records)} records")
        metadata = {rel: dict(r) for rel, r in zip(rels, records or [None] * len(rels), strict=True) if r}
        if self.folder is not None:
            from .index_commit import append_embeddings

            append_embeddings(self.folder, embeds, rels, metadata)
            self._refresh()
            return len(rels)
        check_embeddings(embeds, rels)
        bad = [rel for rel in rels if unsafe_name(rel)]
        if bad:
            raise GalleryIndexError(f"image path {bad[0]!r} cannot be stored: {unsafe_name(bad[0])}")
        if set(embeds) != set(self._embeds):
            raise GalleryIndexError(
                f"embeddings have keys {sorted(embeds)}, the gallery {sorted(self._embeds)}"
            )
        start = len(self)
        probs = embeds.get("view_probs")
        crops = [
            metadata_row(rel, metadata.get(rel), view_prediction(probs, i)[0]) for i, rel in enumerate(rels)
        ]
        insert_crops(self.db, start, crops)
        self._generation += 1
        self._keys = None
        rows = {k: v.to(self._embeds[k].dtype) for k, v in embeds.items()}
        self._embeds, self._buffer = _grow(self._buffer or self._embeds, start, [rows])
        self._paths = None if self._paths is None else self._paths + rels
        return len(rels)

    def image_file(self, path: str | None, where: str = "hit") -> Path | None:
        """``image_file(path, self.root, where)``: a hit's file to open, None for no image."""
        return image_file(path, self.root, where)


def image_file(path: str | None, root: str | os.PathLike | None, where: str = "hit") -> Path | None:
    """A hit's image file to open, checked by ``crop_file`` (``GalleryIndexError`` naming ``where`` when it
    leaves the gallery root: a tampered root such as ``/``, a ``..`` path, a link out of the root); None when it
    is no regular image file (a name without an image extension, a missing file: a blank tile)."""
    if not path or not root:
        return None
    try:
        rel = Path(path).relative_to(root).as_posix()
    except ValueError:
        raise GalleryIndexError(
            f"{where}: crop path {path!r} refused: it is not under the image root {root}"
        ) from None
    target = crop_file(root, rel, where)
    if target.suffix.lower() not in IMAGE_EXTENSIONS or not target.is_file():
        return None
    return target


def _leaves(segments: list[dict]) -> list[str]:
    """The checksums of the segments as first committed, in row order (a merged segment lists its parts')."""
    return [sha for s in segments for sha in s.get("merged_from", [s["sha256"]])]


def _unread(read: list[dict], committed: list[dict], rows_read: int) -> tuple[list[dict], int] | None:
    """The committed segments holding rows past the ``rows_read`` of the ``read`` ones, and how many leading
    rows of the first of them are read already (it may be a merge of read and new rows); None when the
    committed rows do not start with the read ones (a rebuilt index)."""
    known = _leaves(read)
    if _leaves(committed)[: len(known)] != known:
        return None
    new = [s for s in committed if s["start"] + s["rows"] > rows_read]
    return new, (rows_read - new[0]["start"] if new else 0)


def _committed(path: Path) -> tuple[dict, dict]:
    """(header, manifest) of a committed index; ``IncompleteIndexError`` before its first build finished."""
    header = read_header(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise IncompleteIndexError(
            f"gallery index {path} is incomplete (its first build has not finished); building it again with "
            "the same arguments resumes it"
        )
    return header, manifest


__all__ += ["VIEW_NAMES"]
