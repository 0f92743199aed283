"""CLIP pre-training as a task of the one training loop: a plain transformers ``CLIPModel`` of the training
config's size, trained briefly (symmetric InfoNCE) on the training split by ``engine/loop.py`` (device placement,
accelerate, progress, checkpoints, step-exact resume), saved, then converted to TAG-CLIP with
``modeling_tagclip.convert`` (``convert_hf_clip``, what ``tagclip convert hf-clip`` runs), as a fine-tuning init.

A run from scratch makes it when its recipe sets ``pretrain_clip.epochs`` (``clip_init_for_run``, into
``OUTPUT_DIR/clip-init``; the main job does); ``tagclip ablate --study init`` makes it once per results folder
(``pretrained_tagclip``). The phase's folder holds what the loop writes for any run (``checkpoints/`` until the
init is made, ``metrics.jsonl`` with a ``"kind": "epoch"`` record per epoch), ``clip-hf`` (the trained CLIP) and
``tagclip-init`` (converted).

The CLIP vision tower is square (``image_size`` = the longer side) and sees the non-square crops through
``interpolate_pos_encoding``; the conversion interpolates its position grid to the crop size. The converted
model keeps the config's ``moe_layers`` and ``tse_embed_dim`` so that only the initialisation differs from a
run from scratch. With several processes each takes an equal slice of every batch and the loss is computed on
the all-gathered batch, so they train as one process with the whole batch. Finished folders are reused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modeling_tagclip.engine.checkpoint import checkpoint_dirs, verify_checkpoint
from modeling_tagclip.engine.config import ConfigError, TagClipTrainConfig
from modeling_tagclip.engine.loop import train

WEIGHT_DECAY = 0.02
BETAS = (0.9, 0.98)


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


# ----------------------------------------------------------------------------- data


class CaptionBatches(torch.utils.data.Sampler[list[tuple[int, int]]]):
    """Batches of ``(row, caption index)``: each epoch a permutation of the rows cut into full batches, one caption
    drawn per row, all from one generator seeded once, in that order. Epoch ``e`` is the stream replayed from the
    seed (cheap: numpy draws only), so any epoch, a resumed one included, is reproduced exactly. With ``parts`` > 1
    each batch comes as ``parts`` consecutive slices, in order: accelerate hands slice ``k`` to process ``k``.
    ``batch_size`` (what accelerate reads) is the size of what it yields."""

    drop_last = True

    def __init__(self, caption_counts: Sequence[int], batch_size: int, seed: int, parts: int = 1):
        self.counts, self.whole, self.seed, self.parts = list(caption_counts), batch_size, seed, parts
        self.batch_size = batch_size // parts
        self.epoch = 0
        self._done: tuple[int, np.random.Generator] | None = None  # (epochs drawn, generator after them)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.counts) // self.whole * self.parts

    def epoch_batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        """The batches of ``epoch``: the generator continues from the last epoch drawn, else from the seed."""
        drawn, rng = (
            self._done if self._done and self._done[0] <= epoch else (0, np.random.default_rng(self.seed))
        )
        n, size = len(self.counts), self.whole
        for _ in range(drawn, epoch + 1):
            order = rng.permutation(n)
            batches = [
                [(int(r), int(rng.integers(self.counts[r]))) for r in order[i : i + size]]
                for i in range(0, n - size + 1, size)
            ]
        self._done = (epoch + 1, rng)
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.batch_size
        for batch in self.epoch_batches(self.epoch):
            yield from (batch[i : i + step] for i in range(0, self.whole, step))


class CaptionedImages(torch.utils.data.Dataset):
    """``(image path, caption)`` of a ``(row, caption index)`` item."""

    def __init__(self, paths: Sequence[str], captions: Sequence[Sequence[str]]):
        self.paths, self.captions = paths, captions

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: tuple[int, int]) -> tuple[str, str]:
        row, caption = item
        return self.paths[row], self.captions[row][caption]


class CaptionCollator:
    """A batch of ``(path, caption)`` → the processor's ``input_ids``, ``attention_mask`` and ``pixel_values``.

    ``longest``: captions padded to the batch's longest (the main job), else to 77 tokens (the init study)."""

    def __init__(self, processor, longest: bool):
        self.processor = processor
        self.padding = {"padding": "longest"} if longest else {"padding": "max_length", "max_length": 77}

    def __call__(self, items: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
        from PIL import Image

        images = [Image.open(path).convert("RGB") for path, _ in items]
        inputs = self.processor(images=images, text=[c for _, c in items], truncation=True, **self.padding)
        return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


# ----------------------------------------------------------------------------- the task


def learning_rate_factor(step: int, total: int) -> float:
    """Linear warmup over a tenth of the steps times a cosine decay over all of them."""
    return min(1.0, (step + 1) / max(1, total // 10)) * 0.5 * (1 + math.cos(math.pi * step / total))


def gathered_clip_loss(out, logit_scale: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric InfoNCE on the embeddings all-gathered (with gradients) from every process: each process
    computes the whole batch's loss, so DDP's mean of the gradients is the one-process gradient."""
    from transformers.models.clip.modeling_clip import clip_loss

    from modeling_tagclip.models.tagclip.losses_tagclip import gather_with_grad

    text, image = gather_with_grad(out.text_embeds), gather_with_grad(out.image_embeds)
    return clip_loss(text @ image.t() * logit_scale.exp())


class ClipPretrainingTask:
    """A plain CLIP trained on captioned images (the main job's pre-training phase), a task of the one loop.

    ``cfg``: the phase's settings (``phase_config``: its folder, epochs, batch size and learning rate).
    ``load_rows()``: the training rows (``image_path``, ``captions``). ``longest``: captions padded to the batch's
    longest and AdamW's fused kernel (the main job), else 77 tokens and the per-tensor AdamW (the init study)."""

    project = "clip-pretraining"
    phase = "pre-training CLIP"

    def __init__(self, cfg: TagClipTrainConfig, load_rows: Callable[[], Any], clip, longest: bool = True):
        self.cfg, self.load_rows, self.clip, self.longest = cfg, load_rows, clip, longest
        self.paths: list[str] = []
        self.captions: list[list[str]] = []
        self.batch_size = cfg.per_device_batch_size
        self.parts = 1
        self.processor = self.sampler = self.logit_scale = None

    def prepare(self) -> None:
        from modeling_tagclip import TagClipProcessor

        rows = self.load_rows()
        self.paths, self.captions = list(rows["image_path"]), list(rows["captions"])
        if len(self.paths) < 2:
            raise ValueError(f"CLIP pre-training needs at least 2 training images, got {len(self.paths)}")
        self.batch_size = min(
            self.cfg.per_device_batch_size, len(self.paths)
        )  # a small split: one batch of all
        self.processor = TagClipProcessor.from_defaults(*(int(v) for v in self.cfg.image_size))

    def has_validation(self) -> bool:
        return False

    def build_model(self, accelerator):
        from transformers import CLIPModel

        self.parts = accelerator.num_processes
        if self.batch_size % self.parts:
            raise ConfigError(
                f"pretrain_clip.batch_size {self.batch_size} must be a multiple of the {self.parts} processes"
            )
        torch.manual_seed(self.cfg.seed)
        model = CLIPModel(self.clip).train()
        self.logit_scale = model.logit_scale
        return model

    def build_optimizer(self, model):
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
            lr=self.cfg.learning_rate,
            betas=BETAS,
            fused=self.longest or None,
        )

    def build_loader(self):
        cfg = self.cfg
        self.sampler = CaptionBatches([len(c) for c in self.captions], self.batch_size, cfg.seed, self.parts)
        return torch.utils.data.DataLoader(
            CaptionedImages(self.paths, self.captions),
            batch_sampler=self.sampler,
            collate_fn=CaptionCollator(self.processor, self.longest),
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            persistent_workers=cfg.persistent_workers,
        )

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def sampler_state(self) -> dict | None:
        return None  # the batches are a function of (seed, epoch)

    def load_sampler_state(self, state: dict) -> None:
        raise ValueError("a CLIP pre-training run has no sampler state; is this another run's checkpoint?")

    def set_learning_rate(self, optimizer, step: int, epoch: int, steps_per_epoch: int, total: int) -> float:
        lr = self.cfg.learning_rate * learning_rate_factor(step, total)  # as LambdaLR computes base × factor
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def training_step(self, model, batch, step: int, epoch: int, steps_per_epoch: int, accelerator):
        one = self.parts == 1
        out = model(**batch, return_loss=one, interpolate_pos_encoding=True)
        loss = out.loss if one else gathered_clip_loss(out, self.logit_scale)
        return loss, {"loss": loss.detach().float(), "logit_scale": self.logit_scale.detach().exp()}

    def clip_gradients(self, accelerator, model) -> None:
        pass  # no clipping

    def evaluate(self, model, split: str) -> dict[str, Any]:
        raise RuntimeError("CLIP pre-training keeps its last epoch; it has no evaluation split")

    def save_best(self, accelerator, model) -> Path:
        """``clip-hf`` in the phase's folder (written aside, then moved in)."""
        target = Path(self.cfg.output_dir) / "clip-hf"
        tmp = target.with_name("clip-hf.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model, keep_torch_compile=False).save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        return target

    def summary(self) -> dict[str, Any]:
        return {"train_images": len(self.paths), "batch_size": self.batch_size}

    def final_evaluation(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {**extra, "clip": str(Path(self.cfg.output_dir) / "clip-hf")}


# ----------------------------------------------------------------------------- running the phase


def phase_config(
    cfg: TagClipTrainConfig, out: Path, epochs: int, batch_size: int, learning_rate: float
) -> TagClipTrainConfig:
    """The loop's settings for a pre-training phase in ``out``: the run's seed, threads, precision, loader and
    checkpoint settings; its own epochs, batch size and learning rate; the last epoch kept, evaluated once."""
    return dataclasses.replace(
        cfg,
        output_dir=str(out),
        num_train_epochs=epochs,
        max_steps=-1,
        per_device_batch_size=batch_size,
        learning_rate=learning_rate,
        model_selection="last",
        eval_every_epochs=max(1, epochs),
        init_from=None,
    )


def pretrain_clip(
    load_rows: Callable[[], Any],
    clip,
    cfg: TagClipTrainConfig,
    *,
    longest: bool = True,
    resume: str | None = None,
    stop_after_steps: int | None = None,
    end_process_group: bool = True,
) -> Path | None:
    """Train ``CLIPModel(clip)`` on ``load_rows()`` with the loop in ``cfg.output_dir`` (``phase_config``) →
    ``OUT/clip-hf``; None when stopped by ``stop_after_steps`` (resume with ``resume="latest"``)."""
    task = ClipPretrainingTask(cfg, load_rows, clip, longest)
    result = train(task, resume, stop_after_steps, end_process_group)
    done = Path(cfg.output_dir) / "clip-hf"
    return done if result is not None or (done / "config.json").is_file() else None


def epoch_losses(out: Path) -> list[float]:
    """The mean loss of each epoch of the phase trained in ``out`` (its ``metrics.jsonl``)."""
    from modeling_tagclip.engine.tracker import read_records

    return [r["loss"] for _, r in sorted(read_records(out / "metrics.jsonl", "epoch").items())]


def _resumable(out: Path) -> str | None:
    """``latest`` when ``out`` holds a checkpoint that verifies (an interrupted phase), else None."""
    return "latest" if any(verify_checkpoint(p) is None for p in checkpoint_dirs(out)) else None


def _convert(out: Path, cfg: TagClipTrainConfig) -> Path:
    """``OUT/tagclip-init`` from ``OUT/clip-hf`` (the converter's report silenced: one line says it)."""
    from modeling_tagclip.convert.tagclip import convert_hf_clip

    target = out / "tagclip-init"
    vision = cfg.model.get("vision_config", {})
    tmp = out / "tagclip-init.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    converter_log = logging.getLogger("modeling_tagclip.convert")
    level = converter_log.level
    converter_log.setLevel(logging.WARNING)  # its report is for `tagclip convert`
    try:  # no ID head: fine-tuning creates it at the training set's size (init_from may lack only the classifier)
        convert_hf_clip(
            out / "clip-hf",
            tmp,
            image_size=tuple(int(v) for v in cfg.image_size),
            moe_layers=vision.get("moe_layers"),
            tse_embed_dim=cfg.model.get("tse_embed_dim", 1024),
        )
    finally:
        converter_log.setLevel(level)
    os.replace(tmp, target)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the made init is what a later run reuses
    return target


def make_init(
    load_rows: Callable[[], Any],
    out: Path,
    cfg: TagClipTrainConfig,
    clip,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    longest: bool,
    accelerator=None,
) -> Path:
    """``OUT/tagclip-init`` from ``OUT/clip-hf``, trained here (an interrupted phase resumed) unless present.

    ``accelerator``: the fine-tuning run's, when the phase runs inside it (every process trains; the main one
    converts; its process group stays)."""
    target = out / "tagclip-init"
    if (target / "config.json").is_file():
        return target
    if not (out / "clip-hf" / "config.json").is_file():
        phase = phase_config(cfg, out, epochs, batch_size, learning_rate)
        pretrain_clip(
            load_rows,
            clip,
            phase,
            longest=longest,
            resume=_resumable(out),
            end_process_group=accelerator is None,
        )
    if accelerator is None or accelerator.is_main_process:
        _convert(out, cfg)
        print(f"converted the pre-trained CLIP into the TAG-CLIP init {target}")
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return target


def pretrained_tagclip(data: Path, image_dir: Path, out: Path, cfg, epochs: int = 5) -> Path:
    """``OUT/tagclip-init``: CLIP of ``cfg``'s size pre-trained on ``DATA``'s train split, converted (made once)."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    return make_init(
        lambda: load_dataset_split(data, "train", image_dir=image_dir),
        out,
        cfg,
        clip_config(cfg.model, cfg.image_size),
        epochs=epochs,
        batch_size=32,
        learning_rate=1e-3,
        longest=False,
    )


def _settings(dataset, cfg: TagClipTrainConfig) -> dict[str, Any]:
    pc = cfg.pretrain_clip
    return {
        "epochs": pc.epochs,
        "batch_size": pc.batch_size,
        "learning_rate": pc.learning_rate,
        "seed": cfg.seed,
        "model": cfg.model,
        "image_size": [int(v) for v in cfg.image_size],
        "train_images": len(dataset),
        "logit_scale_init_value": pc.logit_scale_init_value,
    }


def _recorded(record: Path) -> Any:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


def clip_init_for_run(dataset, cfg: TagClipTrainConfig, accelerator) -> Path:
    """``OUTPUT_DIR/clip-init/tagclip-init``: CLIP pre-trained on the run's training rows (``dataset``, validation
    identities excluded) with ``cfg.pretrain_clip``'s settings, converted. With the settings recorded in
    ``pretraining.json`` a finished init is reused and an interrupted phase resumes from its last checkpoint (the
    same result: resume is step-exact); otherwise the folder (the run's own) is made again."""
    from modeling_tagclip.atomic_io import write_json

    settings = _settings(dataset, cfg)
    out = Path(cfg.output_dir) / "clip-init"
    target = out / "tagclip-init"
    same = _recorded(out / "pretraining.json") == settings
    if same and (target / "config.json").is_file():
        accelerator.print(f"reusing the pre-trained CLIP init in {out} (made with the same settings)")
        return target
    accelerator.wait_for_everyone()  # every process has read the folder before it changes
    if accelerator.is_main_process and not same:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        write_json(out / "pretraining.json", settings, indent=1)
    accelerator.wait_for_everyone()
    pc = cfg.pretrain_clip
    accelerator.print(
        f"pre-training a CLIP of this size on the training split for {pc.epochs} epochs (into {out})"
    )
    return make_init(
        lambda: dataset,
        out,
        cfg,
        clip_config(cfg.model, cfg.image_size, pc.logit_scale_init_value),
        epochs=pc.epochs,
        batch_size=pc.batch_size,
        learning_rate=pc.learning_rate,
        longest=True,
        accelerator=accelerator,
    )
