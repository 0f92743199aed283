"""Inference Endpoints custom handler for TAG-CLIP (the Hub's ``EndpointHandler(path)`` / ``__call__(data)`` contract).

Requests (JSON; images as base64 strings, optionally ``data:image/...;base64,`` URIs, or PIL images when the
toolkit decodes a binary body):

- ``{"inputs": "a man in a red jacket"}`` or ``{"inputs": {"text": [...]}}`` → text embeddings
- ``{"inputs": <PIL image>}`` or ``{"inputs": {"image": b64}}`` / ``{"inputs": {"images": [b64, ...]}}`` → image
  embeddings with the predicted view
- ``{"inputs": {"text": "...", "images": [b64, ...]}, "parameters": {"top_k": 5}}`` → ranking of the images for
  each text (Eq. 14 score, predicted view)

Embeddings are L2-normalised: ``embedding`` (global, 512-d for ViT-B/16) and ``local_embedding`` (TSE); their
Eq. 14 score is ``(e_t·e_i + l_t·l_i) / 2``.

Bad requests raise ``RequestError`` (a ValueError with ``status`` 400) or ``PayloadTooLargeError`` (413), naming
the problem. Limits (``Limits``; constructor argument or environment ``TAGCLIP_MAX_IMAGES``,
``TAGCLIP_MAX_TEXTS``, ``TAGCLIP_MAX_PIXELS``, ``TAGCLIP_MAX_IMAGE_BYTES``, ``TAGCLIP_MAX_TEXT_CHARS``) bound every
request (``TAGCLIP_MAX_REQUEST_PIXELS``: the pixels of all images of one request, checked from their headers
before any is decoded). ``dtype`` (``fp32``/``fp16``/``bf16``, or ``TAGCLIP_DTYPE``) sets the serving precision. Only
transformers, torch and PIL are needed: a model folder's ``.py`` files run only when the deployment opts in with
``trust_remote_code=True`` or ``TAGCLIP_TRUST_REMOTE_CODE=1`` (a Hub repository served without the package needs
it); otherwise the installed ``modeling_tagclip`` package serves TAG-CLIP folders.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image
from transformers import AutoModel, AutoProcessor, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# Copied from modeling_tagclip.tagclip.configuration_tagclip.VIEW_NAMES
VIEW_NAMES = ("aerial", "ground")


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


OWN_MODEL_TYPES = ("tagclip",)
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
PARAMETERS = ("top_k",)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF", "PPM")  # never EPS/PDF or other plug-ins
INPUT_KEYS = ("text", "image", "images")


class RequestError(ValueError):
    """A bad request; ``status`` is the HTTP status to answer with (400)."""

    status = 400


class PayloadTooLargeError(RequestError):
    """A request over a size limit (HTTP 413)."""

    status = 413


class Limits(NamedTuple):
    """Per-request bounds; each can be set by the environment variable ``TAGCLIP_<NAME upper-case>``."""

    max_images: int = 64
    max_texts: int = 256
    max_pixels: int = 16_000_000
    max_image_bytes: int = 16 * 2**20
    max_text_chars: int = 2000
    max_request_pixels: int = 64_000_000

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Limits:
        """Defaults overridden by ``TAGCLIP_MAX_*`` variables (positive integers)."""
        environ = os.environ if environ is None else environ
        values = {}
        for name in cls._fields:
            raw = environ.get(f"TAGCLIP_{name.upper()}")
            if raw is not None:
                if not raw.strip().isdigit() or int(raw) < 1:
                    raise ValueError(f"TAGCLIP_{name.upper()} must be a positive integer, got {raw!r}")
                values[name] = int(raw)
        return cls(**values)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``fp32``/``fp16``/``bf16`` (or the torch dtype); None means ``TAGCLIP_DTYPE`` or fp32."""
    dtype = dtype if dtype is not None else os.environ.get("TAGCLIP_DTYPE", "fp32")
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"unknown dtype {dtype!r}; choose one of fp32, fp16, bf16")


def trust_remote_code_for(path: str, opt_in: bool | None = None) -> bool:
    """Whether to run the model folder's ``.py`` files: only when the deployment opts in (``opt_in``, else
    ``TAGCLIP_TRUST_REMOTE_CODE=1``). Otherwise a TAG-CLIP folder is served by the installed package, and without
    it a clear error says how to opt in."""
    if opt_in is None:
        opt_in = os.environ.get("TAGCLIP_TRUST_REMOTE_CODE", "").lower() in ("1", "true", "yes")
    if opt_in:
        return True
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in the model folder {path}")
    model_type = PretrainedConfig.get_config_dict(path)[0].get("model_type")
    if model_type in OWN_MODEL_TYPES and model_type not in CONFIG_MAPPING:
        try:
            import modeling_tagclip  # noqa: F401  (registers the TAG-CLIP Auto classes)
        except ImportError:
            raise RuntimeError(
                f"{path} needs the modeling_tagclip package, which is not installed: pip install it, or set "
                "TAGCLIP_TRUST_REMOTE_CODE=1 (or pass trust_remote_code=True) to run the folder's own code"
            ) from None
    return False


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


