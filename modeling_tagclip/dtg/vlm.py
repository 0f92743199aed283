"""The captioning model: the ``CaptionGenerator`` protocol and a local transformers image-text-to-text VLM."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from PIL import Image

from modeling_tagclip.dtg.progress import chunks


@runtime_checkable
class CaptionGenerator(Protocol):
    """Anything that answers one prompt per image: ``generator(images, prompts) -> list[str]``.

    It may also have ``retry(images, prompts)``, used for the one retry of empty answers.
    """

    def __call__(self, images: list[Image.Image], prompts: list[str]) -> list[str]: ...


def _batch_seed(seed: int, images: Sequence[Image.Image], prompts: Sequence[str]) -> int:
    """A sampling seed from the run seed and the batch content (reproducible across resumes)."""
    crc = zlib.crc32(str(seed).encode())
    for image, prompt in zip(images, prompts, strict=True):
        crc = zlib.crc32(image.tobytes(), zlib.crc32(prompt.encode(), crc))
    return crc


@dataclass
class HFGenerator:
    """A local transformers ``image-text-to-text`` model (``AutoProcessor`` + ``AutoModelForImageTextToText``).

    Greedy by default; ``do_sample`` with ``temperature``/``top_p`` is seeded per batch from ``seed`` and the
    batch content. ``retry`` samples (temperature 0.7, top-p 0.9 unless sampling was set) to escape an empty
    greedy answer.
    """

    model_dir: str
    batch_size: int = 8
    max_new_tokens: int = 160
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    model: Any = field(default=None, repr=False)
    processor: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self._load()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if not Path(self.model_dir).is_dir():
            raise FileNotFoundError(f"--model {self.model_dir} is not a local model folder")
        _require_vlm(Path(self.model_dir))
        kwargs = {"local_files_only": True, "trust_remote_code": self.trust_remote_code}
        self.processor = AutoProcessor.from_pretrained(self.model_dir, **kwargs)
        dtype = self.dtype if self.dtype == "auto" else getattr(torch, self.dtype)
        self.model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=dtype, **kwargs)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(device).eval()
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None and not self.model.config.is_encoder_decoder:
            tokenizer.padding_side = "left"

    def with_options(self, **options: Any) -> HFGenerator:
        """A copy sharing the loaded model, with other generation options (e.g. for the quality check)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return HFGenerator(**{**fields, **options})

    def __call__(self, images: list[Image.Image], prompts: list[str]) -> list[str]:
        return self._run(images, prompts, self.do_sample, self.temperature, self.top_p)

    def retry(self, images: list[Image.Image], prompts: list[str]) -> list[str]:
        temperature, top_p = (self.temperature, self.top_p) if self.do_sample else (0.7, 0.9)
        return self._run(images, prompts, True, temperature, top_p)

    def _run(self, images: list, prompts: list, sample: bool, temperature: float, top_p: float) -> list[str]:
        out: list[str] = []
        pairs = list(zip(images, prompts, strict=True))
        for chunk in chunks(pairs, self.batch_size):
            imgs, texts = [p[0] for p in chunk], [p[1] for p in chunk]
            out.extend(self._generate(imgs, texts, sample, temperature, top_p))
        return out

    def _generate(
        self, images: list, prompts: list, sample: bool, temperature: float, top_p: float
    ) -> list[str]:
        import torch

        conversations = [
            [{"role": "user", "content": [{"type": "image", "image": im}, {"type": "text", "text": p}]}]
            for im, p in zip(images, prompts, strict=True)
        ]
        inputs = self.processor.apply_chat_template(
            conversations,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"padding": True},
        ).to(self.model.device, dtype=self.model.dtype)
        options: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": sample}
        if sample:
            options.update(temperature=temperature, top_p=top_p)
            torch.manual_seed(_batch_seed(self.seed, images, prompts))
        with torch.inference_mode():
            ids = self.model.generate(**inputs, **options)
        if not self.model.config.is_encoder_decoder:
            ids = ids[:, inputs["input_ids"].shape[1] :]
        return self.processor.batch_decode(ids, skip_special_tokens=True)


def _require_vlm(folder: Path) -> None:
    """A ``ValueError`` unless ``folder`` holds an image-text-to-text model (a VLM that writes captions): a
    TAG-CLIP or other folder is named with its model type, not with transformers' list of ~100 config classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"--model {folder}: no readable config.json ({error})") from None
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or "AutoModelForImageTextToText" in (
        config.get("auto_map") or {}
    ):
        return
    raise ValueError(
        f"--model {folder} holds a {model_type!r} model, not an image-text-to-text model: dtg needs a local "
        "vision-language model that writes captions (LLaVA, Qwen2-VL, BLIP-2, ...)"
    )
