"""Make a "pre-trained CLIP" for the initialisation study: a plain transformers ``CLIPModel`` of the training
config's size, trained briefly (symmetric InfoNCE) on the training split, saved, then converted to TAG-CLIP with
``modeling_tagclip.convert`` (``convert_hf_clip``, what ``tagclip convert hf-clip`` runs).

``tagclip ablate --study init`` makes it (``pretrained_tagclip``) once per results folder.

The CLIP vision tower is square (``image_size`` = the longer side) and sees the non-square crops through
``interpolate_pos_encoding``; the conversion interpolates its position grid to the crop size. The converted
model keeps the config's ``moe_layers`` and ``tse_embed_dim`` so that only the initialisation differs from a
run from scratch. Nothing is written outside ``--out``; finished folders are reused.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def clip_config(model: dict[str, Any], image_size: Sequence[int]):
    """A transformers ``CLIPConfig`` with the vision/text sizes of a TAG-CLIP training config's ``model``."""
    from transformers import CLIPConfig

    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    vision, text = model.get("vision_config", {}), model.get("text_config", {})
    return CLIPConfig(
        vision_config={**{k: vision[k] for k in sizes if k in vision}, "patch_size": vision.get("patch_size", 16),
                       "image_size": max(int(v) for v in image_size)},
        text_config={**{k: text[k] for k in sizes if k in text}, "vocab_size": 49408,
                     "max_position_embeddings": 77, "bos_token_id": 49406, "eos_token_id": 49407},
        projection_dim=model.get("projection_dim", 512),
    )  # fmt: skip


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
) -> Path:
    """Train ``CLIPModel(config)`` on ``dataset`` rows (image_path, captions) at ``image_size``; save it."""
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
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.02}, {"params": rest, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.98))  # fmt: skip
    paths, captions = list(dataset["image_path"]), list(dataset["captions"])
    total = epochs * (len(paths) // batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / max(1, total // 10)) * 0.5 * (1 + math.cos(math.pi * s / total)),
    )
    for _ in range(epochs):
        for idx in _batches(len(paths), batch_size, rng):
            images = [Image.open(paths[i]).convert("RGB") for i in idx]
            texts = [captions[i][int(rng.integers(len(captions[i])))] for i in idx]
            inputs = processor(
                images=images, text=texts, padding="max_length", max_length=77, truncation=True
            )
            loss = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs["pixel_values"], return_loss=True, interpolate_pos_encoding=True).loss  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    model.eval().save_pretrained(out_dir)
    return out_dir


def pretrained_tagclip(data: Path, image_dir: Path, out: Path, cfg, epochs: int = 5) -> Path:
    """``OUT/tagclip-init``: CLIP of ``cfg``'s size pre-trained on ``DATA``'s train split, converted (made once)."""
    from modeling_tagclip.convert.tagclip import convert_hf_clip
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    target = out / "tagclip-init"
    if (target / "config.json").is_file():
        return target
    hf_dir = out / "clip-hf"
    if not (hf_dir / "config.json").is_file():
        dataset = load_dataset_split(data, "train", image_dir=image_dir)
        tmp = out / "clip-hf.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        config = clip_config(cfg.model, cfg.image_size)
        pretrain_clip(dataset, config, tmp, cfg.image_size, epochs=epochs, seed=cfg.seed)
        os.replace(tmp, hf_dir)
    vision = cfg.model.get("vision_config", {})
    tmp = out / "tagclip-init.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    # no ID head: fine-tuning creates it at the training set's size (init_from may lack only the classifier)
    convert_hf_clip(hf_dir, tmp, image_size=tuple(int(v) for v in cfg.image_size),
                    moe_layers=vision.get("moe_layers"), tse_embed_dim=cfg.model.get("tse_embed_dim", 1024))  # fmt: skip
    os.replace(tmp, target)
    return target
