"""Gallery index for TAG-CLIP text-to-person search: load a built index, filter, search exactly or approximately.

The on-disk layout (header, manifest of checksummed segments, SQLite crop metadata) is in ``index_store``;
building, resuming, ``--add`` and multi-process encoding in ``index_build``. Exact search ranks with Eq. 14
gallery chunk by gallery chunk, so a [queries, N] matrix is never materialised. With an approximate index
(``ann="ivf"``, see ``ANN_PRESETS``) a faiss PCA + IVF-PQ index per segment over ``ann_vectors`` (by default
the combined ``sqrt(1/2) [global, TSE]`` vector, whose inner product is the Eq. 14 score) proposes
``k_factor x k`` candidates per query, re-ranked exactly from the stored vectors (fp16 by default for ANN
indexes): serving holds the stored vectors and the PQ codes, no second fp32 copy. Filters (view, camera,
time window, tag; removed crops) select rows before ranking: a boolean row mask in exact search, a faiss
``IDSelectorBitmap`` in the ANN search, exact search over the selected rows when they are few
(``EXACT_SUBSET_MAX``); never over-fetch-and-drop.

Hub custom-code compatible (shipped beside ``pipeline_tagclip.py``): only the standard library, torch,
safetensors, PIL and tqdm are imported; faiss is optional.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from .encode import encode_images, encode_texts, eq14_similarity, view_prediction
from .index_store import (
    DATABASE,
    INDEX_FORMAT,
    INDEX_VERSION,
    VIEW_NAMES,
    GalleryIndexError,
    SearchFilter,
    allowed_mask,
    insert_crops,
    mark_removed,
    metadata_row,
    open_db,
    read_header,
    read_manifest,
    read_tensors,
    safe_relative,
    sha256_file,
)

try:  # optional: approximate search through faiss
    import faiss
except ImportError:  # pragma: no cover - depends on the environment
    faiss = None

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

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "auto_map",
    "custom_pipelines",
    "architectures",
    "dtype",
    "torch_dtype",
    "_commit_hash",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "attn_implementation",
}

# Approximate index presets (``{dim}``: the ANN vectors' width); candidates are re-ranked exactly (Eq. 14).
ANN_PRESETS = {
    "ivf": "PCA{p},IVF{nlist},PQ{p}x4fsr: the ANN vectors' p = min(128, dim) principal components, ~4 sqrt(N) "
    "lists, one 4-bit PQ FastScan code per component (p/2 bytes a crop), nprobe = lists / 2, exact Eq. 14 "
    "re-ranking of 80 k candidates from the stored vectors",
    "ivf-full": "IVF{nlist},PQ{m}x4fsr: no PCA, m = dim/4 sub-vectors over the combined global + TSE vector "
    "(dim/2 over the global one): 3x the bytes scanned of 'ivf' at 1536-d for the same recall on "
    "bench_search.py's generator; for embeddings whose neighbours need more than 128 components",
}
ANN_VECTORS = {"global": 2, "combined": 4}  # what the ANN indexes -> dims per 4-bit PQ code of "ivf-full"
PCA_DIMS = 128  # "ivf" preset: principal components kept (bench_search.py: recall@10 0.99 vs exact at 128)
# Tuned on held-out queries of bench_search.py's generator (results/search_cpu*.json): the cheapest setting
# reaching recall@10 >= 0.95 vs exact. Real embeddings may allow fewer lists: --ann-param nprobe=...
IVF_PROBE_DIVISOR = 2  # both presets: nprobe = lists / 2
IVF_K_FACTOR = 80  # re-rank 80 k candidates exactly (at 1M cheaper than probing more lists)
ANN_ON = "combined"  # default vectors of the ANN (bench_search.py: global-only candidates missed 0.95 recall)
ANN_MIN_SIZE = 2048  # smaller galleries keep exact search (the ANN is not built; build_index warns)
EXACT_SUBSET_MAX = 65536  # filters selecting at most this many rows are searched exactly over those rows
OWN_PARAMS = {"k_factor"}  # search parameters handled here, not by faiss
read_meta = read_header


def list_images(folder: str | os.PathLike) -> list[Path]:
    """Image files under ``folder`` (recursive), sorted by their relative path, skipping hidden files and folders
    (``.name``: macOS ``._x.jpg`` resource forks, thumbnail caches); error if there are none."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    visible = lambda p: not any(part.startswith(".") for part in p.relative_to(root).parts)  # noqa: E731
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and visible(p)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(
            f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root} (hidden files and folders are skipped)"
        )
    return files


