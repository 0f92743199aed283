"""TAG-CLIP processor: caption cleaning, CLIP BPE tokenizer (with ``<|mask|>``), eval image transform, views.

Hub custom-code compatible: imports only transformers, torch, PIL and the standard library. ``ftfy`` (the
reference tokenizer's text fixer) is used when installed; without it captions are cleaned as transformers'
``CLIPTokenizer`` cleans them without ftfy, with a one-time warning that says what differs.
"""

from __future__ import annotations

import functools
import html
import json
import re
import unicodedata
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import BatchFeature, CLIPImageProcessorPil, CLIPTokenizer, ProcessorMixin
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling

from .serving_common import ImageTooLargeError, load_rgb
from .views import VIEW_NAMES

try:  # the reference text fixer when installed (a dependency of the package, not of a Hub folder)
    import ftfy
except ImportError:
    ftfy = None

__all__ = [
    "VIEW_LABELS",
    "FtfyMissingWarning",
    "ImageTooLargeError",
    "ProcessorSizeWarning",
    "TagClipProcessor",
    "build_image_processor",
    "build_tokenizer",
    "clean_caption",
    "load_rgb",
    "pre_caption",
    "processor_size_mismatch",
    "view_label_ids",
    "warn_on_processor_size",
]

CONTEXT_LENGTH = 77
VIEW_LABELS = {name: label for label, name in enumerate(VIEW_NAMES)}  # {"aerial": 0, "ground": 1}
DEFAULT_VOCAB_DIR = Path(__file__).resolve().parent / "clip_vocab"
_PUNCT = re.compile(r'[.!"()*#:;~]')
_RUNS = re.compile(r"\s{2,}")
_SPACES = re.compile(r"\s+")


def pre_caption(caption: str, max_words: int = CONTEXT_LENGTH) -> str:
    """TAG-PR's ``pre_caption``: lowercase, ``.!"()*#:;~`` to spaces, collapse runs of 2+ whitespace, strip,
    keep the first ``max_words`` space-separated words. Raises ValueError if nothing is left."""
    if not isinstance(caption, str):
        raise TypeError(f"caption must be a str, got {type(caption).__name__}")
    cleaned = _RUNS.sub(" ", _PUNCT.sub(" ", caption.lower())).rstrip("\n").strip(" ")
    if not cleaned.strip():
        raise ValueError(f"caption is empty after cleaning (got {caption!r})")
    return " ".join(cleaned.split(" ")[:max_words])


class FtfyMissingWarning(UserWarning):
    """ftfy is not installed: captions are cleaned without ``ftfy.fix_text``."""


@functools.cache
def _warn_without_ftfy() -> None:
    """Warn once per process that captions are cleaned without ftfy, and what differs."""
    warnings.warn(
        "ftfy is not installed: TAG-CLIP cleans captions as transformers' CLIPTokenizer does without it "
        "(NFC normalisation, control characters removed) instead of ftfy.fix_text, so mojibake, curly quotes, "
        "ligatures and full-width forms stay as typed and such captions tokenize differently from training; "
        "pip install ftfy for the reference cleaning",
        FtfyMissingWarning,
        stacklevel=3,
    )


def _basic_clean(text: str) -> str:
    """transformers' ``BasicTokenizer`` cleaning: drop NUL, U+FFFD and control characters, NFC-normalise."""
    kept = (
        char
        for char in text
        if char in "\t\n\r" or (char not in "\x00\ufffd" and not unicodedata.category(char).startswith("C"))
    )
    return unicodedata.normalize("NFC", "".join(kept))


