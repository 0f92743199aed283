"""TAG-CLIP training data: splits (validated), the synthetic set, training augmentation, pair loader."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageEnhance, ImageOps

from modeling_tagclip.engine.config import ConfigError, TagClipTrainConfig
from modeling_tagclip.engine.samplers import EpochSampler
from modeling_tagclip.engine.tasks.data_guard import may_render
from modeling_tagclip.models.tagclip.processing_tagclip import view_label_ids
from modeling_tagclip.progress import main_process

logger = logging.getLogger(__name__)
DEFAULT_DATA_DIR = "data/synthetic"


@dataclass
class DataSplits:
    """Image-level datasets (one row per image) and the training identity mapping."""

    train: Any
    validation: Any | None
    test: Any
    id_mapping: dict[int, int]


def _image_dir(cfg: TagClipTrainConfig) -> Path | None:
    if cfg.image_dir:
        return Path(cfg.image_dir)
    root = Path(cfg.data_dir)
    return root / "images" if (root / "images").is_dir() else None


def _has_annotations(root: Path, split: str) -> bool:
    from modeling_tagclip.data.text_retrieval import RAW_FORMATS

    names = [f"{split}_reid.json", *(f for _, f, _ in RAW_FORMATS.values())]
    # present in any form (a link to a device included): the loader then names what it is, never "missing"
    return any(os.path.lexists(root / n) for n in names) or (root / "anno_dir").is_dir()


def _render_options(cfg: TagClipTrainConfig) -> dict[str, Any]:
    """``generate_dataset`` keyword arguments of the ``synthetic`` block (image size: the training one unless set)."""
    opts = dict(cfg.synthetic)
    opts["image_size"] = tuple(opts.get("image_size", cfg.image_size))
    return opts


def ensure_synthetic(cfg: TagClipTrainConfig) -> None:
    """Render the synthetic set when ``data_dir`` has no annotations, ``synthetic`` is configured, and the folder
    is the default one or ``render_synthetic`` asks for it; otherwise a data_dir without annotations is an error.
    A set rendered by another generator version or with other parameters than the ``synthetic`` block is
    re-rendered in the default folder (with a warning saying why) and refused elsewhere unless ``render_synthetic``."""
    from modeling_tagclip.data.synthetic import generate_dataset, stale_render

    root = Path(cfg.data_dir)
    opts = _render_options(cfg) if cfg.synthetic else {}
    stale = stale_render(root, opts) if cfg.synthetic else None
    if stale and root.resolve() != Path(DEFAULT_DATA_DIR).resolve() and not cfg.render_synthetic:
        raise ConfigError(
            f"{stale}; pass --render_synthetic true to re-render it in place, or --set synthetic=null to use it as it is"
        )
    if stale:
        logger.warning("%s: re-rendering it", stale)
    elif _has_annotations(root, cfg.train_split):
        return
    expected = (
        f"{cfg.train_split}_reid.json / {cfg.test_split}_reid.json (TAG-PEDES layout) or a raw dataset file"
    )
    if not cfg.synthetic:
        raise FileNotFoundError(f"data_dir {root} holds no {expected}")
    may_render(root, DEFAULT_DATA_DIR, cfg.render_synthetic or bool(stale), expected)
    if main_process():
        print(f"rendering the synthetic set into {root} (once): {_render_summary(opts)}")
    try:
        generate_dataset(root, progress=main_process(), **opts)
    except ValueError as error:  # a bad value in the block, refused before anything is written
        raise ConfigError(f"synthetic: {error}") from error


def _render_summary(opts: dict[str, Any]) -> str:
    """``435 identities, 3 images per view and identity, 128x64 pixels`` (what the ``synthetic`` block renders)."""
    parts = [f"{opts['num_identities']} identities"] if "num_identities" in opts else []
    if "images_per_view" in opts:
        parts.append(f"{opts['images_per_view']} images per view and identity")
    if "image_size" in opts:
        parts.append("x".join(str(int(v)) for v in opts["image_size"]) + " pixels")
    return ", ".join(parts) or "the generator's defaults"


def _image_problem(path: str) -> str | None:
    try:
        with Image.open(path) as img:
            img.verify()
        return None
    except FileNotFoundError:
        return "missing"
    except Exception as err:  # noqa: BLE001  (PIL raises many types for corrupt files)
        return f"unreadable ({type(err).__name__}: {err})"


def _caption_ok(caption: str) -> bool:
    from modeling_tagclip import pre_caption

    try:
        pre_caption(caption)
        return True
    except (TypeError, ValueError):
        return False


def validate_images(ds, policy: str, name: str):
    """Check every image opens and every caption survives cleaning; raise (``error``) or drop and warn (``skip``)."""
    bad_images = {}
    for path in dict.fromkeys(ds["image_path"]):
        problem = _image_problem(path)
        if problem:
            bad_images[path] = problem
    bad_captions = [i for i, caps in enumerate(ds["captions"]) if not all(_caption_ok(c) for c in caps)]
    if not bad_images and not bad_captions:
        return ds
    lines = [f"  {path}: {why}" for path, why in list(bad_images.items())[:5]]
    lines += [
        f"  {ds[i]['image_path']}: caption empty after cleaning {ds[i]['captions']!r}"
        for i in bad_captions[:5]
    ]
    summary = f"{name}: {len(bad_images)} bad images and {len(bad_captions)} images with empty captions"
    if policy == "error":
        raise ValueError(summary + ", e.g.:\n" + "\n".join(lines) + "\n(set bad_data: skip to drop them)")
    logger.warning("%s; skipping them, e.g.:\n%s", summary, "\n".join(lines))
    drop = set(bad_captions) | {i for i, p in enumerate(ds["image_path"]) if p in bad_images}
    return ds.select([i for i in range(len(ds)) if i not in drop])


def load_split(cfg: TagClipTrainConfig, split: str):
    """One split as an image-level ``datasets.Dataset``, validated according to ``bad_data``."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    skip = cfg.bad_data == "skip"
    ds = load_dataset_split(
        cfg.data_dir, split, image_dir=_image_dir(cfg), check_files=not skip, skip_bad=skip
    )
    if len(ds) == 0:
        raise ValueError(f"{cfg.data_dir} [{split}] has no usable entries")
    return validate_images(ds, cfg.bad_data, f"{cfg.data_dir} [{split}]")


