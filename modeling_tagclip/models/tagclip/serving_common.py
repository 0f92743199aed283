"""What the serving files share with the model: the TAG-PR Eq. 14 score and image decoding with size limits.

Standard library, torch and PIL only: ``retrieval/encode.py`` and ``retrieval/handler.py`` carry generated
copies (``utils/fix_copies.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from PIL import Image


def eq14_similarity(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    text_local: torch.Tensor | None = None,
    image_local: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """TAG-PR Eq. 14: sim = 1/2 [cos(v_cls, t_eos) + cos(v_tse, t_tse)], [n_texts, n_images]; global cos without TSE.

    Inputs are L2-normalised embeddings. ``out``: a [n_texts, n_images] tensor to write the scores into (reused
    across calls by streamed evaluation; not for autograd); the same values either way.
    """
    similarity = torch.matmul(text_embeds, image_embeds.t(), out=out)
    if text_local is not None and image_local is not None:
        local = text_local @ image_local.t()
        similarity = 0.5 * (similarity + local) if out is None else similarity.add_(local).mul_(0.5)
    return similarity


def looks_local(name: str) -> bool:
    """True for model names that can only be paths (absolute, ./ ../ ~, or more than one '/'), never Hub repo ids:
    a missing one is a missing folder, not a bad repo id."""
    return name.startswith((".", "/", "~", "\\")) or name.count("/") > 1 or os.path.isabs(name)


class ImageTooLargeError(ValueError):
    """An image over the pixel limit (a decompression bomb, or simply too large to serve); HTTP 413."""

    status = 413


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
                return _to_rgb(opened)
        except Image.DecompressionBombError as error:
            raise ImageTooLargeError(f"image {_name(image)} is too large: {error}") from error
        except (OSError, SyntaxError) as error:
            raise ValueError(f"cannot decode image {_name(image)}: {error}") from error
    _check_size(image, max_pixels)
    try:
        return _to_rgb(image)
    except (OSError, SyntaxError) as error:  # an opened image decodes lazily: a truncated file fails here
        raise ValueError(
            f"cannot decode image {_name(image)}: {error} (a truncated or corrupt file)"
        ) from error


def _to_rgb(image: Image.Image) -> Image.Image:
    """Decode ``image`` and convert it to 8-bit RGB (see ``load_rgb``)."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        image = _high_depth_to_l(image)
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _name(image: Any) -> str:
    return repr(str(image)) if isinstance(image, (str, Path)) else f"({type(image).__name__})"


def _check_size(image: Image.Image, max_pixels: int | None) -> None:
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    width, height = image.size
    if limit is not None and width * height > limit:
        raise ImageTooLargeError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of {limit} pixels"
        )
    if width < 1 or height < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")


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