def clean_caption(caption: str) -> str:
    """The reference text path: ``pre_caption``, then the CLIP BPE encoder's ``ftfy.fix_text``, ``html.unescape``
    twice, whitespace collapse and lowercase (curly quotes, ligatures and full-width forms are normalised).

    Without ftfy, ``ftfy.fix_text`` is replaced by transformers' ``BasicTokenizer`` cleaning (a
    ``FtfyMissingWarning`` once per process): captions in plain text clean to the same string.
    """
    fixed = pre_caption(caption)
    if ftfy is not None:
        fixed = ftfy.fix_text(fixed)
    else:
        _warn_without_ftfy()
        fixed = _basic_clean(fixed)
    text = _SPACES.sub(" ", html.unescape(html.unescape(fixed))).strip().lower()
    if not text:
        raise ValueError(f"caption is empty after cleaning (got {caption!r})")
    return text


def view_label_ids(views: str | int | Iterable[str | int]) -> torch.LongTensor:
    """Map views ("aerial"/"ground", any case, or 0/1) to a LongTensor of view labels (aerial=0, ground=1)."""
    if isinstance(views, torch.Tensor):
        views = views.tolist()
    if isinstance(views, (str, int)):
        views = [views]
    ids = []
    for view in views:
        if isinstance(view, str) and view.strip().lower() in VIEW_LABELS:
            ids.append(VIEW_LABELS[view.strip().lower()])
        elif isinstance(view, int) and not isinstance(view, bool) and view in VIEW_LABELS.values():
            ids.append(view)
        else:
            allowed = f"{sorted(VIEW_LABELS)} or {sorted(VIEW_LABELS.values())}"
            raise ValueError(f"unknown view {view!r}; allowed: {allowed}")
    return torch.tensor(ids, dtype=torch.long)


def build_tokenizer(vocab_dir: str | Path | None = None, model_max_length: int = 77) -> CLIPTokenizer:
    """CLIP BPE tokenizer from ``vocab.json``/``merges.txt``: pads with id 0 ("!"), ``<|mask|>`` = 49405.

    Truncation keeps ``[SOT] + bpe[:max_len-2] + [EOT]`` as the reference. Since "!" is the pad token (laion
    convention) a literal "!" reaching the tokenizer maps to id 0; ``pre_caption`` removes it beforehand.
    """
    vocab_dir = Path(vocab_dir) if vocab_dir is not None else DEFAULT_VOCAB_DIR
    vocab = json.loads((vocab_dir / "vocab.json").read_text(encoding="utf-8"))
    lines = (vocab_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        pad_token="!",
        mask_token="<|mask|>",
        model_max_length=model_max_length,
    )


def build_image_processor(height: int = 224, width: int = 224) -> CLIPImageProcessorPil:
    """TAG-PR eval transform: exact bicubic resize to (height, width), no crop, RGB, ImageNet normalisation."""
    return CLIPImageProcessorPil(
        size={"height": height, "width": width},
        do_resize=True,
        do_center_crop=False,
        resample=PILImageResampling.BICUBIC,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(IMAGENET_DEFAULT_MEAN),
        image_std=list(IMAGENET_DEFAULT_STD),
        do_convert_rgb=True,
    )


class ProcessorSizeWarning(UserWarning):
    """A processor resizes images to another size than its model takes: encoding an image will fail."""


def processor_size_mismatch(processor: Any, config: Any, where: str) -> str | None:
    """A message naming both sizes and the fix when ``processor`` resizes to another (height, width) than the
    model ``config`` takes, else None."""
    size = getattr(getattr(processor, "image_processor", processor), "size", None)
    hw = tuple(
        getattr(size, key, None) if not isinstance(size, dict) else size.get(key)
        for key in ("height", "width")
    )
    vision = getattr(config, "vision_config", config)
    model_hw = tuple(getattr(vision, "image_hw", ()))
    if None in hw or len(model_hw) != 2 or hw == model_hw:
        return None
    (h, w), (mh, mw) = hw, model_hw
    return (
        f"{where}: the processor resizes images to {h}x{w} but the model takes {mh}x{mw} (height x width), so "
        f"encoding an image fails; text search works. Re-save the processor with "
        f"`TagClipProcessor.from_defaults({mh}, {mw}).save_pretrained(...)` or pass `size={{'height': {mh}, "
        f"'width': {mw}}}` to it"
    )


