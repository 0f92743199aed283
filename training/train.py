"""Train TAG-CLIP with accelerate on CPU, one GPU or many (recipe: docs/tagclip-reference.md §4-5).

With no arguments, ``accelerate launch training/train.py`` renders the synthetic aerial-ground set into
``data/synthetic`` (if absent), trains a small TAG-CLIP from scratch with ``training/configs/default.yaml``,
selects the best epoch on a validation split carved from train by identity, evaluates it on the test split and
prints R@1/mAP. Outputs in ``--output_dir``: ``best/`` (``save_pretrained`` + processor; ``best/adapter`` with
``--lora``), ``checkpoints/step_N`` (``accelerator.save_state``), ``metrics.jsonl``, ``eval_results.json``,
``training_curves.png`` and ``retrieval_grid.png``.

Examples::

    accelerate launch training/train.py
    accelerate launch training/train.py --config training/configs/tag-pedes.yaml --init_from models/clip-init
    accelerate launch training/train.py --resume_from_checkpoint latest
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 training/train.py   # 2 gloo ranks
    accelerate launch training/train.py --task reid      # ViSA re-ID (training/train_reid.py's options)

With several processes the contrastive losses (N-ITC, R-ITC) use the all-gathered batch as negatives, with
gradients; the per-image terms (ID, view, orthogonal) stay local.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (accelerate launch): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import yaml
from PIL import Image, ImageDraw, ImageEnhance, ImageOps

logger = logging.getLogger("training.train")

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm)
TSE_PATTERN = re.compile(r"(^|\.)(visual_tse|textual_tse)\.")
LOSS_TERMS = ("loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho")
LORA_ATTENTION = r"self_attn\.(q_proj|k_proj|v_proj|out_proj)"
LORA_EXPERTS = r"mlp\.experts\.\d+\.(fc1|fc2)"
LORA_HEADS = ["visual_tse", "textual_tse", "classifier", "img_router", "fea_router"]

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "output_dir": "outputs/tagclip-synthetic",
    "data_dir": "data/synthetic",
    "image_dir": None,
    "train_split": "train",
    "test_split": "test",
    "synthetic": {"num_identities": 260, "seed": 0, "image_size": [128, 64]},
    "validation_fraction": 0.1,
    "bad_data": "error",
    "image_size": [128, 64],
    "init_from": None,
    "model": {},
    "num_train_epochs": 10,
    "max_steps": -1,
    "per_device_batch_size": 64,
    "learning_rate": 1.0e-4,
    "lr_start": 1.0e-6,
    "lr_end": 5.0e-6,
    "warmup_epochs": 1.0,
    "weight_decay": 0.02,
    "adam_betas": [0.9, 0.98],
    "adam_eps": 1.0e-8,
    "tse_lr_ratio": 10.0,
    "softlabel_ratio": None,
    "freeze_patch_embedding": True,
    "augment": True,
    "text_max_length": 77,
    "gather_negatives": True,
    "max_grad_norm": None,
    "num_workers": 0,
    "mixed_precision": None,
    "save_steps": 500,
    "save_total_limit": 2,
    "eval_every_epochs": 1,
    "eval_batch_size": 64,
    "logging_steps": 1,
    "plots": True,
    "lora": {"enabled": False, "r": 16, "alpha": 32, "dropout": 0.0, "target_experts": False, "merge": False},
}
FLOAT_KEYS = (
    "learning_rate",
    "lr_start",
    "lr_end",
    "warmup_epochs",
    "weight_decay",
    "adam_eps",
    "tse_lr_ratio",
)


# ----------------------------------------------------------------------------- configuration


def _deep_update(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = (
            _deep_update(out[key], value)
            if isinstance(out.get(key), dict) and isinstance(value, dict)
            else value
        )
    return out


def _set_dotted(cfg: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c``; a dict value is merged into an existing dict (``--set model={...}`` keeps other keys)."""
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    if isinstance(node.get(leaf), dict) and isinstance(value, dict):
        value = _deep_update(node[leaf], value)
    node[leaf] = value