def _image_bytes(value: str | bytes | bytearray, limits: Limits) -> io.BytesIO:
    """The bytes of a base64 string, a ``data:...;base64,`` URI or raw bytes, within ``max_image_bytes``."""
    if isinstance(value, str):
        payload = value
        if value.startswith("data:"):
            header, comma, payload = value.partition(",")
            if not comma or not header.endswith(";base64"):
                raise RequestError("a data: URI must look like data:image/png;base64,<base64 data>")
        if len(payload) * 3 // 4 > limits.max_image_bytes:
            raise PayloadTooLargeError(f"an image is over {limits.max_image_bytes} bytes (max_image_bytes)")
        try:
            value = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise RequestError("an image must be a base64 string (or a data: URI)") from error
    if len(value) > limits.max_image_bytes:
        raise PayloadTooLargeError(f"an image is over {limits.max_image_bytes} bytes (max_image_bytes)")
    return io.BytesIO(value)


def open_image(value: Any, limits: Limits | None = None) -> Image.Image:
    """A PIL image from a PIL image, raw bytes or a base64 string, its header read and its size checked against
    ``max_pixels``; the pixels are not decoded yet (``decode_image`` does that)."""
    limits = limits or Limits()
    if isinstance(value, (str, bytes, bytearray)):
        data = _image_bytes(value, limits)
        try:
            value = Image.open(data, formats=IMAGE_FORMATS)
        except Image.DecompressionBombError as error:
            raise PayloadTooLargeError(f"image is too large: {error} (max_pixels)") from error
        except (OSError, SyntaxError, ValueError) as error:
            raise RequestError(f"cannot decode image: {error}") from error
    elif not isinstance(value, Image.Image):
        raise RequestError(f"unsupported image value of type {type(value).__name__}; send base64 strings")
    try:
        _check_size(value, limits.max_pixels)
    except ImageTooLargeError as error:
        raise PayloadTooLargeError(f"{error} (max_pixels)") from error
    except ValueError as error:
        raise RequestError(str(error)) from error
    return value


def decode_image(value: Any, limits: Limits | None = None) -> Image.Image:
    """An 8-bit RGB PIL image from a PIL image, raw bytes or a base64 string (``data:`` URIs accepted)."""
    limits = limits or Limits()
    image = open_image(value, limits)
    try:
        return load_rgb(image, limits.max_pixels)
    except ImageTooLargeError as error:
        raise PayloadTooLargeError(f"{error} (max_pixels)") from error
    except (OSError, SyntaxError, ValueError) as error:  # e.g. a truncated file: its header was fine
        raise RequestError(f"cannot decode image: {error}") from error


def decode_images(values: list[Any], limits: Limits) -> list[Image.Image]:
    """Every image of a request, decoded only once the header sizes of all of them fit ``max_request_pixels``."""
    opened = [open_image(v, limits) for v in values]
    total = sum(image.width * image.height for image in opened)
    if total > limits.max_request_pixels:
        raise PayloadTooLargeError(
            f"{len(opened)} images of {total} pixels in all in one request; the limit is "
            f"{limits.max_request_pixels} (max_request_pixels)"
        )
    return [decode_image(image, limits) for image in opened]


def _as_list(value: Any, what: str, limit: int) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise RequestError(f"'{what}' is an empty list")
    if len(values) > limit:
        raise PayloadTooLargeError(f"{len(values)} {what} in one request; the limit is {limit} (max_{what})")
    return values


def _top_k(parameters: Any, n_images: int) -> int:
    if not isinstance(parameters, dict):
        raise RequestError(f"'parameters' must be an object, got {type(parameters).__name__}")
    unknown = sorted(set(parameters) - set(PARAMETERS))
    if unknown:
        raise RequestError(f"unknown parameters {unknown}; allowed: {list(PARAMETERS)}")
    top_k = parameters.get("top_k", n_images)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise RequestError(f"'top_k' must be a positive integer, got {top_k!r}")
    return min(top_k, n_images)