def prepare_data(cfg: TagClipTrainConfig) -> DataSplits:
    """Load train/test, carve the validation split from train by identity (none for fraction 0), remap ids."""
    from modeling_tagclip.data.text_retrieval import remap_ids, split_validation

    ensure_synthetic(cfg)
    train_full = load_split(cfg, cfg.train_split)
    validation = None
    if cfg.validation_fraction > 0:
        parts = split_validation(train_full, cfg.validation_fraction, seed=cfg.seed)
        train_full, validation = parts["train"], parts["validation"]
    train, mapping = remap_ids(train_full)
    return DataSplits(train, validation, load_split(cfg, cfg.test_split), mapping)


# ----------------------------------------------------------------------------- augmentation (TAG-PR transforms)


def _random_resized_crop(img: Image.Image, rng: np.random.Generator, scale=(0.9, 1.0)) -> Image.Image:
    """torchvision ``RandomResizedCrop(size, scale)`` with ratio (3/4, 4/3), back to the input size."""
    width, height = img.size
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return img.resize((width, height), Image.BILINEAR, box=(left, top, left + w, top + h))
    return img


def _color_jitter(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """``ColorJitter(0.1, 0.1, 0.1, 0)``: brightness, contrast, saturation in random order."""
    enhancers = [ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color]
    for index in rng.permutation(3):
        img = enhancers[index](img).enhance(rng.uniform(0.9, 1.1))
    return img


def _random_erasing(img: Image.Image, rng: np.random.Generator, scale=(0.10, 0.20)) -> Image.Image:
    """``RandomErasing(p=0.5, scale=(0.1, 0.2), ratio=(0.3, 3.3), value=0)`` before normalisation: black box."""
    if rng.random() >= 0.5:
        return img
    width, height = img.size
    for _ in range(10):
        target = width * height * rng.uniform(*scale)
        ratio = math.exp(rng.uniform(math.log(0.3), math.log(3.3)))
        h, w = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if h < height and w < width:
            top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            img = img.copy()
            ImageDraw.Draw(img).rectangle((left, top, left + w - 1, top + h - 1), fill=(0, 0, 0))
            return img
    return img


AUGMENTATIONS = (
    _color_jitter,
    lambda img, rng: img.rotate(rng.uniform(-15, 15), resample=Image.NEAREST, fillcolor=(0, 0, 0)),
    _random_resized_crop,
    lambda img, rng: ImageOps.grayscale(img).convert("RGB") if rng.random() < 0.1 else img,
    lambda img, rng: ImageOps.mirror(img) if rng.random() < 0.5 else img,
    _random_erasing,
)


def augment_image(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """TAG-PR training augmentation: two ops drawn with replacement from the six transforms."""
    for index in rng.choice(len(AUGMENTATIONS), size=2, replace=True):
        img = AUGMENTATIONS[index](img, rng)
    return img


class PairDataset(torch.utils.data.Dataset):
    """(image, caption) pairs by ``(index, epoch)`` (``EpochSampler``); the image is resized (bilinear) and
    augmented with an RNG of (seed, epoch, index)."""

    def __init__(self, pairs, image_size: Sequence[int], augment: bool, seed: int):
        self.pairs = pairs
        self.size = (int(image_size[1]), int(image_size[0]))  # PIL (width, height)
        self.augment = augment
        self.seed = seed

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        from modeling_tagclip.evaluation.text_retrieval import load_image

        index, epoch = (int(v) for v in item)
        row = self.pairs[index]
        img = load_image(row["image_path"]).resize(self.size, Image.BILINEAR)
        if self.augment:
            img = augment_image(img, np.random.default_rng([self.seed, epoch, index]))
        return {"image": img, "caption": row["caption"], "label": row["label"], "view": row["view"]}


class PairCollator:
    """Batch of pairs → ``pixel_values`` as uint8 [B, 3, H, W] (4x fewer bytes through workers, pinned memory
    and the host-to-device copy; `normalize_pixels` finishes them on the device), tokenised captions,
    ``view_labels`` and ``person_ids``. The images are already at the training size: no second resize."""

    def __init__(self, processor, max_length: int, image_size: Sequence[int]):
        self.processor = processor
        self.max_length = max_length
        self.size = (int(image_size[1]), int(image_size[0]))  # PIL (width, height)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        for it in items:
            if it["image"].size != self.size or it["image"].mode != "RGB":
                got = f"{it['image'].mode} {it['image'].size}"
                raise ValueError(f"training image is {got}, expected RGB of (width, height) {self.size}")
        pixels = np.stack([np.asarray(it["image"]) for it in items])  # [B, H, W, 3] uint8
        text = self.processor(text=[it["caption"] for it in items], max_length=self.max_length)
        return {
            "pixel_values": torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(),
            "input_ids": text["input_ids"],
            "view_labels": view_label_ids([int(it["view"]) for it in items]),
            "person_ids": torch.tensor([int(it["label"]) for it in items], dtype=torch.long),
        }


def pixel_table(image_processor) -> torch.Tensor:
    """[3, 256] float32: the image processor's own rescale + normalise of every uint8 value, per channel, so a
    lookup in it gives the processor's ``pixel_values`` bit for bit."""
    ramp = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()
    rescaled = image_processor.rescale(ramp, image_processor.rescale_factor)
    table = image_processor.normalize(rescaled, image_processor.image_mean, image_processor.image_std)
    return torch.from_numpy(np.ascontiguousarray(table[:, 0, :], dtype=np.float32))


def normalize_pixels(pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] → float ``pixel_values`` through ``pixel_table`` on ``pixels``' device (a gather per
    channel, no host sync); float input is returned as is."""
    if pixels.dtype != torch.uint8:
        return pixels
    table = table.to(pixels.device)  # a no-op once there
    return torch.stack([table[c][pixels[:, c].long()] for c in range(pixels.shape[1])], dim=1)


def make_train_loader(
    cfg: TagClipTrainConfig, train_ds, processor
) -> tuple[torch.utils.data.DataLoader, PairDataset]:
    """DataLoader over (image, caption) pairs of the image-level ``train_ds`` (drop_last, per-epoch shuffle)."""
    from modeling_tagclip.data.text_retrieval import pairs_view

    pairs = pairs_view(train_ds)
    labels = dict(zip(range(len(train_ds)), train_ds["label"], strict=True))
    pairs = pairs.add_column("label", [labels[i] for i in pairs["image_index"]])
    dataset = PairDataset(pairs, cfg.image_size, cfg.augment, cfg.seed)
    batch = cfg.per_device_batch_size
    if len(dataset) < batch:
        raise ValueError(f"only {len(dataset)} training pairs for per_device_batch_size {batch}")
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        sampler=EpochSampler(len(dataset), cfg.seed),
        drop_last=True,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory,
        persistent_workers=cfg.persistent_workers,
        collate_fn=PairCollator(processor, cfg.text_max_length, cfg.image_size),
    )
    return loader, dataset
