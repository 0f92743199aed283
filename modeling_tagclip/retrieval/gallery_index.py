"""Gallery index for TAG-CLIP text-to-person search: batched encoding, a resumable on-disk index, exact search.

An index directory holds ``index.json`` (format, model fingerprint, image paths, progress) and
``embeddings.safetensors`` (L2-normalised global ``global`` [N, D], TSE ``local`` [N, D'] and router view
probabilities ``view_probs`` [N, 2], 0 = aerial, 1 = ground). While it is being built the rows live in
``shards/``; an interrupted build resumes from the last complete shard. Search ranks with Eq. 14 exactly,
gallery chunk by gallery chunk, so a [queries, N] matrix is never materialised; with faiss installed an exact
inner-product faiss index over ``sqrt(1/2) [global, local]`` (the same Eq. 14 score) is written and used.
``build_index(..., ann="ivf")`` writes an approximate index instead (see ``ANN_PRESETS``): IVF lists scanned
with 4-bit PQ FastScan, then re-ranked exactly; its search parameters are kept in ``index.json``.

Hub custom-code compatible (shipped beside ``pipeline_tagclip.py``): only the standard library, torch,
safetensors, PIL and tqdm are imported; faiss is optional.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors.torch import load_file, save_file

try:  # optional: exact inner-product search through faiss
    import faiss
except ImportError:  # pragma: no cover - depends on the environment
    faiss = None

__all__ = [
    "ANN_PRESETS",
    "IMAGE_EXTENSIONS",
    "GalleryIndex",
    "GalleryIndexError",
    "ann_spec",
    "build_faiss_index",
    "build_index",
    "chunked_topk",
    "encode_images",
    "encode_texts",
    "list_images",
    "model_fingerprint",
]

INDEX_FORMAT = "tagclip-gallery-index"
INDEX_VERSION = 1
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
VIEW_NAMES = ("aerial", "ground")
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


class GalleryIndexError(ValueError):
    """A missing, incomplete, corrupt or mismatched gallery index."""


# Approximate (faiss) index presets: name -> description. "ivf" met <= 20 ms/query at recall@10 >= 0.95 vs
# exact over 1M 512-d vectors on 1 CPU thread (benchmarks/bench_search.py, results/search_cpu.json).
ANN_PRESETS = {
    "ivf": "IVF{nlist},PQ{dim/2}x4fsr,RFlat: ~4 sqrt(N) lists, 4-bit PQ FastScan codes of 2-d sub-vectors "
    "(dim / 2 bytes per vector), nprobe = lists / 4, exact re-ranking of 30 k candidates",
}
IVF_PROBE_DIVISOR = 4  # "ivf" preset: nprobe = lists / 4
IVF_K_FACTOR = 30  # "ivf" preset: re-rank 30 k candidates exactly
ANN_MIN_SIZE = 2048  # smaller galleries get the exact index: it is fast there and IVF/PQ training needs data


# ---------------------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------------------


def list_images(folder: str | os.PathLike) -> list[Path]:
    """Image files under ``folder`` (recursive), sorted by their relative path; error if there are none."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
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


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1)


def _load_rgb(image: Image.Image | str | os.PathLike) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    try:
        with Image.open(image) as img:
            return img.convert("RGB")
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read image {image}: {error}") from error


def view_probabilities(view_logits: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """Router view probabilities [B, 2] (0 aerial, 1 ground): softmax per MoE block, averaged over blocks."""
    if not view_logits:
        return None
    return torch.stack([v.float().softmax(-1) for v in view_logits]).mean(0)


def _progress(iterable: Iterable, total: int, desc: str, enabled: bool) -> Iterable:
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="batch")


@torch.inference_mode()
def encode_image_batch(model, processor, images: Sequence[Image.Image | str | os.PathLike]) -> dict:
    """Normalised ``global``/``local`` embeddings and ``view_probs`` (CPU, float32) of one batch of images."""
    inputs = processor(images=[_load_rgb(image) for image in images])
    out = model.get_image_features(pixel_values=inputs["pixel_values"].to(_device(model)))
    rows = {"global": _normalize(out.pooler_output).cpu()}
    if out.local_embeds is not None:
        rows["local"] = _normalize(out.local_embeds).cpu()
    probs = view_probabilities(out.view_logits)
    if probs is not None:
        rows["view_probs"] = probs.cpu()
    return rows