def _strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_volatile(v) for k, v in sorted(value.items()) if k not in _VOLATILE_CONFIG_KEYS}
    return value


def model_fingerprint(model) -> str:
    """Short hash of the model config and a strided sample of every weight: same model ⇔ same fingerprint."""
    digest = hashlib.sha256()
    config = _strip_volatile(model.config.to_dict())
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        sample = flat[::step][:64].to("cpu", torch.float32)
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Segments' tensors joined per key, each part freed as it is copied (one segment: no copy at all)."""
    if len(parts) <= 1:
        return parts[0] if parts else {}
    out = {
        key: value.new_empty((sum(p[key].shape[0] for p in parts), *value.shape[1:]))
        for key, value in parts[0].items()
    }
    start = 0
    while parts:
        part = parts.pop(0)
        size = next(iter(part.values())).shape[0]
        for key, value in part.items():
            out[key][start : start + size] = value
        start += size
    return out


def check_finite(
    rows: dict[str, torch.Tensor], names: Sequence[Any], what: str = "image", first: int = 0
) -> None:
    """``ValueError`` naming the first row (numbered from ``first``, and its image) with a NaN/inf embedding."""
    for key, value in rows.items():
        bad = ~torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)
        if bad.any():
            row = int(bad.nonzero()[0])
            raise ValueError(
                f"non-finite (NaN/inf) {key} embedding for {what} {first + row} ({names[row]}): "
                f"{int(bad.sum())} such rows; check the model weights and the input"
            )


# ---------------------------------------------------------------------------------------------------------
# Exact search
# ---------------------------------------------------------------------------------------------------------


def _scores(query: dict[str, torch.Tensor], gallery: dict[str, torch.Tensor], rows: Any) -> torch.Tensor:
    """Eq. 14 scores of the queries against gallery ``rows`` (a slice or an index tensor), in float32."""
    local = gallery["local"][rows].float() if "local" in gallery and "local" in query else None
    return eq14_similarity(query["global"], gallery["global"][rows].float(), query.get("local"), local)