def warn_on_processor_size(processor: Any, config: Any, where: str) -> None:
    """Warn (`ProcessorSizeWarning`) when ``processor`` and the model ``config`` disagree on the image size."""
    message = processor_size_mismatch(processor, config, where)
    if message is not None:
        warnings.warn(message, ProcessorSizeWarning, stacklevel=3)


class TagClipProcessor(ProcessorMixin):
    """Wraps a CLIP image processor and tokenizer; adds caption cleaning and ``view_labels``.

    Text defaults: ``padding="max_length"``, ``max_length=tokenizer.model_max_length`` (77), ``truncation=True``,
    ``return_tensors="pt"``; all overridable by keyword. The model ignores ``attention_mask`` (causal mask only).
    """

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)
        self.text_kwargs = {
            "padding": "max_length",
            "max_length": self.tokenizer.model_max_length,
            "truncation": True,
            "return_tensors": "pt",
        }
        self.images_kwargs = {"return_tensors": "pt"}

    @classmethod
    def from_defaults(cls, height: int = 224, width: int = 224) -> TagClipProcessor:
        """Processor with the shipped CLIP vocabulary and a (height, width) eval image transform."""
        return cls(image_processor=build_image_processor(height, width), tokenizer=build_tokenizer())

    def warn_on_size(self, config: Any, where: str) -> None:
        """Warn (`ProcessorSizeWarning`) when this processor resizes images to another size than the model of
        ``config`` takes (``where`` names the folder); the retrieval pipeline calls it when it is built."""
        message = processor_size_mismatch(self, config, where)
        if message is not None:
            warnings.warn(message, ProcessorSizeWarning, stacklevel=3)

    def __call__(self, images=None, text=None, views=None, **kwargs) -> BatchFeature:
        """Process ``images`` and/or ``text`` (str or list of str); ``views`` (one per image) → ``view_labels``."""
        if images is None and text is None:
            raise ValueError("TagClipProcessor needs `images` and/or `text`; got neither")
        if views is not None and images is None:
            raise ValueError("`views` label images, but no `images` were given")
        if text is not None:
            text = (
                clean_caption(text)
                if isinstance(text, str)
                else [clean_caption(t) for t in _items(text, "text")]
            )
        if images is not None:
            images = _prepare_images(images)
        out = super().__call__(images=images, text=text, **kwargs)
        if views is not None:
            labels = view_label_ids(views)
            n_images = len(out["pixel_values"])
            if len(labels) != n_images:
                raise ValueError(f"got {len(labels)} views for {n_images} images; pass one view per image")
            out["view_labels"] = labels
        return out

    @property
    def model_input_names(self) -> list[str]:
        """Inputs of ``TagClipModel.forward`` produced by this processor."""
        return ["input_ids", "attention_mask", "pixel_values", "view_labels"]


def _items(values: Any, what: str) -> list:
    """``values`` as a non-empty list (a list, tuple or other non-string iterable)."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise TypeError(f"`{what}` must be a str or a list of str, got {type(values).__name__}")
    values = list(values)
    if not values:
        raise ValueError(f"`{what}` is an empty list")
    return values


def _prepare_images(images: Any) -> list:
    """PIL images and paths to 8-bit RGB (``load_rgb``); arrays/tensors pass after a NaN/inf check."""
    if isinstance(images, (Image.Image, str, Path)) or hasattr(images, "shape"):
        images = [images]
    out = []
    for index, image in enumerate(_items(images, "images")):
        if isinstance(image, (Image.Image, str, Path)):
            out.append(load_rgb(image))
        elif hasattr(image, "shape") and hasattr(image, "dtype"):
            values = torch.as_tensor(image)
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                raise ValueError(f"image {index} contains NaN or inf pixel values")
            out.append(image)
        else:
            raise TypeError(
                f"image {index} must be a PIL image, a path, an array or a tensor, got {type(image).__name__}"
            )
    return out