def _concat(parts: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]} if parts else {}


def encode_images(
    model,
    processor,
    images: Sequence[Image.Image | str | os.PathLike],
    batch_size: int = 32,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Encode images (PIL or paths) in batches → dict of ``global``, ``local``, ``view_probs`` tensors."""
    if not images:
        raise ValueError("the gallery is empty: no images to encode")
    starts = range(0, len(images), batch_size)
    parts = [
        encode_image_batch(model, processor, images[s : s + batch_size])
        for s in _progress(starts, len(starts), "encoding images", progress)
    ]
    return _concat(parts)


@torch.inference_mode()
def encode_texts(
    model, processor, texts: str | Sequence[str], batch_size: int = 64
) -> dict[str, torch.Tensor]:
    """Normalised ``global`` and ``local`` text embeddings (CPU, float32) of query texts."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("no query text given")
    parts = []
    for start in range(0, len(texts), batch_size):
        inputs = processor(text=texts[start : start + batch_size])
        out = model.get_text_features(input_ids=inputs["input_ids"].to(_device(model)))
        part = {"global": _normalize(out.pooler_output).cpu()}
        if out.local_embeds is not None:
            part["local"] = _normalize(out.local_embeds).cpu()
        parts.append(part)
    return _concat(parts)


# ---------------------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------------------


def _chunk_scores(query: dict, gallery: dict, start: int, stop: int) -> torch.Tensor:
    """Eq. 14 scores of the queries against gallery rows [start, stop)."""
    scores = query["global"] @ gallery["global"][start:stop].t()
    if "local" in query and "local" in gallery:
        scores = 0.5 * (scores + query["local"] @ gallery["local"][start:stop].t())
    return scores


def chunked_topk(
    query: dict[str, torch.Tensor],
    gallery: dict[str, torch.Tensor],
    k: int,
    chunk_size: int = 16384,
    query_chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` Eq. 14 scores and gallery indices [n_queries, k], at most query_chunk × chunk_size at once."""
    size = gallery["global"].shape[0]
    k = min(k, size)
    all_scores, all_indices = [], []
    for q0 in range(0, query["global"].shape[0], query_chunk):
        part = {key: value[q0 : q0 + query_chunk] for key, value in query.items()}
        best_s = torch.empty(part["global"].shape[0], 0)
        best_i = torch.empty(part["global"].shape[0], 0, dtype=torch.long)
        for start in range(0, size, chunk_size):
            stop = min(start + chunk_size, size)
            scores = torch.cat([best_s, _chunk_scores(part, gallery, start, stop)], dim=1)
            ids = torch.cat([best_i, torch.arange(start, stop).expand(scores.shape[0], -1)], dim=1)
            best_s, pos = scores.topk(min(k, scores.shape[1]), dim=1)
            best_i = ids.gather(1, pos)
        all_scores.append(best_s)
        all_indices.append(best_i)
    return torch.cat(all_scores), torch.cat(all_indices)


def combined_vectors(embeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sqrt(1/2) [global, local]``: their inner product is the Eq. 14 score (global alone without TSE)."""
    if "local" not in embeds:
        return embeds["global"]
    return torch.cat([embeds["global"], embeds["local"]], dim=1) * math.sqrt(0.5)


# ---------------------------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------------------------


class GalleryIndex:
    """Encoded gallery: normalised embeddings, router view probabilities, image paths and metadata."""

    def __init__(
        self, embeds: dict[str, torch.Tensor], paths: Sequence[str] | None = None, meta: dict | None = None
    ):
        if "global" not in embeds:
            raise GalleryIndexError("gallery embeddings need a 'global' tensor")
        self.embeds = embeds
        self.paths = list(paths) if paths is not None else None
        self.meta = dict(meta or {})
        self.faiss_index = None
        if self.paths is not None and len(self.paths) != len(self):
            raise GalleryIndexError(f"{len(self.paths)} paths for {len(self)} embeddings")

    def __len__(self) -> int:
        return self.embeds["global"].shape[0]

    @classmethod
    def from_images(
        cls, model, processor, images: Sequence, batch_size: int = 32, progress: bool = False
    ) -> GalleryIndex:
        """Encode a list of PIL images or paths in memory."""
        paths = [str(image) if not isinstance(image, Image.Image) else None for image in images]
        embeds = encode_images(model, processor, images, batch_size, progress)
        meta = {"model_fingerprint": model_fingerprint(model)}
        return cls(embeds, paths if all(p is not None for p in paths) else None, meta)

    @classmethod
    def from_folder(
        cls, model, processor, folder: str | os.PathLike, batch_size: int = 32, progress: bool = False
    ):
        """Encode every image under ``folder`` in memory."""
        return cls.from_images(model, processor, list_images(folder), batch_size, progress)

    @classmethod
    def load(cls, path: str | os.PathLike, image_root: str | os.PathLike | None = None) -> GalleryIndex:
        """Load a complete index directory written by ``build_index``."""
        path = Path(path)
        meta = read_meta(path)
        if not meta.get("complete"):
            raise GalleryIndexError(
                f"gallery index {path} is incomplete ({meta.get('num_done', 0)} of {meta['num_images']} images "
                "encoded); run `tagclip index` again with the same arguments to resume it"
            )
        tensors = path / "embeddings.safetensors"
        if not tensors.is_file():
            raise GalleryIndexError(f"gallery index {path} lacks embeddings.safetensors; rebuild it")
        root = Path(image_root) if image_root is not None else Path(meta["image_root"])
        index = cls(load_file(str(tensors)), [str(root / rel) for rel in meta["paths"]], meta)
        if faiss is not None and (path / "faiss.index").is_file():
            index.faiss_index = faiss.read_index(str(path / "faiss.index"))
            _set_search_params(index.faiss_index, (meta.get("ann") or {}).get("params", {}))
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

    def topk(
        self, query: dict[str, torch.Tensor], k: int, chunk_size: int = 16384
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (scores, indices) for normalised query embeddings: exact unless an ANN index was built.

        Query rows for which the ANN index finds fewer than ``k`` hits are answered exactly.
        """
        self._check_query(query)
        if self.faiss_index is None:
            return chunked_topk(query, self.embeds, k, chunk_size)
        scores, ids = self.faiss_index.search(combined_vectors(query).numpy(), min(k, len(self)))
        scores, ids = torch.from_numpy(scores), torch.from_numpy(ids).long()
        short = (ids < 0).any(dim=1)
        if short.any():
            rows = {key: value[short] for key, value in query.items()}
            scores[short], ids[short] = chunked_topk(rows, self.embeds, k, chunk_size)
        return scores, ids

    def _check_query(self, query: dict[str, torch.Tensor]) -> None:
        for key in ("global", "local"):
            if key in query and key in self.embeds and query[key].shape[1] != self.embeds[key].shape[1]:
                raise GalleryIndexError(
                    f"query {key} embeddings have {query[key].shape[1]} dims, the gallery index "
                    f"{self.embeds[key].shape[1]}: the index was built with another model"
                )

    def view(self, i: int) -> tuple[str | None, float | None]:
        """Predicted view name and its probability for gallery item ``i`` (None without a view router)."""
        probs = self.embeds.get("view_probs")
        if probs is None:
            return None, None
        label = int(probs[i].argmax())
        return VIEW_NAMES[label], float(probs[i, label])

    def hits(self, scores: torch.Tensor, indices: torch.Tensor) -> list[dict[str, Any]]:
        """One query's ranked hits: rank, score, index, path, predicted view and its probability."""
        out = []
        for rank, (score, i) in enumerate(zip(scores.tolist(), indices.tolist(), strict=True), start=1):
            view, view_score = self.view(i)
            path = self.paths[i] if self.paths is not None else None
            out.append(
                {
                    "rank": rank,
                    "score": score,
                    "index": i,
                    "path": path,
                    "view": view,
                    "view_score": view_score,
                }
            )
        return out

    def search(self, query: dict[str, torch.Tensor], top_k: int = 10) -> list[list[dict[str, Any]]]:
        """Ranked hits for every query row."""
        scores, indices = self.topk(query, top_k)
        return [self.hits(s, i) for s, i in zip(scores, indices, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# Building on disk (resumable)
# ---------------------------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def read_meta(path: str | os.PathLike) -> dict:
    """``index.json`` of an index directory, with clear errors for a missing or foreign file."""
    path = Path(path)
    meta_file = path / "index.json"
    if not meta_file.is_file():
        raise GalleryIndexError(
            f"no gallery index at {path} (index.json not found); build one with "
            f"`tagclip index --model MODEL --images DIR --out {path}`"
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as error:
        raise GalleryIndexError(f"corrupt gallery index {meta_file}: {error}") from error
    if meta.get("format") != INDEX_FORMAT or meta.get("version") != INDEX_VERSION:
        raise GalleryIndexError(
            f"{meta_file} is not a {INDEX_FORMAT} v{INDEX_VERSION} file (format {meta.get('format')!r}, "
            f"version {meta.get('version')!r})"
        )
    return meta


def _shard_rows(out: Path) -> list[tuple[Path, int]]:
    shards = sorted((out / "shards").glob("shard_*.safetensors"))
    return [(s, load_file(str(s))["global"].shape[0]) for s in shards]


def _start_or_resume(out: Path, meta: dict, overwrite: bool) -> tuple[dict, int]:
    """Existing progress (meta, rows done) if ``out`` holds a compatible partial build; else a fresh start."""
    if overwrite and out.exists():
        shutil.rmtree(out)
    if not (out / "index.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "index.json", meta)
        return meta, 0
    old = read_meta(out)
    for key, what in (
        ("model_fingerprint", "model"),
        ("paths", "image list"),
        ("image_root", "image folder"),
    ):
        if old.get(key) != meta.get(key):
            raise GalleryIndexError(
                f"gallery index {out} was built with a different {what}; pass --overwrite to rebuild it"
            )
    if old.get("complete"):
        return old, old["num_images"]
    rows = _shard_rows(out)
    return old, sum(n for _, n in rows)


# ---------------------------------------------------------------------------------------------------------
# faiss indexes: exact flat or approximate (ANN)
# ---------------------------------------------------------------------------------------------------------


def ivf_lists(size: int) -> int:
    """IVF lists for ``size`` vectors: the power of two nearest 4 sqrt(N), with >= 64 vectors per list."""
    target = max(1.0, min(4 * math.sqrt(size), size / 64))
    return 2 ** max(0, round(math.log2(target)))


def pq_subquantizers(dim: int) -> int:
    """PQ sub-vectors: one per 2 dims (256 for 512-d); the largest divisor of ``dim`` not above dim / 2."""
    return next(m for m in range(max(1, dim // 2), 0, -1) if dim % m == 0)


def ann_spec(ann: str, size: int, dim: int, params: dict[str, float] | None = None) -> dict[str, Any]:
    """``{"factory", "params"}`` of an ANN preset (``ANN_PRESETS``) or of a faiss index_factory string.

    Presets choose their sizes from ``size``/``dim``; a factory string needs its search parameters in
    ``params`` (faiss ``ParameterSpace`` names: ``nprobe``, ``efSearch``, ``k_factor_rf``).
    """
    if faiss is None:
        raise GalleryIndexError("an approximate (ANN) index needs faiss: pip install faiss-cpu")
    if ann == "ivf":
        nlist = ivf_lists(size)
        spec = {"factory": f"IVF{nlist},PQ{pq_subquantizers(dim)}x4fsr,RFlat",
                "params": {"nprobe": max(1, nlist // IVF_PROBE_DIVISOR), "k_factor_rf": IVF_K_FACTOR}}  # fmt: skip
    else:
        try:
            faiss.index_factory(dim, ann, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            presets = ", ".join(ANN_PRESETS)
            raise GalleryIndexError(
                f"unknown ANN index {ann!r}: use a preset ({presets}) or a faiss index_factory string"
            ) from error
        spec = {"factory": ann, "params": {}}
    spec["params"].update(params or {})
    spec["params"] = {name: int(value) if float(value).is_integer() else float(value)
                      for name, value in spec["params"].items()}  # fmt: skip
    return spec


def _set_search_params(index: Any, params: dict[str, float]) -> None:
    space = faiss.ParameterSpace()
    for name, value in params.items():
        try:
            space.set_index_parameter(index, name, value)
        except RuntimeError as error:
            raise GalleryIndexError(
                f"faiss index {type(index).__name__} has no parameter {name!r}"
            ) from error


def build_faiss_index(vectors: torch.Tensor, ann: dict[str, Any] | None = None) -> Any:
    """An inner-product faiss index over ``vectors`` [N, D]: exact flat, or the ANN ``ann_spec`` given."""
    data = vectors.float().contiguous().numpy()
    if ann is None:
        index = faiss.IndexFlatIP(data.shape[1])
    else:
        index = faiss.index_factory(data.shape[1], ann["factory"], faiss.METRIC_INNER_PRODUCT)
        if not index.is_trained:
            index.train(data[_training_rows(data.shape[0], index)])
        _set_search_params(index, ann["params"])
    index.add(data)
    return index


def _training_rows(size: int, index: Any) -> torch.Tensor:
    """A fixed random subset of rows for training: 40 per IVF list (all rows when that is more)."""
    ivf = faiss.try_extract_index_ivf(index)
    count = min(size, 40 * ivf.nlist) if ivf is not None else size
    return torch.randperm(size, generator=torch.Generator().manual_seed(0))[:count].sort().values


def _finish(out: Path, meta: dict, use_faiss: bool, ann: str | None, ann_params: dict | None) -> None:
    parts = [load_file(str(s)) for s, _ in _shard_rows(out)]
    embeds = _concat(parts)
    save_file(embeds, str(out / "embeddings.safetensors"))
    meta["faiss"] = bool(use_faiss and faiss is not None)
    if meta["faiss"]:
        vectors = combined_vectors(embeds)
        spec = None
        if ann is not None and vectors.shape[0] >= ANN_MIN_SIZE:
            spec = ann_spec(ann, vectors.shape[0], vectors.shape[1], ann_params)
        faiss.write_index(build_faiss_index(vectors, spec), str(out / "faiss.index"))
        meta["ann"] = spec
    meta.update(complete=True, num_done=meta["num_images"])
    meta["embed_dims"] = {key: int(value.shape[1]) for key, value in embeds.items()}
    _write_json(out / "index.json", meta)
    shutil.rmtree(out / "shards", ignore_errors=True)


def build_index(
    model,
    processor,
    images: str | os.PathLike,
    out: str | os.PathLike,
    batch_size: int = 32,
    shard_size: int = 512,
    overwrite: bool = False,
    use_faiss: bool | None = None,
    progress: bool = True,
    model_name: str | None = None,
    on_shard: Callable[[int, int], None] | None = None,
    ann: str | None = None,
    ann_params: dict[str, float] | None = None,
) -> GalleryIndex:
    """Encode every image under ``images`` into the index directory ``out``; resumes an interrupted build.

    With faiss, ``ann=None`` writes an exact index; ``ann="ivf"`` (``ANN_PRESETS``) or a faiss index_factory
    string an approximate one, with search parameters ``ann_params`` (e.g. ``{"nprobe": 256}``) over the
    preset's, kept in ``index.json`` and applied on load. Galleries under ``ANN_MIN_SIZE`` stay exact.
    """
    if ann is not None:  # fail fast on a bad option, before encoding
        if use_faiss is False:
            raise GalleryIndexError(f"ann={ann!r} needs the faiss index (use_faiss)")
        ann_spec(ann, 1_000_000, combined_vectors(encode_texts(model, processor, "a person")).shape[1])
    root, out = Path(images).resolve(), Path(out)
    files = list_images(root)
    meta = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "model": model_name or str(getattr(model.config, "_name_or_path", "") or ""),
        "model_fingerprint": model_fingerprint(model),
        "image_root": str(root),
        "paths": [f.relative_to(root).as_posix() for f in files],
        "num_images": len(files),
        "num_done": 0,
        "complete": False,
        "shard_size": shard_size,
    }
    meta, done = _start_or_resume(out, meta, overwrite)
    if not meta.get("complete"):
        (out / "shards").mkdir(exist_ok=True)
        shard_size = int(meta["shard_size"])
        starts = range(done, len(files), shard_size)
        for start in _progress(starts, len(starts), f"indexing {len(files) - done} images", progress):
            rows = encode_images(model, processor, files[start : start + shard_size], batch_size)
            tmp = out / "shards" / "partial.tmp"
            save_file(rows, str(tmp))
            os.replace(tmp, out / "shards" / f"shard_{start:09d}.safetensors")
            meta["num_done"] = start + len(rows["global"])
            _write_json(out / "index.json", meta)
            if on_shard is not None:
                on_shard(meta["num_done"], len(files))
        _finish(out, meta, use_faiss if use_faiss is not None else True, ann, ann_params)
    return GalleryIndex.load(out)
