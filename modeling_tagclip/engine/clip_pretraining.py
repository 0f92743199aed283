"""A short CLIP pre-training phase: a plain transformers ``CLIPModel`` of the training config's size, trained
briefly (symmetric InfoNCE) on the training split, saved, then converted to TAG-CLIP with
``modeling_tagclip.convert`` (``convert_hf_clip``, what ``tagclip convert hf-clip`` runs), as a fine-tuning init.

A run from scratch makes it when its recipe sets ``pretrain_clip.epochs`` (``clip_init_for_run``, into
``OUTPUT_DIR/clip-init``; the main job does); ``tagclip ablate --study init`` makes it once per results folder
(``pretrained_tagclip``).

The CLIP vision tower is square (``image_size`` = the longer side) and sees the non-square crops through
``interpolate_pos_encoding``; the conversion interpolates its position grid to the crop size. The converted
model keeps the config's ``moe_layers`` and ``tse_embed_dim`` so that only the initialisation differs from a
run from scratch. Nothing is written outside the folder it is given; finished folders are reused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modeling_tagclip.progress import Progress


def clip_config(
    model: dict[str, Any], image_size: Sequence[int], logit_scale_init_value: float | None = None
):
    """A transformers ``CLIPConfig`` with the vision/text sizes of a TAG-CLIP training config's ``model``.

    ``logit_scale_init_value``: ln of the initial similarity scale (None: transformers' ln(1/0.07)).
    """
    from transformers import CLIPConfig

    scale = {} if logit_scale_init_value is None else {"logit_scale_init_value": logit_scale_init_value}

    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    vision, text = model.get("vision_config", {}), model.get("text_config", {})
    return CLIPConfig(
        vision_config={
            **{k: vision[k] for k in sizes if k in vision},
            "patch_size": vision.get("patch_size", 16),
            "image_size": max(int(v) for v in image_size),
        },
        text_config={
            **{k: text[k] for k in sizes if k in text},
            "vocab_size": 49408,
            "max_position_embeddings": 77,
            "bos_token_id": 49406,
            "eos_token_id": 49407,
        },
        projection_dim=model.get("projection_dim", 512),
        **scale,
    )


def _batches(n: int, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    order = rng.permutation(n)
    return [order[i : i + size] for i in range(0, n - size + 1, size)]


def pretrain_clip(
    dataset,
    config,
    out_dir: Path,
    image_size: Sequence[int],
    *,
    epochs: int = 5,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    fast: bool = False,
    on_epoch: Callable[[int, float], None] | None = None,
    progress: bool = False,
) -> Path:
    """Train ``CLIPModel(config)`` on ``dataset`` rows (image_path, captions) at ``image_size``; save it.

    ``fast``: AdamW's fused kernel and captions padded to the batch's longest instead of 77 tokens (the same
    objective; a run's pre-training uses it, the init study keeps the loop its published numbers came from).
    ``on_epoch(epoch, mean_loss)`` is called after each epoch (one host sync per epoch). ``progress``: a line
    per epoch with its mean loss and the time left (a bar on a terminal).
    """
    from PIL import Image
    from transformers import CLIPModel

    from modeling_tagclip import TagClipProcessor

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = CLIPModel(config).train()
    height, width = (int(v) for v in image_size)
    processor = TagClipProcessor.from_defaults(height, width)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.02}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        fused=fast or None,
    )
    padding = {"padding": "longest"} if fast else {"padding": "max_length", "max_length": 77}
    paths, captions = list(dataset["image_path"]), list(dataset["captions"])
    if len(paths) < 2:
        raise ValueError(f"CLIP pre-training needs at least 2 training images, got {len(paths)}")
    batch_size = min(batch_size, len(paths))  # a split smaller than one batch trains on one batch of it all
    total = epochs * (len(paths) // batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / max(1, total // 10)) * 0.5 * (1 + math.cos(math.pi * s / total)),
    )
    bar = Progress("pre-training CLIP", total, "step", enabled=progress)
    track = on_epoch is not None or progress
    for epoch in range(epochs):
        epoch_loss, steps = torch.zeros(()), 0
        for idx in _batches(len(paths), batch_size, rng):
            images = [Image.open(paths[i]).convert("RGB") for i in idx]
            texts = [captions[i][int(rng.integers(len(captions[i])))] for i in idx]
            inputs = processor(images=images, text=texts, truncation=True, **padding)
            loss = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=inputs["pixel_values"],
                return_loss=True,
                interpolate_pos_encoding=True,
            ).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.update()
            if track:
                epoch_loss += loss.detach()
                steps += 1
        if track:
            mean = float(epoch_loss) / max(1, steps)
            bar.epoch(epoch, epochs, loss=mean)
            if on_epoch is not None:
                on_epoch(epoch, mean)
    bar.close()
    model.eval().save_pretrained(out_dir)
    return out_dir


def _make_init(
    load_dataset,
    out: Path,
    cfg,
    epochs: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    fast: bool = False,
    logit_scale_init_value: float | None = None,
    progress: bool = False,
) -> Path:
    """``OUT/tagclip-init`` from ``OUT/clip-hf`` (trained here on ``load_dataset()`` unless present)."""
    from modeling_tagclip.convert.tagclip import convert_hf_clip

    target = out / "tagclip-init"
    if (target / "config.json").is_file():
        return target
    hf_dir = out / "clip-hf"
    if not (hf_dir / "config.json").is_file():
        tmp = out / "clip-hf.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        config = clip_config(cfg.model, cfg.image_size, logit_scale_init_value)
        pretrain_clip(
            load_dataset(),
            config,
            tmp,
            cfg.image_size,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=cfg.seed,
            fast=fast,
            progress=progress,
        )
        os.replace(tmp, hf_dir)
    vision = cfg.model.get("vision_config", {})
    tmp = out / "tagclip-init.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    # no ID head: fine-tuning creates it at the training set's size (init_from may lack only the classifier)
    converter_log = logging.getLogger("modeling_tagclip.convert")
    level = converter_log.level
    converter_log.setLevel(logging.WARNING)  # its report is for `tagclip convert`; here one line says it
    try:
        convert_hf_clip(
            hf_dir,
            tmp,
            image_size=tuple(int(v) for v in cfg.image_size),
            moe_layers=vision.get("moe_layers"),
            tse_embed_dim=cfg.model.get("tse_embed_dim", 1024),
        )
    finally:
        converter_log.setLevel(level)
    os.replace(tmp, target)
    if progress:
        print(f"converted the pre-trained CLIP into the TAG-CLIP init {target}")
    return target


def pretrained_tagclip(data: Path, image_dir: Path, out: Path, cfg, epochs: int = 5) -> Path:
    """``OUT/tagclip-init``: CLIP of ``cfg``'s size pre-trained on ``DATA``'s train split, converted (made once)."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    return _make_init(lambda: load_dataset_split(data, "train", image_dir=image_dir), out, cfg, epochs)


def clip_init_for_run(dataset, cfg) -> Path:
    """``OUTPUT_DIR/clip-init/tagclip-init``: CLIP pre-trained on the run's training rows (``dataset``, validation
    identities excluded) with ``cfg.pretrain_clip``'s settings, converted. A resumed run reuses it when the
    recorded settings match; otherwise the folder (the run's own) is made again."""
    settings = {
        "epochs": cfg.pretrain_clip.epochs,
        "batch_size": cfg.pretrain_clip.batch_size,
        "learning_rate": cfg.pretrain_clip.learning_rate,
        "seed": cfg.seed,
        "model": cfg.model,
        "image_size": [int(v) for v in cfg.image_size],
        "train_images": len(dataset),
        "logit_scale_init_value": cfg.pretrain_clip.logit_scale_init_value,
    }
    out = Path(cfg.output_dir) / "clip-init"
    record = out / "pretraining.json"
    try:
        if json.loads(record.read_text()) == settings and (out / "tagclip-init" / "config.json").is_file():
            print(f"reusing the pre-trained CLIP init in {out} (made with the same settings)")
            return out / "tagclip-init"
    except (OSError, ValueError):
        pass
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pc = cfg.pretrain_clip
    print(f"pre-training a CLIP of this size on the training split for {pc.epochs} epochs (into {out})")
    target = _make_init(
        lambda: dataset,
        out,
        cfg,
        pc.epochs,
        pc.batch_size,
        pc.learning_rate,
        fast=True,
        logit_scale_init_value=pc.logit_scale_init_value,
        progress=True,
    )
    from modeling_tagclip.atomic_io import write_json

    write_json(record, settings, indent=1)
    return target