class EndpointHandler:
    """Text and image embeddings and text-vs-images ranking with a TAG-CLIP checkpoint."""

    def __init__(
        self,
        path: str = "",
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool | None = None,
        limits: Limits | None = None,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        self.limits = limits or Limits.from_env()
        trust = trust_remote_code_for(path, trust_remote_code)
        self.model = AutoModel.from_pretrained(path, trust_remote_code=trust, dtype=self.dtype)
        self.model = self.model.to(self.device).eval()
        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust)

    def __call__(self, data: dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any]:
        """Dispatch on the request shape (see the module docstring)."""
        if not isinstance(data, dict):
            raise RequestError("the request body must be a JSON object with an 'inputs' field")
        inputs, parameters = data.get("inputs", data), data.get("parameters")
        parameters = {} if parameters is None else parameters
        _top_k(parameters, 1)  # malformed parameters are an error for every kind of request
        if isinstance(inputs, str):
            return self.embed_texts([inputs])
        if isinstance(inputs, Image.Image):
            return self.embed_images(decode_images([inputs], self.limits))
        if not isinstance(inputs, dict):
            raise RequestError("'inputs' must be a text, an image or an object with 'text' and/or 'image(s)'")
        unknown = sorted(set(inputs) - set(INPUT_KEYS))
        if unknown or not inputs:
            raise RequestError(f"'inputs' needs 'text', 'image' or 'images'; unknown keys {unknown}")
        if "image" in inputs and "images" in inputs:
            raise RequestError("give either 'image' or 'images', not both")
        texts = _as_list(inputs["text"], "texts", self.limits.max_texts) if "text" in inputs else None
        raw = inputs.get("images", inputs.get("image"))
        images = None
        if "images" in inputs or "image" in inputs:
            raw = _as_list(raw, "images", self.limits.max_images)
            images = decode_images(raw, self.limits)
        if texts is not None and images is not None:
            return self.rank(texts, images, _top_k(parameters, len(images)))
        return self.embed_texts(texts) if texts is not None else self.embed_images(images)

    def _check_texts(self, texts: list[Any]) -> None:
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise RequestError(f"text {i} must be a non-empty string, got {text!r:.80}")
            if len(text) > self.limits.max_text_chars:
                raise PayloadTooLargeError(
                    f"text {i} has {len(text)} characters; the limit is {self.limits.max_text_chars} (max_text_chars)"
                )

    @torch.inference_mode()
    def _text_features(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_texts(texts)
        try:
            ids = self.processor(text=texts)["input_ids"].to(self.device)
        except ValueError as error:  # e.g. a text that is only punctuation
            raise RequestError(str(error)) from error
        out = self.model.get_text_features(input_ids=ids)
        return _normalized(out.pooler_output), _normalized(out.local_embeds)

    @torch.inference_mode()
    def _image_features(self, images: list[Image.Image]):
        pixels = self.processor(images=images)["pixel_values"].to(self.device, self.dtype)
        out = self.model.get_image_features(pixel_values=pixels)
        probs = None
        if out.view_logits:
            probs = torch.stack([v.float().softmax(-1) for v in out.view_logits]).mean(0).cpu()
        return _normalized(out.pooler_output), _normalized(out.local_embeds), probs

    def embed_texts(self, texts: list[str]) -> list[dict[str, Any]]:
        """``[{"text", "embedding", "local_embedding"}]`` per text."""
        global_, local = self._text_features(texts)
        return [
            {"text": t, "embedding": global_[i].tolist(), "local_embedding": _row(local, i)}
            for i, t in enumerate(texts)
        ]

    def embed_images(self, images: list[Image.Image]) -> list[dict[str, Any]]:
        """``[{"embedding", "local_embedding", "view", "view_score"}]`` per image."""
        global_, local, probs = self._image_features(images)
        return [
            {"embedding": global_[i].tolist(), "local_embedding": _row(local, i), **_view(probs, i)}
            for i in range(len(images))
        ]

    def rank(self, texts: list[str], images: list[Image.Image], top_k: int) -> list[dict[str, Any]]:
        """Per text: the ``top_k`` images by Eq. 14 score, ``{"index", "score", "view", "view_score"}``."""
        t_global, t_local = self._text_features(texts)
        i_global, i_local, probs = self._image_features(images)
        scores = eq14_similarity(t_global, i_global, t_local, i_local)
        top = scores.topk(top_k, dim=1)
        return [
            {
                "text": text,
                "ranking": [
                    {"index": int(j), "score": float(s), **_view(probs, int(j))}
                    for s, j in zip(top.values[row], top.indices[row], strict=True)
                ],
            }
            for row, text in enumerate(texts)
        ]


def _normalized(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else torch.nn.functional.normalize(x.float(), dim=-1).cpu()


def _row(x: torch.Tensor | None, i: int) -> list[float] | None:
    return None if x is None else x[i].tolist()


def _view(probs: torch.Tensor | None, i: int) -> dict[str, Any]:
    if probs is None:
        return {"view": None, "view_score": None}
    label = int(probs[i].argmax())
    return {"view": VIEW_NAMES[label], "view_score": float(probs[i, label])}
