"""The one encoding helper of TAG-CLIP: person images and captions → normalised embeddings, and the Eq. 14 score.

``encode_images`` / ``encode_texts`` return a dict of CPU float32 tensors: ``global`` (L2-normalised projected
CLS / EOS embedding), ``local`` (L2-normalised TSE embedding, when the model has TSE) and, for images,
``view_probs`` [N, 2] (the image-level routers' softmax averaged over the HR-MoE blocks; 0 = aerial,
1 = ground). Images are decoded and preprocessed batch by batch in a ``DataLoader`` (``num_workers`` worker
processes, pinned memory on CUDA); the model runs under ``torch.autocast(dtype)`` when a dtype is given.
``shard=(rank, world_size)`` encodes only that rank's contiguous slice (see ``shard_range``).

Used by evaluation, the gallery index, the pipeline, the CLI and the demo. Hub custom-code compatible (ships
beside ``pipeline_tagclip.py``): imports only the standard library, torch and PIL (tqdm for progress).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

__all__ = [
    "DTYPES",
    "VIEW_NAMES",
    "autocast",
    "embedding_scores",
    "encode_images",
    "encode_texts",
    "eq14_similarity",
    "load_rgb",
    "shard_range",
    "view_prediction",
    "view_probabilities",
]

# Copied from modeling_tagclip.tagclip.configuration_tagclip.VIEW_NAMES
VIEW_NAMES = ("aerial", "ground")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
Images = Sequence[Image.Image | str | os.PathLike]


# Copied from modeling_tagclip.tagclip.modeling_tagclip.eq14_similarity
def eq14_similarity(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    text_local: torch.Tensor | None = None,
    image_local: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 14: sim = 1/2 [cos(v_cls, t_eos) + cos(v_tse, t_tse)], [n_texts, n_images]; global cos without TSE.

    Inputs are L2-normalised embeddings. ``out``: a [n_texts, n_images] tensor to write the scores into (reused
    across calls by streamed evaluation; not for autograd); the same values either way.
    """
    similarity = torch.matmul(text_embeds, image_embeds.t(), out=out)
    if text_local is not None and image_local is not None:
        local = text_local @ image_local.t()
        similarity = 0.5 * (similarity + local) if out is None else similarity.add_(local).mul_(0.5)
    return similarity