def load_config(
    path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """DEFAULTS <- YAML file (default: configs/default.yaml) <- dotted ``overrides``; validated."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    loaded = yaml.safe_load(path.read_text()) or {}
    unknown = set(loaded) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"{path}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = _deep_update(DEFAULTS, loaded)
    for key, value in (overrides or {}).items():
        _set_dotted(cfg, key, value)
    for key in FLOAT_KEYS:
        cfg[key] = float(cfg[key])
    cfg["adam_betas"] = [float(b) for b in cfg["adam_betas"]]
    if cfg["bad_data"] not in ("error", "skip"):
        raise ValueError(f"bad_data must be 'error' or 'skip', got {cfg['bad_data']!r}")
    if int(cfg["per_device_batch_size"]) < 2:
        raise ValueError("per_device_batch_size must be >= 2 (contrastive losses and BatchNorm need pairs)")
    return cfg


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """CLI → (args, config)."""
    p = argparse.ArgumentParser(description="Train TAG-CLIP (accelerate).")
    p.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG})")
    for key, kind in (
        ("output_dir", str), ("data_dir", str), ("init_from", str), ("max_steps", int),
        ("num_train_epochs", int), ("seed", int), ("per_device_batch_size", int), ("learning_rate", float),
        ("save_steps", int), ("mixed_precision", str),
    ):  # fmt: skip
        p.add_argument(f"--{key}", type=kind, default=None)
    p.add_argument(
        "--resume_from_checkpoint", nargs="?", const="latest", default=None, help="PATH or 'latest'"
    )
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    p.add_argument(
        "--merge_lora", action="store_true", help="with --lora: also write a merged model to best/"
    )
    p.add_argument("--eval_only", action="store_true", help="evaluate OUTPUT_DIR/best on the test split")
    p.add_argument("--stop_after_steps", type=int, default=None, help="stop as if interrupted (resume tests)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key, dotted")
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key] = _parse_value(value)
    for key in ("output_dir", "data_dir", "init_from", "max_steps", "num_train_epochs", "seed",
                "per_device_batch_size", "learning_rate", "save_steps", "mixed_precision"):  # fmt: skip
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.lora:
        overrides["lora.enabled"] = True
    if args.merge_lora:
        overrides["lora.merge"] = True
    return args, load_config(args.config, overrides)


# ----------------------------------------------------------------------------- data


@dataclass
class DataSplits:
    """Image-level datasets (one row per image) and the training identity mapping."""

    train: Any
    validation: Any
    test: Any
    id_mapping: dict[int, int]


def _image_dir(cfg: dict) -> Path | None:
    if cfg["image_dir"]:
        return Path(cfg["image_dir"])
    root = Path(cfg["data_dir"])
    return root / "images" if (root / "images").is_dir() else None


def ensure_synthetic(cfg: dict) -> None:
    """Render the synthetic set into ``data_dir`` if it holds no annotations and ``synthetic`` is configured."""
    root = Path(cfg["data_dir"])
    if (root / f"{cfg['train_split']}_reid.json").is_file() or not cfg["synthetic"]:
        return
    from modeling_tagclip.data.synthetic import generate_dataset

    opts = dict(cfg["synthetic"])
    opts["image_size"] = tuple(opts.get("image_size", cfg["image_size"]))
    logger.info("rendering the synthetic set into %s (%s)", root, opts)
    generate_dataset(root, **opts)


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


def load_split(cfg: dict, split: str):
    """One split as an image-level ``datasets.Dataset``, validated according to ``bad_data``."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    skip = cfg["bad_data"] == "skip"
    ds = load_dataset_split(
        cfg["data_dir"], split, image_dir=_image_dir(cfg), check_files=not skip, skip_bad=skip
    )
    if len(ds) == 0:
        raise ValueError(f"{cfg['data_dir']} [{split}] has no usable entries")
    return validate_images(ds, cfg["bad_data"], f"{cfg['data_dir']} [{split}]")


def prepare_data(cfg: dict) -> DataSplits:
    """Load train/test, carve the validation split from train by identity, remap training ids to 0..C-1."""
    from modeling_tagclip.data.text_retrieval import remap_ids, split_validation

    ensure_synthetic(cfg)
    train_full = load_split(cfg, cfg["train_split"])
    parts = split_validation(train_full, cfg["validation_fraction"], seed=cfg["seed"])
    train, mapping = remap_ids(parts["train"])
    return DataSplits(train, parts["validation"], load_split(cfg, cfg["test_split"]), mapping)


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
    """Spec §5 training augmentation: two ops drawn with replacement from the six TAG-PR transforms."""
    for index in rng.choice(len(AUGMENTATIONS), size=2, replace=True):
        img = AUGMENTATIONS[index](img, rng)
    return img


class PairDataset(torch.utils.data.Dataset):
    """(image, caption) pairs; the image is resized (bilinear) and augmented with an RNG of (seed, epoch, index)."""

    def __init__(self, pairs, image_size: Sequence[int], augment: bool, seed: int):
        self.pairs = pairs
        self.size = (int(image_size[1]), int(image_size[0]))  # PIL (width, height)
        self.augment = augment
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from modeling_tagclip.evaluation.text_retrieval import load_image

        row = self.pairs[int(index)]
        img = load_image(row["image_path"]).resize(self.size, Image.BILINEAR)
        if self.augment:
            img = augment_image(img, np.random.default_rng([self.seed, self.epoch, int(index)]))
        return {"image": img, "caption": row["caption"], "label": row["label"], "view": row["view"]}


class PairCollator:
    """Batch of pairs → processor tensors + ``person_ids``."""

    def __init__(self, processor, max_length: int):
        self.processor = processor
        self.max_length = max_length

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.processor(
            images=[it["image"] for it in items],
            text=[it["caption"] for it in items],
            views=[int(it["view"]) for it in items],
            max_length=self.max_length,
        )
        return {
            "pixel_values": batch["pixel_values"],
            "input_ids": batch["input_ids"],
            "view_labels": batch["view_labels"],
            "person_ids": torch.tensor([int(it["label"]) for it in items], dtype=torch.long),
        }


class EpochSampler(torch.utils.data.Sampler):
    """Deterministic shuffle per epoch: permutation from (seed, epoch); the same on every process."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist())


def make_train_loader(cfg: dict, train_ds, processor) -> tuple[torch.utils.data.DataLoader, PairDataset]:
    """DataLoader over (image, caption) pairs of the image-level ``train_ds`` (drop_last, per-epoch shuffle)."""
    from modeling_tagclip.data.text_retrieval import pairs_view

    pairs = pairs_view(train_ds)
    labels = dict(zip(range(len(train_ds)), train_ds["label"], strict=True))
    pairs = pairs.add_column("label", [labels[i] for i in pairs["image_index"]])
    dataset = PairDataset(pairs, cfg["image_size"], cfg["augment"], cfg["seed"])
    batch = int(cfg["per_device_batch_size"])
    if len(dataset) < batch:
        raise ValueError(f"only {len(dataset)} training pairs for per_device_batch_size {batch}")
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        sampler=EpochSampler(len(dataset), cfg["seed"]),
        drop_last=True,
        num_workers=int(cfg["num_workers"]),
        collate_fn=PairCollator(processor, int(cfg["text_max_length"])),
    )
    return loader, dataset


# ----------------------------------------------------------------------------- model and optimiser


ARCHITECTURE_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size", "num_channels",
    "vocab_size", "max_position_embeddings", "projection_dim", "tse_embed_dim", "num_experts", "moe_layers",
    "block_type", "use_view_token", "use_tse", "image_size",
}  # fmt: skip


def _apply_overrides(config, overrides: dict[str, Any], where: str = "") -> None:
    """Set config attributes from ``model`` overrides; shape-defining keys of a pretrained config are kept."""
    for key, value in overrides.items():
        if isinstance(value, dict) and key in ("vision_config", "text_config"):
            _apply_overrides(getattr(config, key), value, f"{key}.")
        elif key in ARCHITECTURE_KEYS:
            if getattr(config, key, None) != value and key != "image_size":
                logger.warning(
                    "init_from: keeping %s%s=%r (config asks %r)", where, key, getattr(config, key), value
                )
        else:
            setattr(config, key, value)


def build_model(cfg: dict, num_identities: int):
    """TagClipModel from scratch (``model`` kwargs) or from ``init_from`` (a converted folder), ID head sized C."""
    from modeling_tagclip import TagClipConfig, TagClipModel

    height, width = (int(v) for v in cfg["image_size"])
    overrides = copy.deepcopy(cfg["model"])
    if cfg["init_from"]:
        config = TagClipConfig.from_pretrained(cfg["init_from"])
        _apply_overrides(config, overrides)
        config.num_identities = num_identities
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = TagClipModel.from_pretrained(
                cfg["init_from"], config=config, ignore_mismatched_sizes=True
            )
        if list(config.vision_config.image_hw) != [height, width]:
            model.set_image_size(height, width)
        return model
    vision = dict(overrides.pop("vision_config", {}) or {})
    vision["image_size"] = [height, width]
    config = TagClipConfig(
        vision_config=vision,
        text_config=overrides.pop("text_config", None),
        num_identities=num_identities,
        **overrides,
    )
    torch.manual_seed(cfg["seed"])
    return TagClipModel(config)


def apply_lora(model, cfg: dict, base_dir: Path | None = None):
    """Wrap with peft LoRA on the attention projections of both towers (+ experts' fc1/fc2 if configured)."""
    from peft import LoraConfig, get_peft_model

    lora = cfg["lora"]
    targets = LORA_ATTENTION + (f"|{LORA_EXPERTS}" if lora["target_experts"] else "")
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    heads = [h for h in LORA_HEADS if h in present]
    if base_dir is not None:  # from scratch: the adapter needs its base weights on disk
        model.save_pretrained(base_dir)
        model.config._name_or_path = str(base_dir)
    config = LoraConfig(
        r=int(lora["r"]),
        lora_alpha=int(lora["alpha"]),
        lora_dropout=float(lora["dropout"]),
        target_modules=rf".*(text_model|vision_model)\.encoder\.layers\.\d+\.({targets})",
        modules_to_save=heads,
    )
    return get_peft_model(model, config)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def param_groups(model, lr: float, weight_decay: float, tse_ratio: float) -> list[dict[str, Any]]:
    """Reference groups: no decay for ndim<2 / bias / norm params; ×``tse_ratio`` lr for the TSE heads."""
    norm_params = {
        id(p) for m in model.modules() if isinstance(m, NORM_TYPES) for p in m.parameters(recurse=False)
    }
    groups: dict[tuple[bool, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = not (param.ndim < 2 or "bias" in name or id(param) in norm_params)
        tse = bool(TSE_PATTERN.search(name))
        group = groups.setdefault(
            (decay, tse),
            {
                "params": [],
                "weight_decay": weight_decay if decay else 0.0,
                "lr": lr * (tse_ratio if tse else 1.0),
                "group_name": f"{'decay' if decay else 'no_decay'}{'_tse' if tse else ''}",
            },
        )
        group["params"].append(param)
    return list(groups.values())


def cosine_schedule(base: float, final: float, total: int, warmup: int, start: float) -> np.ndarray:
    """Per-iteration lr (TAG-PR ``cosine_scheduler``): linspace warmup start→base, then cosine base→final."""
    warmup = max(0, min(warmup, total))
    ramp = np.linspace(start, base, warmup) if warmup else np.zeros(0)
    iters = np.arange(total - warmup)
    cosine = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / max(1, len(iters))))
    return np.concatenate([ramp, cosine])


def softlabel_alpha(ratio: float, epoch: int, index: int, steps_per_epoch: int) -> float:
    """α ramp: ratio·i/len(loader) in epoch 0, then ratio (docs/tagclip-reference.md §4)."""
    return ratio * index / steps_per_epoch if epoch == 0 else ratio


# ----------------------------------------------------------------------------- training step


def _gather(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-gather along dim 0 keeping gradients (identity on one process)."""
    if world_size == 1:
        return tensor
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cat(all_gather(tensor.contiguous()))


def compute_loss(model, base_model, batch: dict, alpha: float, world_size: int) -> tuple[torch.Tensor, dict]:
    """Eq. 11 with N-ITC/R-ITC over the (gathered) global batch; ID/view/ortho terms from the local batch."""
    from modeling_tagclip.tagclip.losses import (
        clamped_scale,
        identity_targets,
        nitc_loss,
        ritc_loss,
        total_loss,
    )

    out = model(**batch, return_loss=True, softlabel_alpha=alpha)
    config = base_model.config
    ids = batch["person_ids"]
    ids_all = _gather(ids, world_size) if world_size > 1 else ids
    targets = identity_targets(ids, ids_all)
    scale = clamped_scale(base_model.logit_scale, config.logit_scale_max)
    pairs = [(out.image_embeds, out.text_embeds)]
    if out.image_local_embeds is not None:
        pairs.append((out.image_local_embeds, out.text_local_embeds))
    pairs = [(i.float(), t.float()) for i, t in pairs]
    gathered = [(_gather(i, world_size), _gather(t, world_size)) for i, t in pairs]
    terms = {
        "loss_nitc": config.nitc_weight
        * sum(
            nitc_loss(i, t, ia, ta, targets, scale, alpha)
            for (i, t), (ia, ta) in zip(pairs, gathered, strict=True)
        ),
        "loss_ritc": config.ritc_weight
        * sum(
            ritc_loss(i, t, ia, ta, targets, scale, config.ritc_eps)
            for (i, t), (ia, ta) in zip(pairs, gathered, strict=True)
        ),
        "loss_id": out.loss_id,
        "loss_view": out.loss_view,
        "loss_ortho": out.loss_ortho,
    }
    loss = total_loss(terms)
    logs = {k: v.detach().float() for k, v in terms.items() if v is not None}
    if out.view_accuracy is not None:
        logs["view_accuracy"] = out.view_accuracy.detach().float()
    return loss, logs


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the global torch RNG for one step (dropout, gate noise): resume-exact, rank-specific."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


# ----------------------------------------------------------------------------- state, logging, checkpoints


@dataclass
class TrainState:
    """Counters saved with every checkpoint (registered with ``accelerator.register_for_checkpointing``)."""

    step: int = 0
    best_metric: float = -1.0
    best_step: int = -1
    steps_per_epoch: int = 0
    last_eval_step: int = -1

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def make_jsonl_tracker_class():
    """An accelerate ``GeneralTracker`` appending records to ``metrics.jsonl`` (built lazily: accelerate import)."""
    from accelerate.tracking import GeneralTracker

    class JsonlTracker(GeneralTracker):
        name = "jsonl"
        requires_logging_directory = True

        def __init__(self, path: str | os.PathLike, keep_until_step: int | None = None):
            super().__init__()
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if keep_until_step is None:
                self.path.write_text("")
            elif self.path.exists():  # resumed: drop records after the restored step
                lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
                kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= keep_until_step]
                self.path.write_text("".join(ln + "\n" for ln in kept))

        @property
        def tracker(self):
            return self.path

        def store_init_configuration(self, values: dict) -> None:
            (self.path.parent / "config.json").write_text(json.dumps(values, indent=2, default=str) + "\n")

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    return JsonlTracker


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints ``checkpoints/step_N``, oldest first."""
    root = Path(output_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve_resume(output_dir: str | os.PathLike, resume: str | None) -> Path | None:
    """Checkpoint to resume from: a path, or the newest one for ``latest`` (None if there is none yet)."""
    if resume is None:
        return None
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume_from_checkpoint: no checkpoint directory {path}")
        return path
    found = checkpoint_dirs(output_dir)
    return found[-1] if found else None


def save_checkpoint(accelerator, output_dir: str | os.PathLike, step: int, keep: int) -> Path:
    """``save_state`` into ``checkpoints/step_N`` (written to a temp dir, renamed when complete); keep the last N."""
    root = Path(output_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f"tmp_step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoint_dirs(output_dir)[: -max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# ----------------------------------------------------------------------------- evaluation and saving


def validate(accelerator, model, processor, dataset, cfg: dict) -> dict | None:
    """Validation retrieval metrics on the main process (others wait)."""
    from modeling_tagclip.evaluation.text_retrieval import evaluate_model

    result = None
    if accelerator.is_main_process:
        result = evaluate_model(
            accelerator.unwrap_model(model), processor, dataset, batch_size=int(cfg["eval_batch_size"]),
            probe=False, progress=False, max_length=int(cfg["text_max_length"]),
        )  # fmt: skip
    accelerator.wait_for_everyone()
    return result


def save_best(accelerator, model, processor, cfg: dict) -> None:
    """``best/``: full model + processor; with LoRA ``best/adapter`` and (``merge``) a merged model in ``best/``."""
    if not accelerator.is_main_process:
        return
    best = Path(cfg["output_dir"]) / "best"
    shutil.rmtree(best, ignore_errors=True)
    unwrapped = accelerator.unwrap_model(model)
    if cfg["lora"]["enabled"]:
        unwrapped.save_pretrained(best / "adapter")
        processor.save_pretrained(best / "adapter")
        if cfg["lora"]["merge"]:
            merged = copy.deepcopy(unwrapped).merge_and_unload()
            merged.save_pretrained(best)
            processor.save_pretrained(best)
    else:
        unwrapped.save_pretrained(best)
        processor.save_pretrained(best)


def best_model_path(cfg: dict) -> Path:
    best = Path(cfg["output_dir"]) / "best"
    if cfg["lora"]["enabled"] and not cfg["lora"]["merge"]:
        return best / "adapter"
    return best


def config_summary(cfg: dict, model, splits: DataSplits | None) -> dict[str, Any]:
    summary = {"config": cfg}
    if model is not None:
        trainable, total = count_parameters(model)
        summary.update({"trainable_parameters": trainable, "total_parameters": total})
    if splits is not None:
        summary.update(
            {
                "train_images": len(splits.train),
                "train_identities": len(splits.id_mapping),
                "validation_images": len(splits.validation),
                "test_images": len(splits.test),
            }
        )
    return summary


def final_evaluation(cfg: dict, test_ds, extra: dict[str, Any]) -> dict[str, Any]:
    """Reload the best model from disk, evaluate it on the test split, write eval_results.json and plots."""
    from modeling_tagclip.evaluation.text_retrieval import load_model, run_retrieval, summarize

    output_dir = Path(cfg["output_dir"])
    model, processor = load_model(best_model_path(cfg), "cuda" if torch.cuda.is_available() else "cpu")
    run = run_retrieval(model, processor, test_ds, batch_size=int(cfg["eval_batch_size"]))
    result = {**summarize(run), **extra}
    (output_dir / "eval_results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if cfg["plots"]:
        from modeling_tagclip.plots import retrieval_grid, training_curves

        if (output_dir / "metrics.jsonl").is_file():
            training_curves(output_dir / "metrics.jsonl", output_dir / "training_curves.png")
        retrieval_grid(run, output_dir / "retrieval_grid.png")
    return result


# ----------------------------------------------------------------------------- main loop


def make_accelerator(cfg: dict, keep_until_step: int | None):
    """Accelerator (DDP find_unused_parameters) + trackers: metrics.jsonl (main process), TensorBoard if installed.

    The Accelerator is built before anything touches ``PartialState``: it reads ``ACCELERATE_USE_CPU`` and only
    then picks gloo for several CPU processes.
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import ProjectConfiguration

    output_dir = Path(cfg["output_dir"])
    try:
        import tensorboard  # noqa: F401

        trackers = ["tensorboard"]
    except ImportError:
        trackers = []
    accelerator = Accelerator(
        mixed_precision=cfg["mixed_precision"],
        log_with=trackers or None,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / "logs")
        ),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    if accelerator.is_main_process:
        accelerator.log_with.append(make_jsonl_tracker_class()(output_dir / "metrics.jsonl", keep_until_step))
    if accelerator.state.dynamo_plugin.backend.value.lower() != "no":
        avoid_autograd_cache_bug()
    return accelerator


def avoid_autograd_cache_bug() -> None:
    """Turn off the AOTAutograd cache on torch 2.13 when compiling (``accelerate launch --dynamo_backend``).

    With it on, inductor replaying this model's view outputs hit a use-after-free (pytorch/pytorch#185630):
    a garbage-shape RuntimeError or a segfault in the first training step. Without it the graphs run correctly.
    """
    import torch._functorch.config as functorch_config

    if torch.__version__.startswith("2.13") and functorch_config.enable_autograd_cache:
        functorch_config.enable_autograd_cache = False
        logger.info("torch.compile: AOTAutograd cache off (torch 2.13 bug pytorch/pytorch#185630)")


def _log_step(accelerator, logs: dict, lr: float, alpha: float, scale: float, epoch: int, step: int) -> dict:
    keys = sorted(logs)
    reduced = accelerator.reduce(torch.stack([logs[k] for k in keys]).to(accelerator.device), "mean")
    record = {k: float(v) for k, v in zip(keys, reduced.tolist(), strict=True)}
    record["loss"] = sum(record[k] for k in LOSS_TERMS if k in record)
    record.update({"kind": "train", "lr": lr, "alpha": alpha, "logit_scale": scale, "epoch": epoch})
    accelerator.log(record, step=step)
    return record


def _peek_step(path: Path | None) -> int | None:
    """Step stored in a checkpoint (to trim metrics.jsonl before the tracker opens it)."""
    if path is None:
        return None
    for pkl in sorted(path.glob("custom_checkpoint_*.pkl")):
        state = torch.load(pkl, map_location="cpu", weights_only=False)
        if isinstance(state, dict) and "best_metric" in state:
            return int(state["step"])
    return None


@dataclass
class Trainer:
    """Everything a run holds: accelerate objects, data, schedule and counters."""

    cfg: dict
    accelerator: Any
    model: Any
    base_model: Any
    processor: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    sampler: EpochSampler
    pair_ds: PairDataset
    splits: DataSplits
    state: TrainState
    total_steps: int
    epochs: int
    softlabel_ratio: float

    @property
    def steps_per_epoch(self) -> int:
        return self.state.steps_per_epoch


def _build_model_for_run(cfg: dict, accelerator, num_identities: int):
    """Model (+ LoRA), patch embedding frozen as configured; prints the trainable-parameter count."""
    model = build_model(cfg, num_identities)
    if cfg["freeze_patch_embedding"]:
        model.vision_model.embeddings.patch_embedding.requires_grad_(False)
    if cfg["lora"]["enabled"]:
        base_dir = Path(cfg["output_dir"]).resolve() / "base" if not cfg["init_from"] else None
        with accelerator.main_process_first():
            model = apply_lora(model, cfg, base_dir if accelerator.is_main_process else None)
        if base_dir is not None:
            model.peft_config["default"].base_model_name_or_path = str(base_dir)
    trainable, total = count_parameters(model)
    accelerator.print(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    return model


def setup(cfg: dict, resume: str | None) -> Trainer:
    """Accelerator, data, model, optimiser, per-iteration schedule; restores a checkpoint when resuming."""
    from accelerate.utils import set_seed

    from modeling_tagclip import TagClipProcessor

    resume_dir = resolve_resume(cfg["output_dir"], resume)
    accelerator = make_accelerator(cfg, _peek_step(resume_dir) if resume else None)
    set_seed(cfg["seed"])
    with accelerator.main_process_first():
        splits = prepare_data(cfg)
    processor = TagClipProcessor.from_defaults(*(int(v) for v in cfg["image_size"]))
    model = _build_model_for_run(cfg, accelerator, len(splits.id_mapping))
    loader, pair_ds = make_train_loader(cfg, splits.train, processor)
    sampler = loader.sampler
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg["learning_rate"], cfg["weight_decay"], cfg["tse_lr_ratio"]),
        lr=cfg["learning_rate"], betas=tuple(cfg["adam_betas"]), eps=cfg["adam_eps"],
    )  # fmt: skip
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    base_model = accelerator.unwrap_model(model)
    if cfg["lora"]["enabled"]:
        base_model = base_model.get_base_model()
    steps_per_epoch = len(loader)
    max_steps = int(cfg["max_steps"])
    total_steps = max_steps if max_steps > 0 else int(cfg["num_train_epochs"]) * steps_per_epoch
    warmup = round(cfg["warmup_epochs"] * steps_per_epoch)
    schedule = cosine_schedule(cfg["learning_rate"], cfg["lr_end"], total_steps, warmup, cfg["lr_start"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer, lambda i: float(schedule[min(i, total_steps - 1)] / cfg["learning_rate"])
    )
    state = TrainState(steps_per_epoch=steps_per_epoch)
    accelerator.register_for_checkpointing(scheduler, state)
    if accelerator.is_main_process:
        accelerator.init_trackers("tagclip", config=_flat_config(cfg))
    _restore(accelerator, resume_dir, resume, state, steps_per_epoch, cfg)
    ratio = cfg["softlabel_ratio"]
    ratio = base_model.config.softlabel_ratio if ratio is None else float(ratio)
    return Trainer(
        cfg, accelerator, model, base_model, processor, optimizer, scheduler, loader, sampler, pair_ds, splits,
        state, total_steps, math.ceil(total_steps / steps_per_epoch), ratio,
    )  # fmt: skip


def _restore(
    accelerator, resume_dir: Path | None, resume: str | None, state, steps_per_epoch: int, cfg
) -> None:
    if resume_dir is None:
        if resume:
            accelerator.print(f"no checkpoint in {cfg['output_dir']}/checkpoints: starting from scratch")
        return
    accelerator.print(f"resuming from {resume_dir}")
    accelerator.load_state(str(resume_dir))
    if state.steps_per_epoch != steps_per_epoch:
        raise ValueError(
            f"checkpoint has {state.steps_per_epoch} steps per epoch, this run {steps_per_epoch}: "
            "resume with the same data, batch size and number of processes"
        )


def train_step(t: Trainer, batch: dict, epoch: int) -> dict | None:
    """One optimisation step (loss over gathered negatives, backward, AdamW, schedule); logs the terms."""
    cfg, state, accelerator = t.cfg, t.state, t.accelerator
    index = state.step - epoch * t.steps_per_epoch
    alpha = softlabel_alpha(t.softlabel_ratio, epoch, index, t.steps_per_epoch)
    torch.manual_seed(_step_seed(cfg["seed"], state.step, accelerator.process_index))
    lr = t.optimizer.param_groups[0]["lr"] / _group_ratio(t.optimizer.param_groups[0], cfg)
    world = accelerator.num_processes if cfg["gather_negatives"] else 1
    loss, logs = compute_loss(t.model, t.base_model, batch, alpha, world)
    accelerator.backward(loss)
    if cfg["max_grad_norm"]:
        accelerator.clip_grad_norm_(t.model.parameters(), float(cfg["max_grad_norm"]))
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    if state.step % int(cfg["logging_steps"]) and state.step != 1:
        return None
    scale = float(t.base_model.logit_scale.detach().exp())
    return _log_step(accelerator, logs, lr, alpha, scale, epoch, state.step)


def train_epoch(t: Trainer, epoch: int, progress, stop_after_steps: int | None) -> bool:
    """Train one epoch (skipping the batches a resumed checkpoint already saw); True if stopped early."""
    cfg, state = t.cfg, t.state
    skip = state.step - epoch * t.steps_per_epoch
    t.pair_ds.epoch = epoch
    t.sampler.set_epoch(epoch)
    t.loader.set_epoch(epoch)
    loader = t.accelerator.skip_first_batches(t.loader, skip) if skip else t.loader
    epoch_end = min((epoch + 1) * t.steps_per_epoch, t.total_steps)
    t.model.train()
    for batch in loader:
        if state.step >= epoch_end:
            break
        record = train_step(t, batch, epoch)
        if progress is not None:
            if record is not None:
                progress.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", epoch=epoch)
            progress.update(1)
        if cfg["save_steps"] and state.step % int(cfg["save_steps"]) == 0 and state.step != epoch_end:
            save_checkpoint(t.accelerator, cfg["output_dir"], state.step, int(cfg["save_total_limit"]))
        if stop_after_steps is not None and state.step >= stop_after_steps:
            return True
    if (epoch + 1) % int(cfg["eval_every_epochs"]) == 0 or state.step >= t.total_steps:
        _validate_and_select(t, epoch)
    save_checkpoint(t.accelerator, cfg["output_dir"], state.step, int(cfg["save_total_limit"]))
    return False


def finish(t: Trainer, train_time: float) -> dict[str, Any] | None:
    """Validate the final weights if not done yet, then evaluate the best model on test (main process)."""
    state, accelerator = t.state, t.accelerator
    if state.last_eval_step != state.step:
        _validate_and_select(t, t.epochs - 1)
    result = None
    if accelerator.is_main_process:
        extra = config_summary(t.cfg, t.model, t.splits)
        extra.update({"best_step": state.best_step, "best_validation_R@1": state.best_metric,
                      "train_time_s": round(train_time, 1), "num_processes": accelerator.num_processes})  # fmt: skip
        result = final_evaluation(t.cfg, t.splits.test, extra)
        print(
            f"test R@1 {result['R@1']:.2f}  R@5 {result['R@5']:.2f}  mAP {result['mAP']:.2f}  "
            f"mINP {result['mINP']:.2f}  (chance R@1 {result['chance_R@1']:.2f}; best step {state.best_step}; "
            f"train {train_time:.0f}s)"
        )
    return result


def shutdown(t: Trainer) -> None:
    """Drop the DDP-wrapped model before ``end_training`` destroys the process group.

    A gloo ``Reducer`` freed after ``destroy_process_group`` can deadlock in ``~ProcessGroupGloo`` at exit.
    """
    accelerator = t.accelerator
    accelerator.wait_for_everyone()
    t.model = t.base_model = t.optimizer = t.scheduler = t.loader = None
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def train(cfg: dict, resume: str | None = None, stop_after_steps: int | None = None) -> dict[str, Any] | None:
    """Run training (+ test evaluation of the best model); returns the test results on the main process."""
    t = setup(cfg, resume)
    start = time.time()
    progress = _progress_bar(t.accelerator.is_main_process, t.total_steps, t.state.step)
    interrupted = False
    for epoch in range(t.state.step // t.steps_per_epoch, t.epochs):
        interrupted = train_epoch(t, epoch, progress, stop_after_steps)
        if interrupted:
            break
    if progress is not None:
        progress.close()
    result = None
    if interrupted:
        t.accelerator.print(f"stopped after step {t.state.step} (--stop_after_steps)")
    else:
        result = finish(t, time.time() - start)
    shutdown(t)
    return result


def _group_ratio(group: dict, cfg: dict) -> float:
    return cfg["tse_lr_ratio"] if group.get("group_name", "").endswith("_tse") else 1.0


def _progress_bar(main: bool, total: int, initial: int):
    if not main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def _flat_config(cfg: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            flat.update(_flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = (
                value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
            )
    return flat


def _validate_and_select(t: Trainer, epoch: int) -> None:
    """Validation R@1 → log; save ``best/`` when it improves (ties keep the earlier model)."""
    accelerator, state, cfg = t.accelerator, t.state, t.cfg
    result = validate(accelerator, t.model, t.processor, t.splits.validation, cfg)
    if accelerator.is_main_process:
        metrics = {k: result[k] for k in ("R@1", "R@5", "R@10", "mAP", "mINP")}
        accelerator.log({"kind": "validation", "epoch": epoch, **metrics}, step=state.step)
        accelerator.print(
            f"epoch {epoch} step {state.step}: validation R@1 {result['R@1']:.2f} mAP {result['mAP']:.2f}"
        )
        if result["R@1"] > state.best_metric:
            state.best_metric, state.best_step = float(result["R@1"]), state.step
            save_best(accelerator, t.model, t.processor, cfg)
    best = torch.tensor(
        [state.best_metric, float(state.best_step)], dtype=torch.float64, device=accelerator.device
    )
    best = accelerator.reduce(best if accelerator.is_main_process else torch.zeros_like(best), "sum")
    state.best_metric, state.best_step = float(best[0]), int(best[1])
    state.last_eval_step = state.step
    accelerator.wait_for_everyone()


def eval_only(cfg: dict) -> dict[str, Any]:
    """Evaluate ``OUTPUT_DIR/best`` on the test split (main process)."""
    test = load_split(cfg, cfg["test_split"])
    result = final_evaluation(cfg, test, {"config": cfg})
    print(f"test R@1 {result['R@1']:.2f}  mAP {result['mAP']:.2f}  (chance R@1 {result['chance_R@1']:.2f})")
    return result


def split_task(argv: Sequence[str] | None) -> tuple[str, list[str]]:
    """`--task retrieval` (TAG-CLIP, default) or `--task reid` (ViSA), and the remaining arguments."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--task", choices=("retrieval", "reid"), default="retrieval")
    known, rest = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return known.task, rest


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    task, argv = split_task(argv)
    if task == "reid":
        from training.train_reid import main as reid_main

        return reid_main(argv)
    args, cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("accelerate", "datasets", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import modeling_tagclip  # noqa: F401  (registers the Auto classes)

    if args.eval_only:
        return eval_only(cfg)
    return train(cfg, resume=args.resume_from_checkpoint, stop_after_steps=args.stop_after_steps)


if __name__ == "__main__":
    main()
