"""A run's CLIP init: a plain transformers ``CLIPModel`` of the training config's size, pre-trained briefly on the
training split in the engine's loop (``tasks/clip_pretraining.py``), then converted to TAG-CLIP with
``modeling_tagclip.convert`` (``convert_hf_clip``, what ``tagclip convert hf-clip`` runs), as a fine-tuning init.

A run from scratch makes it when its recipe sets ``pretrain_clip.epochs`` (``clip_init_for_run``, into
``OUTPUT_DIR/clip-init``; the main job does); ``tagclip ablate --study init`` makes it once per results folder
(``pretrained_tagclip``). The folder holds ``clip-hf/`` (the CLIP), ``tagclip-init/`` (converted) and, while the
pre-training runs, its ``checkpoints/``: an interrupted phase resumes from them, step-exact.

The conversion interpolates the CLIP's square position grid to the crop size. The converted model keeps the
config's ``moe_layers`` and ``tse_embed_dim`` so that only the initialisation differs from a run from scratch.
Nothing is written outside the folder it is given; finished folders are reused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modeling_tagclip.engine.checkpoint import checkpoint_dirs
from modeling_tagclip.engine.tasks.clip_pretraining import CLIP_DIR, clip_config, pretrain_clip

INIT_DIR = "tagclip-init"
# the run's settings that the phase inherits (the rest are its own: pretrain_clip)
RUN_SETTINGS = (
    "mixed_precision",
    "num_threads",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "logging_steps",
    "save_steps",
    "save_total_limit",
)


def _convert(hf_dir: Path, out: Path, cfg) -> Path:
    """``OUT/tagclip-init`` from the CLIP in ``hf_dir``, without an ID head (fine-tuning sizes it)."""
    from modeling_tagclip.convert.tagclip import convert_hf_clip

    target, partial = out / INIT_DIR, out / f"{INIT_DIR}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    converter_log = logging.getLogger("modeling_tagclip.convert")
    level = converter_log.level
    converter_log.setLevel(logging.WARNING)  # its report is for `tagclip convert`; here one line says it
    try:
        convert_hf_clip(
            hf_dir,
            partial,
            image_size=tuple(int(v) for v in cfg.image_size),
            moe_layers=cfg.model.get("vision_config", {}).get("moe_layers"),
            tse_embed_dim=cfg.model.get("tse_embed_dim", 1024),
        )
    finally:
        converter_log.setLevel(level)
    os.replace(partial, target)
    return target


def _make_init(
    load_dataset: Callable[[], Any],
    out: Path,
    cfg,
    epochs: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    fast: bool = False,
    logit_scale_init_value: float | None = None,
    accelerator=None,
) -> Path:
    """``OUT/tagclip-init`` from ``OUT/clip-hf``, pre-trained here on ``load_dataset()`` unless present (resumed
    from ``OUT/checkpoints``). ``accelerator``: the run this phase is part of; every process trains, the main
    process converts."""
    target, hf_dir = out / INIT_DIR, out / CLIP_DIR
    if (target / "config.json").is_file():
        return target
    if not (hf_dir / "config.json").is_file():
        pretrain_clip(
            load_dataset(),
            clip_config(cfg.model, cfg.image_size, logit_scale_init_value),
            out,
            cfg.image_size,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=cfg.seed,
            fast=fast,
            settings={key: getattr(cfg, key) for key in RUN_SETTINGS},
            resume="latest" if checkpoint_dirs(out) else None,
            inside_run=accelerator is not None,
        )
    if accelerator is None or accelerator.is_main_process:
        _convert(hf_dir, out, cfg)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the phase is done; its result is clip-hf/
        print(f"converted the pre-trained CLIP into the TAG-CLIP init {target}")
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return target


def pretrained_tagclip(data: Path, image_dir: Path, out: Path, cfg, epochs: int = 5) -> Path:
    """``OUT/tagclip-init``: CLIP of ``cfg``'s size pre-trained on ``DATA``'s train split, converted (made once)."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    return _make_init(lambda: load_dataset_split(data, "train", image_dir=image_dir), out, cfg, epochs)


def _agreed(accelerator, value):
    """The main process's ``value`` on every process."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value])[0]


def _recorded(record: Path) -> Any:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


def clip_init_for_run(dataset, cfg, accelerator) -> Path:
    """``OUTPUT_DIR/clip-init/tagclip-init``: CLIP pre-trained on the run's training rows (``dataset``, validation
    identities excluded) with ``cfg.pretrain_clip``'s settings, converted. ``pretraining.json`` records the
    settings: with the same ones a finished init is reused and an interrupted phase resumes; otherwise the folder
    (the run's own) is made again. Every process of the run takes part (``accelerator``)."""
    pc = cfg.pretrain_clip
    settings = {
        "epochs": pc.epochs,
        "batch_size": pc.batch_size,
        "learning_rate": pc.learning_rate,
        "seed": cfg.seed,
        "model": cfg.model,
        "image_size": [int(v) for v in cfg.image_size],
        "train_images": len(dataset),
        "logit_scale_init_value": pc.logit_scale_init_value,
    }
    if accelerator.num_processes > 1:  # each process trains on its own batches: another run
        settings["num_processes"] = accelerator.num_processes
    out = Path(cfg.output_dir) / "clip-init"
    state = "new"
    if accelerator.is_main_process and _recorded(out / "pretraining.json") == settings:
        state = "done" if (out / INIT_DIR / "config.json").is_file() else "partial"
    state = _agreed(accelerator, state)
    if state == "done":
        accelerator.print(f"reusing the pre-trained CLIP init in {out} (made with the same settings)")
        return out / INIT_DIR
    if state == "partial":
        accelerator.print(
            f"continuing the CLIP pre-training in {out} ({pc.epochs} epochs, the same settings)"
        )
    else:
        accelerator.print(
            f"pre-training a CLIP of this size on the training split for {pc.epochs} epochs (into {out})"
        )
        if accelerator.is_main_process:
            from modeling_tagclip.atomic_io import write_json

            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            write_json(out / "pretraining.json", settings, indent=1)
        accelerator.wait_for_everyone()
    return _make_init(
        lambda: dataset,
        out,
        cfg,
        pc.epochs,
        pc.batch_size,
        pc.learning_rate,
        fast=True,
        logit_scale_init_value=pc.logit_scale_init_value,
        accelerator=accelerator,
    )