def embedding_scores(
    query: dict[str, torch.Tensor],
    gallery: dict[str, torch.Tensor],
    start: int = 0,
    stop: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 14 scores [n_queries, stop - start] of query embedding dicts against gallery rows [start, stop)
    (written into ``out`` when given, see ``eq14_similarity``)."""
    rows = slice(start, stop)
    local = gallery["local"][rows] if "local" in gallery else None
    return eq14_similarity(query["global"], gallery["global"][rows], query.get("local"), local, out=out)


# Copied from modeling_tagclip.tagclip.processing_tagclip.ImageTooLargeError
class ImageTooLargeError(ValueError):
    """An image over the pixel limit (a decompression bomb, or simply too large to serve); HTTP 413."""

    status = 413


# Copied from modeling_tagclip.tagclip.processing_tagclip.load_rgb
def load_rgb(image: Any, max_pixels: int | None = None) -> Image.Image:
    """An 8-bit RGB PIL image from a PIL image, a path or a file object, converting every mode correctly.

    16-bit and 32-bit integer images (``I;16``, ``I;16B``, ``I``) are scaled from 0-65535, float images (``F``)
    from 0-1 (values outside those ranges, NaN or inf are refused); palette and alpha images are composited on
    white. Images over ``max_pixels`` (default: Pillow's ``Image.MAX_IMAGE_PIXELS``) raise ImageTooLargeError
    before their pixels are decoded.
    """
    if not isinstance(image, Image.Image):
        try:
            with Image.open(image) as opened:
                _check_size(opened, max_pixels)
                return load_rgb(opened, max_pixels)
        except Image.DecompressionBombError as error:
            raise ImageTooLargeError(f"image {_name(image)} is too large: {error}") from error
        except (OSError, SyntaxError) as error:
            raise ValueError(f"cannot decode image {_name(image)}: {error}") from error
    _check_size(image, max_pixels)
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        image = _high_depth_to_l(image)
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


# Copied from modeling_tagclip.tagclip.processing_tagclip._name
def _name(image: Any) -> str:
    return repr(str(image)) if isinstance(image, (str, Path)) else f"({type(image).__name__})"


# Copied from modeling_tagclip.tagclip.processing_tagclip._check_size
def _check_size(image: Image.Image, max_pixels: int | None) -> None:
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    width, height = image.size
    if limit is not None and width * height > limit:
        raise ImageTooLargeError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of {limit} pixels"
        )
    if width < 1 or height < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")


# Copied from modeling_tagclip.tagclip.processing_tagclip._high_depth_to_l
def _high_depth_to_l(image: Image.Image) -> Image.Image:
    """8-bit greyscale from a 16/32-bit integer image (0-65535) or a float image (0-1)."""
    if image.mode == "F":
        values = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.float32)
        if not bool(torch.isfinite(values).all()):
            raise ValueError("float image (mode F) contains NaN or inf pixel values")
        low, high, scale, kind = 0.0, 1.0, 255.0, "float image (mode F)"
    else:
        low, high, scale, kind = 0, 65535, 1 / 257, f"integer image (mode {image.mode})"
        image = image.convert("I")
    lowest, highest = image.getextrema()
    if lowest < low or highest > high:
        raise ValueError(f"{kind} values must lie in [{low}, {high}], got [{lowest}, {highest}]")
    return image.point(lambda v: v * scale + 0.5).convert("L")


def view_probabilities(view_logits: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """Router view probabilities [B, 2] (0 aerial, 1 ground): softmax per MoE block, averaged over blocks."""
    if not view_logits:
        return None
    return torch.stack([v.float().softmax(-1) for v in view_logits]).mean(0)


def view_prediction(view_probs: torch.Tensor | None, i: int) -> tuple[str | None, float | None]:
    """(view name, probability) of row ``i`` of ``view_probs``; (None, None) without a view router."""
    if view_probs is None:
        return None, None
    label = int(view_probs[i].argmax())
    return VIEW_NAMES[label], float(view_probs[i, label])


def autocast(device: torch.device, dtype: str | torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` ("bf16", "fp16", a torch dtype; None / "fp32" = full precision)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def shard_range(n: int, shard: tuple[int, int] | None) -> range:
    """Rows of rank ``shard[0]`` of ``shard[1]``: contiguous, sizes differ by at most one (all rows if None)."""
    if shard is None:
        return range(n)
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard}")
    return range(rank * n // world, (rank + 1) * n // world)


def _device(model, device: str | torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else next(model.parameters()).device


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1).cpu()


def _progress(iterable: Iterable, total: int, desc: str, enabled: bool) -> Iterable:
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="batch", leave=False)


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


class _ImageBatches(torch.utils.data.Dataset):
    """Item ``b`` = batch ``b`` decoded and preprocessed (runs in the DataLoader's workers)."""

    def __init__(self, processor, images: Images, views: Sequence[int] | None, batch_size: int):
        self.processor, self.images, self.views, self.batch_size = processor, images, views, batch_size

    def __len__(self) -> int:
        return -(-len(self.images) // self.batch_size)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        rows = range(b * self.batch_size, min((b + 1) * self.batch_size, len(self.images)))
        kwargs = {"views": [int(self.views[i]) for i in rows]} if self.views is not None else {}
        inputs = self.processor(images=[load_rgb(self.images[i]) for i in rows], **kwargs)
        return {key: inputs[key] for key in ("pixel_values", "view_labels") if key in inputs}


@torch.inference_mode()
def encode_images(
    model,
    processor,
    images: Images,
    batch_size: int = 32,
    progress: bool = False,
    *,
    views: Sequence[int] | None = None,
    dtype: str | torch.dtype | None = None,
    num_workers: int = 0,
    device: str | torch.device | None = None,
    shard: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """``global``, ``local`` and ``view_probs`` of images (PIL or paths), batched; ``views`` feed the router's
    ``routing="label"`` mode. With ``shard``, only that rank's rows (``shard_range``)."""
    if len(images) == 0:
        raise ValueError("no images to encode (the gallery is empty)")
    if views is not None and len(views) != len(images):
        raise ValueError(f"{len(views)} views for {len(images)} images")
    rows = shard_range(len(images), shard)
    images = [images[i] for i in rows]
    views = [views[i] for i in rows] if views is not None else None
    device = _device(model, device)
    loader = torch.utils.data.DataLoader(
        _ImageBatches(processor, images, views, batch_size),
        batch_size=None,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    parts = []
    for batch in _progress(loader, len(loader), "encoding images", progress):
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        with autocast(device, dtype):
            out = model.get_image_features(**batch)
        part = {"global": _normalize(out.pooler_output)}
        if out.local_embeds is not None:
            part["local"] = _normalize(out.local_embeds)
        probs = view_probabilities(out.view_logits)
        if probs is not None:
            part["view_probs"] = probs.cpu()
        parts.append(part)
    return _concat(parts) if parts else {}


class _TextBatches(torch.utils.data.Dataset):
    """Item ``b`` = batch ``b`` of captions tokenised (runs in the DataLoader's workers)."""

    def __init__(self, processor, texts: Sequence[str], batch_size: int, text_kwargs: dict[str, Any]):
        self.processor, self.texts, self.batch_size, self.kwargs = processor, texts, batch_size, text_kwargs

    def __len__(self) -> int:
        return -(-len(self.texts) // self.batch_size)

    def __getitem__(self, b: int) -> torch.Tensor:
        rows = self.texts[b * self.batch_size : (b + 1) * self.batch_size]
        return self.processor(text=rows, **self.kwargs)["input_ids"]


@torch.inference_mode()
def encode_texts(
    model,
    processor,
    texts: str | Sequence[str],
    batch_size: int = 256,
    progress: bool = False,
    *,
    dtype: str | torch.dtype | None = None,
    max_length: int | None = None,
    num_workers: int = 0,
    device: str | torch.device | None = None,
    shard: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """``global`` and ``local`` embeddings of captions (a str or a list), batched and tokenised in
    ``num_workers`` DataLoader workers (0: in this process); ``shard`` as for images."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("no query text given")
    texts = [texts[i] for i in shard_range(len(texts), shard)]
    device = _device(model, device)
    text_kwargs = {"max_length": max_length} if max_length else {}
    loader = torch.utils.data.DataLoader(
        _TextBatches(processor, texts, batch_size, text_kwargs),
        batch_size=None,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    parts = []
    for input_ids in _progress(loader, len(loader), "encoding captions", progress):
        with autocast(device, dtype):
            out = model.get_text_features(input_ids=input_ids.to(device, non_blocking=True))
        part = {"global": _normalize(out.pooler_output)}
        if out.local_embeds is not None:
            part["local"] = _normalize(out.local_embeds)
        parts.append(part)
    return _concat(parts) if parts else {}
