"""Inference Endpoints custom handler for TAG-CLIP (the Hub's ``EndpointHandler(path)`` / ``__call__(data)`` contract).

Requests (JSON; images as base64 strings, optionally ``data:image/...;base64,`` URIs, or PIL images when the
toolkit decodes a binary body):

- ``{"inputs": "a man in a red jacket"}`` or ``{"inputs": {"text": [...]}}`` → text embeddings
- ``{"inputs": <PIL image>}`` or ``{"inputs": {"image": b64}}`` / ``{"inputs": {"images": [b64, ...]}}`` → image
  embeddings with the predicted view
- ``{"inputs": {"text": "...", "images": [b64, ...]}, "parameters": {"top_k": 5}}`` → ranking of the images for
  each text (Eq. 14 score, predicted view)

Embeddings are L2-normalised: ``embedding`` (global, 512-d for ViT-B/16) and ``local_embedding`` (TSE); their
Eq. 14 score is ``(e_t·e_i + l_t·l_i) / 2``. Only transformers, torch and PIL are needed: the model code
comes with the repository (``trust_remote_code=True``).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch
from PIL import Image
from transformers import AutoModel, AutoProcessor

# Copied from modeling_tagclip.tagclip.configuration_tagclip.VIEW_NAMES
VIEW_NAMES = ("aerial", "ground")


# Copied from modeling_tagclip.tagclip.modeling_tagclip.eq14_similarity
def eq14_similarity(
    text_embeds: torch.Tensor,
    image_embeds: torch.Tensor,
    text_local: torch.Tensor | None = None,
    image_local: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 14: sim = 1/2 [cos(v_cls, t_eos) + cos(v_tse, t_tse)], [n_texts, n_images]; global cos without TSE.

    Inputs are L2-normalised embeddings.
    """
    similarity = text_embeds @ image_embeds.t()
    if text_local is not None and image_local is not None:
        similarity = 0.5 * (similarity + text_local @ image_local.t())
    return similarity


def decode_image(value: Any) -> Image.Image:
    """A PIL image from a PIL image, raw bytes or a base64 string (``data:`` URIs accepted)."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, str):
        payload = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            value = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError("an image must be a base64 string (or a data: URI)") from error
    if isinstance(value, (bytes, bytearray)):
        try:
            with Image.open(io.BytesIO(value)) as img:
                return img.convert("RGB")
        except OSError as error:
            raise ValueError(f"cannot decode image: {error}") from error
    raise ValueError(f"unsupported image value of type {type(value).__name__}")


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class EndpointHandler:
    """Text and image embeddings and text-vs-images ranking with a TAG-CLIP checkpoint."""

    def __init__(self, path: str = "", device: str | None = None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModel.from_pretrained(path, trust_remote_code=True).to(self.device).eval()
        self.processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)

    def __call__(self, data: dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any]:
        """Dispatch on the request shape (see the module docstring)."""
        if not isinstance(data, dict):
            raise ValueError("the request body must be a JSON object with an 'inputs' field")
        inputs, parameters = data.get("inputs", data), data.get("parameters") or {}
        if isinstance(inputs, str):
            return self.embed_texts([inputs])
        if isinstance(inputs, Image.Image):
            return self.embed_images([inputs])
        if not isinstance(inputs, dict):
            raise ValueError("'inputs' must be a text, an image or an object with 'text' and/or 'image(s)'")
        texts = _as_list(inputs["text"]) if "text" in inputs else None
        raw = inputs.get("images", inputs.get("image"))
        images = [decode_image(v) for v in _as_list(raw)] if raw is not None else None
        if texts is not None and images is not None:
            return self.rank(texts, images, int(parameters.get("top_k", len(images))))
        if texts is not None:
            return self.embed_texts(texts)
        if images is not None:
            return self.embed_images(images)
        raise ValueError("'inputs' needs 'text', 'image' or 'images'")

    @torch.inference_mode()
    def _text_features(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError("texts must be non-empty strings")
        ids = self.processor(text=texts)["input_ids"].to(self.device)
        out = self.model.get_text_features(input_ids=ids)
        return _normalized(out.pooler_output), _normalized(out.local_embeds)

    @torch.inference_mode()
    def _image_features(self, images: list[Image.Image]):
        if not images:
            raise ValueError("no images given")
        pixels = self.processor(images=images)["pixel_values"].to(self.device)
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
        top = scores.topk(max(1, min(top_k, len(images))), dim=1)
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