def chunked_topk(
    query: dict[str, torch.Tensor],
    gallery: dict[str, torch.Tensor],
    k: int,
    chunk_size: int = 16384,
    query_chunk: int = 256,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` Eq. 14 scores and gallery rows [n_queries, k'] among the rows ``mask`` allows (all
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
    """Exact Eq. 14 top-``k`` among each query's candidate rows [n_queries, C] (-1 = no candidate)."""
    scores = torch.full(candidates.shape, -math.inf)
    for q in range(candidates.shape[0]):  # one small gather + matmul per query: C x D, never N x D
        valid = candidates[q] >= 0
        one = {key: value[q : q + 1] for key, value in query.items()}
        scores[q, valid] = _scores(one, gallery, candidates[q, valid])[0]
    best, pos = scores.topk(min(k, scores.shape[1]), dim=1)
    return best, candidates.gather(1, pos)


# ---------------------------------------------------------------------------------------------------------
# Approximate (faiss) index specification
# ---------------------------------------------------------------------------------------------------------


def ivf_lists(size: int) -> int:
    """IVF lists for ``size`` vectors: the power of two nearest 4 sqrt(N), with >= 64 vectors per list."""
    target = max(1.0, min(4 * math.sqrt(size), size / 64))
    return 2 ** max(0, round(math.log2(target)))


def pq_subquantizers(dim: int, dims_per_code: int = 2) -> int:
    """PQ sub-vectors: one per ``dims_per_code`` dims (256 for 512-d and 2); the largest divisor of ``dim``
    not above that."""
    return next(m for m in range(max(1, dim // dims_per_code), 0, -1) if dim % m == 0)


def ann_vectors(embeds: dict[str, torch.Tensor], on: str) -> torch.Tensor:
    """float32 vectors an ANN index holds: the global embedding, or ``sqrt(1/2) [global, local]`` whose inner
    product is the Eq. 14 score (global alone without TSE)."""
    if on not in ANN_VECTORS:
        raise GalleryIndexError(f"ANN vectors must be one of {sorted(ANN_VECTORS)}, got {on!r}")
    if on == "global" or "local" not in embeds:
        return embeds["global"].float().contiguous()
    return torch.cat([embeds["global"].float(), embeds["local"].float()], dim=1) * math.sqrt(0.5)


def ann_spec(
    ann: str, size: int, dim: int, params: dict[str, float] | None = None, on: str = ANN_ON
) -> dict[str, Any]:
    """``{"factory", "params", "on"}`` of an ANN preset (``ANN_PRESETS``) or a faiss index_factory string over
    ``dim``-d ``ann_vectors(.., on)``. ``params``: faiss ``ParameterSpace`` names (``nprobe``, ``efSearch``)
    and ``k_factor`` (candidates re-ranked exactly per hit, default ``IVF_K_FACTOR``)."""
    if faiss is None:
        raise GalleryIndexError("an approximate (ANN) index needs faiss: pip install faiss-cpu")
    if on not in ANN_VECTORS:
        raise GalleryIndexError(f"ANN vectors must be one of {sorted(ANN_VECTORS)}, got {on!r}")
    if ann in ANN_PRESETS:
        nlist = ivf_lists(size)
        pca, full = min(PCA_DIMS, dim), pq_subquantizers(dim, ANN_VECTORS[on])
        codes = f"PCA{pca},IVF{nlist},PQ{pca}x4fsr" if ann == "ivf" else f"IVF{nlist},PQ{full}x4fsr"
        spec = {"factory": codes, "params": {"nprobe": max(1, nlist // IVF_PROBE_DIVISOR)}}
    else:
        try:
            faiss.index_factory(dim, ann, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            presets = ", ".join(ANN_PRESETS)
            raise GalleryIndexError(
                f"unknown ANN index {ann!r}: use a preset ({presets}) or a faiss index_factory string"
            ) from error
        spec = {"factory": ann, "params": {}}
    spec["params"] = {"k_factor": IVF_K_FACTOR, **spec["params"], **(params or {})}
    for name, value in spec["params"].items():
        if not math.isfinite(float(value)) or float(value) <= 0:
            raise GalleryIndexError(f"ANN parameter {name} must be a positive number, got {value}")
    spec["params"] = {name: int(value) if float(value).is_integer() else float(value)
                      for name, value in spec["params"].items()}  # fmt: skip
    _set_search_params(faiss.index_factory(dim, spec["factory"], faiss.METRIC_INNER_PRODUCT), spec["params"])
    return {**spec, "on": on}


def _set_search_params(index: Any, params: dict[str, float]) -> None:
    space = faiss.ParameterSpace()
    for name, value in params.items():
        if name in OWN_PARAMS:
            continue
        try:
            space.set_index_parameter(index, name, value)
        except RuntimeError as error:
            raise GalleryIndexError(
                f"faiss index {type(index).__name__} has no parameter {name!r}"
            ) from error
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:  # an IVF-PQ FastScan index probing more lists than it has returns wrong neighbours
        ivf.nprobe = min(ivf.nprobe, ivf.nlist)


def _search_params(index: Any, selector: Any) -> Any:
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return faiss.SearchParametersIVF(sel=selector, nprobe=ivf.nprobe)
    return faiss.SearchParameters(sel=selector)


def read_faiss(path: Path, sha256: str) -> Any:
    """A faiss index file after checking its checksum."""
    if not path.is_file() or sha256_file(path) != sha256:
        raise GalleryIndexError(f"gallery index file {path} is missing or corrupt (checksum mismatch)")
    return faiss.read_index(str(path))


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
    """Encoded gallery: embeddings, router view probabilities, image paths and per-crop metadata (SQLite)."""

    def __init__(
        self,
        embeds: dict[str, torch.Tensor],
        paths: Sequence[str] | None = None,
        meta: dict | None = None,
        db: sqlite3.Connection | None = None,
    ):
        if "global" not in embeds:
            raise GalleryIndexError("gallery embeddings need a 'global' tensor")
        self.embeds = embeds
        self.paths = list(paths) if paths is not None else None
        self.meta = dict(meta or {})
        self.ann_indexes: list[Any] = []
        self.ann_params: dict[str, float] = {}
        if self.paths is not None and len(self.paths) != len(self):
            raise GalleryIndexError(f"{len(self.paths)} paths for {len(self)} embeddings")
        self.db = db if db is not None else self._memory_db()

    def __len__(self) -> int:
        return self.embeds["global"].shape[0]

    def _memory_db(self) -> sqlite3.Connection:
        db = open_db(":memory:")
        names = self.paths or [f":{i}" for i in range(len(self))]
        views = [view_prediction(self.embeds.get("view_probs"), i)[0] for i in range(len(self))]
        insert_crops(db, 0, [metadata_row(p, None, v) for p, v in zip(names, views, strict=True)])
        return db

    @property
    def faiss_index(self) -> Any:
        """The approximate index of the first segment (None for exact search)."""
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
    ) -> GalleryIndex:
        """Load an index directory written by ``index_build.build_index``, verifying every checksum.

        With ``cache``, an index already loaded from ``path`` and unchanged on disk since is returned
        as is (a server or pipeline reloads nothing between queries; removals apply immediately).
        Image paths must stay inside the image root unless ``allow_outside_root``.
        """
        path = Path(path).resolve()
        key = (str(path), str(image_root), allow_outside_root)
        state = _state(path)
        if cache and key in _CACHE and _CACHE[key][0] == state:
            return _CACHE[key][1]
        index = cls._load(path, image_root, allow_outside_root)
        if cache:
            _CACHE[key] = (state, index)
        return index

    @classmethod
    def _load(cls, path: Path, image_root: Any, allow_outside_root: bool) -> GalleryIndex:
        header = read_header(path)
        manifest = read_manifest(path)
        if manifest is None:
            raise GalleryIndexError(
                f"gallery index {path} is incomplete (its first build has not finished); run `tagclip index` "
                "again with the same arguments to resume it"
            )
        segments = manifest["segments"]
        parts = [read_tensors(path / s["file"], s["sha256"], s["rows"]) for s in segments]
        embeds = _concat(parts)
        db = open_db(path / DATABASE)
        rows = db.execute("SELECT id, path FROM crops WHERE id < ? ORDER BY id", (manifest["num_rows"],))
        rels = [rel for _, rel in rows]
        if len(rels) != manifest["num_rows"]:
            raise GalleryIndexError(
                f"gallery index {path}: {DATABASE} lists {len(rels)} crops for {manifest['num_rows']} rows"
            )
        root = Path(image_root) if image_root is not None else Path(header["image_root"])
        where = f"gallery index {path}"
        paths = [str(root / (rel if allow_outside_root else safe_relative(rel, where))) for rel in rels]
        index = cls(embeds, paths, {**header, "num_rows": manifest["num_rows"]}, db)
        if header.get("ann") and any(s.get("ann_file") for s in segments):
            if faiss is None:
                raise GalleryIndexError(f"{where} has an approximate index: pip install faiss-cpu")
            index.ann_indexes = [read_faiss(path / s["ann_file"], s["ann_sha256"]) for s in segments]
            index.ann_params = dict(header["ann"]["params"])
            for ann_index in index.ann_indexes:
                _set_search_params(ann_index, index.ann_params)
        return index

    def check_model(self, model) -> None:
        """Raise ``GalleryIndexError`` unless ``model`` is the model that built the index."""
        built_with = self.meta.get("model_fingerprint")
        current = model_fingerprint(model)
        if built_with is not None and built_with != current:
            raise GalleryIndexError(
                f"gallery index was built with a different model (fingerprint {built_with}, "
                f"model {self.meta.get('model', '?')}) than the one querying it (fingerprint {current}); "
                "rebuild it with `tagclip index --model <this model> --overwrite`"
            )

    def mask(self, filters: SearchFilter | dict | None = None) -> torch.Tensor | None:
        """Bool [N] of the rows a search may return (not removed, matching ``filters``); None = all."""
        return allowed_mask(self.db, len(self), SearchFilter.of(filters))

    def topk(
        self, query: dict[str, torch.Tensor], k: int, chunk_size: int = 16384, filters: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (scores, rows) for normalised query embeddings among the rows ``filters`` allow: exact, or
        ANN candidates re-ranked exactly. Fewer than k columns when fewer rows match."""
        if k < 1:
            raise ValueError(f"top_k must be >= 1, got {k}")
        self._check_query(query)
        mask = self.mask(filters)
        allowed = len(self) if mask is None else int(mask.sum())
        if not self.ann_indexes or (mask is not None and allowed <= EXACT_SUBSET_MAX):
            return self._exact(query, k, chunk_size, mask, allowed)
        scores, ids = self._ann(query, min(k, allowed), mask)
        short = (ids < 0).any(dim=1) | torch.isinf(scores).any(dim=1)
        if short.any():  # the probed lists held fewer than k matches: answer those queries exactly
            rows = {key: value[short] for key, value in query.items()}
            scores[short], ids[short] = chunked_topk(rows, self.embeds, k, chunk_size, mask=mask)
        return scores, ids

    def _exact(self, query, k, chunk_size, mask, allowed) -> tuple[torch.Tensor, torch.Tensor]:
        if mask is None or allowed > EXACT_SUBSET_MAX:
            return chunked_topk(query, self.embeds, k, chunk_size, mask=mask)
        rows = mask.nonzero().squeeze(1)  # few rows: gather them and rank only those
        scores, pos = chunked_topk(
            query, {key: value[rows] for key, value in self.embeds.items()}, k, chunk_size
        )
        return scores, rows[pos]

    def _ann(self, query, k, mask) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np

        selector, bitmap = None, None
        if mask is not None:
            bitmap = np.packbits(mask.numpy(), bitorder="little")
            selector = faiss.IDSelectorBitmap(len(bitmap), faiss.swig_ptr(bitmap))
        vectors = ann_vectors(query, self.meta["ann"]["on"]).numpy()
        wanted = k * int(self.ann_params.get("k_factor", IVF_K_FACTOR))
        found = [ann.search(vectors, min(wanted, ann.ntotal), params=_search_params(ann, selector))[1]
                 for ann in self.ann_indexes if ann.ntotal]  # fmt: skip
        del bitmap  # the selector read it during the searches
        return rerank(query, self.embeds, torch.from_numpy(np.concatenate(found, axis=1)).long(), k)

    def _check_query(self, query: dict[str, torch.Tensor]) -> None:
        for key in ("global", "local"):
            if key in query and key in self.embeds and query[key].shape[1] != self.embeds[key].shape[1]:
                raise GalleryIndexError(
                    f"query {key} embeddings have {query[key].shape[1]} dims, the gallery index "
                    f"{self.embeds[key].shape[1]}: the index was built with another model"
                )
        check_finite(query, list(range(query["global"].shape[0])), "query")

    def view(self, i: int) -> tuple[str | None, float | None]:
        """Predicted view name and its probability for gallery item ``i`` (None without a view router)."""
        return view_prediction(self.embeds.get("view_probs"), i)

    def hits(self, scores: torch.Tensor, indices: torch.Tensor) -> list[dict[str, Any]]:
        """One query's ranked hits: rank, score, index, path, predicted view and its probability, and the
        crop's metadata (camera, timestamp, tags; None where unknown)."""
        ids = indices.tolist()
        sql = f"SELECT id, camera, timestamp, tags FROM crops WHERE id IN ({', '.join('?' * len(ids))})"
        meta = {row[0]: row[1:] for row in self.db.execute(sql, ids)} if ids else {}
        out = []
        for rank, (score, i) in enumerate(zip(scores.tolist(), ids, strict=True), start=1):
            view, view_score = self.view(i)
            camera, timestamp, tags = meta.get(i, (None, None, None))
            out.append(
                {
                    "rank": rank,
                    "score": score,
                    "index": i,
                    "path": self.paths[i] if self.paths is not None else None,
                    "view": view,
                    "view_score": view_score,
                    "camera": camera,
                    "timestamp": timestamp,
                    "tags": json.loads(tags) if tags else None,
                }
            )
        return out

    def search(
        self, query: dict[str, torch.Tensor], top_k: int = 10, filters: SearchFilter | dict | None = None
    ) -> list[list[dict[str, Any]]]:
        """Ranked hits for every query row; ``filters`` e.g. ``{"view": "aerial", "camera": "7",
        "after": "2026-01-01T10:00", "before": ..., "tag": ...}`` (exact pre-filtering, see module doc)."""
        scores, indices = self.topk(query, top_k, filters=filters)
        return [self.hits(s, i) for s, i in zip(scores, indices, strict=True)]

    def remove(self, paths: Sequence[str] = (), ids: Sequence[int] = ()) -> int:
        """Remove crops (paths relative to the image root or absolute under it, or row ids) from search
        results at once and for good (a flag in the crop database); returns how many were removed."""
        root = Path(self.meta.get("image_root", "")).resolve()
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
        return mark_removed(self.db, rels, ids)


__all__ += ["VIEW_NAMES"]
