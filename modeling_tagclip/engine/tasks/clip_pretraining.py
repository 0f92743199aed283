"""Plain-CLIP pre-training as a task of the engine's loop: a transformers ``CLIPModel`` trained briefly (symmetric
InfoNCE, one caption per image and step) on the rows (``image_path``, ``captions``) of a training split.

The loop does what it does for fine-tuning: device placement and accelerate, the progress lines
(``pre-training CLIP: epoch 2/8 done, mean loss ...``), ``metrics.jsonl``, checkpoints ``OUTPUT/checkpoints/step_N``
and step-exact resume. The trained CLIP is saved to ``OUTPUT/clip-hf``. Every epoch's batches and captions are
drawn up front from one generator seeded by the run's seed, so an epoch is a function of (seed, epoch), and the
optimiser sees the stream, the warm-up / cosine schedule and the AdamW groups it always saw (the losses of a seeded
run are pinned by a known-answer test). ``engine/clip_pretraining.py`` makes a run's CLIP init with it.

The CLIP vision tower is square (``image_size`` = the longer side) and sees the non-square crops through
``interpolate_pos_encoding``.
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

from modeling_tagclip.engine.accelerator import UnusedParameters
from modeling_tagclip.engine.config import TrainArguments
from modeling_tagclip.engine.samplers import FixedBatchSampler

CLIP_DIR = "clip-hf"


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


def draw_batches(
    caption_counts: Sequence[int], batch_size: int, epochs: int, seed: int
) -> list[list[list[tuple[int, int]]]]:
    """Every epoch's batches of ``(image, caption)`` indices from one generator: per epoch a permutation of the
    images cut into full batches, then one caption per image, batch by batch."""
    rng = np.random.default_rng(seed)
    n, epochs_batches = len(caption_counts), []
    for _ in range(epochs):
        order = rng.permutation(n)
        cuts = [order[i : i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
        epochs_batches.append([[(int(i), int(rng.integers(caption_counts[i]))) for i in cut] for cut in cuts])
    return epochs_batches


def warmup_cosine(step: int, total: int) -> float:
    """The learning-rate factor of ``step``: linear warm-up over a tenth of the steps, then a cosine to 0."""
    return min(1.0, (step + 1) / max(1, total // 10)) * 0.5 * (1 + math.cos(math.pi * step / total))


class CaptionedImages(torch.utils.data.Dataset):
    """``(RGB image, caption)`` per ``(image, caption)`` index pair."""

    def __init__(self, paths: Sequence[str], captions: Sequence[Sequence[str]]):
        self.paths, self.captions = paths, captions

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: tuple[int, int]):
        from PIL import Image

        index, caption = item
        return Image.open(self.paths[index]).convert("RGB"), self.captions[index][caption]


class CaptionCollator:
    """A batch of ``(image, caption)`` → the CLIP's ``input_ids``, ``attention_mask`` and ``pixel_values``."""

    def __init__(self, processor, longest: bool):
        self.processor = processor
        self.padding = {"padding": "longest"} if longest else {"padding": "max_length", "max_length": 77}

    def __call__(self, items) -> dict[str, torch.Tensor]:
        images, texts = zip(*items, strict=True)
        inputs = self.processor(images=list(images), text=list(texts), truncation=True, **self.padding)
        return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values")}


class ClipPretrainTask:
    """``CLIPModel(config)`` pre-trained on ``dataset``'s rows at ``image_size``; ``cfg`` the run's settings.

    ``fast``: AdamW's fused kernel and captions padded to the batch's longest instead of 77 tokens (the same
    objective; a run's pre-training phase uses it, the init study keeps the settings its numbers came from).
    The run keeps its last weights (``model_selection: last``), saved to ``OUTPUT/clip-hf``.
    """

    project = "clip-pretraining"
    phase = "pre-training CLIP"

    def __init__(self, cfg: TrainArguments, dataset, config, image_size: Sequence[int], fast: bool = False):
        self.cfg, self.dataset, self.config, self.fast = cfg, dataset, config, fast
        self.image_size = [int(v) for v in image_size]
        self.paths: list[str] = []
        self.captions: list[list[str]] = []
        self.sampler: FixedBatchSampler | None = None
        self.model = None  # the CLIPModel (unwrapped)
        self.rng_after_init: torch.Tensor | None = None
        self.unused = UnusedParameters()

    def prepare(self) -> None:
        self.paths, self.captions = list(self.dataset["image_path"]), list(self.dataset["captions"])
        if len(self.paths) < 2:
            raise ValueError(f"CLIP pre-training needs at least 2 training images, got {len(self.paths)}")

    def has_validation(self) -> bool:
        return False

    def build_model(self, accelerator):
        from transformers import CLIPModel

        torch.manual_seed(self.cfg.seed)
        self.model = CLIPModel(self.config).train()
        self.rng_after_init = torch.get_rng_state()
        return self.model

    def build_optimizer(self, model):
        def decays(name: str, param) -> bool:
            return param.ndim >= 2 and "embedding" not in name

        named = list(model.named_parameters())
        return torch.optim.AdamW(
            [
                {"params": [p for n, p in named if decays(n, p)], "weight_decay": 0.02},
                {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
            ],
            lr=self.cfg.learning_rate,
            betas=(0.9, 0.98),
            fused=self.fast or None,
        )

    def build_loader(self):
        from modeling_tagclip import TagClipProcessor

        cfg = self.cfg
        # a split smaller than one batch trains on one batch of it all
        batch = min(cfg.per_device_batch_size, len(self.paths))
        counts = [len(c) for c in self.captions]
        self.sampler = FixedBatchSampler(draw_batches(counts, batch, cfg.num_train_epochs, cfg.seed), batch)
        processor = TagClipProcessor.from_defaults(*self.image_size)
        return torch.utils.data.DataLoader(
            CaptionedImages(self.paths, self.captions),
            batch_sampler=self.sampler,
            collate_fn=CaptionCollator(processor, longest=self.fast),
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            persistent_workers=cfg.persistent_workers,
        )

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def sampler_state(self) -> dict | None:
        return None  # the batches are a function of (seed, epoch)

    def load_sampler_state(self, state: dict) -> None:
        raise ValueError("a CLIP pre-training run has no sampler state; is this a ViSA checkpoint?")

    def set_learning_rate(self, optimizer, step: int, epoch: int, steps_per_epoch: int, total: int) -> float:
        lr = self.cfg.learning_rate * warmup_cosine(step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def training_step(self, model, batch, step: int, epoch: int, steps_per_epoch: int, accelerator):
        out = model(**batch, return_loss=True, interpolate_pos_encoding=True)
        logs = {"loss": out.loss.detach().float(), "logit_scale": self.model.logit_scale.detach().exp()}
        return self.unused.touch(out.loss, model), logs

    def clip_gradients(self, accelerator, model) -> None:
        self.unused.release()  # no clipping; right after backward (the loop's post-backward hook)

    def evaluate(self, model, split: str) -> dict[str, Any]:
        raise ValueError(
            "CLIP pre-training has no evaluation split: it keeps its last weights (model_selection last)"
        )

    def save_best(self, accelerator, model) -> Path:
        """The CLIP into ``OUTPUT/clip-hf`` (written beside it, then renamed into place)."""
        target = Path(self.cfg.output_dir) / CLIP_DIR
        partial = target.with_name(f"{CLIP_DIR}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        accelerator.unwrap_model(model, keep_torch_compile=False).save_pretrained(partial)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        return target

    def summary(self) -> dict[str, Any]:
        return {"train_images": len(self.paths), "image_size": self.image_size, "fast": self.fast}

    def final_evaluation(self, extra: dict[str, Any]) -> dict[str, Any]:
        """No test evaluation: the phase's result is the CLIP in ``OUTPUT/clip-hf``."""
        return {**extra, "model": str(Path(self.cfg.output_dir) / CLIP_DIR)}


def pretrain_clip(
    dataset,
    config,
    output_dir: str | os.PathLike,
    image_size: Sequence[int],
    *,
    epochs: int = 5,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    fast: bool = False,
    settings: dict[str, Any] | None = None,
    resume: str | None = None,
    stop_after_steps: int | None = None,
    inside_run: bool = False,
) -> Path:
    """Pre-train ``CLIPModel(config)`` on ``dataset``'s rows in the engine's loop; returns ``OUTPUT_DIR/clip-hf``.

    ``OUTPUT_DIR`` also gets the loop's ``metrics.jsonl`` (the loss of every step; ``epoch_losses``) and
    ``checkpoints/``; ``resume="latest"`` continues from the newest, ``stop_after_steps`` stops early (no
    ``clip-hf``). ``settings``: further ``TrainArguments`` of the run (``num_threads``, ``save_steps``,
    ``mixed_precision``, ``num_workers`` ...). ``inside_run``: a phase of another run of the loop in this process
    (which keeps its process group). The global torch RNG is left as the CLIP's initialisation left it.
    """
    from modeling_tagclip.engine.loop import train

    if epochs < 1:
        raise ValueError(f"CLIP pre-training needs epochs >= 1, got {epochs}")
    cfg = TrainArguments(
        task="clip-pretraining",
        output_dir=str(output_dir),
        seed=seed,
        num_train_epochs=epochs,
        per_device_batch_size=batch_size,
        learning_rate=lr,
        validation_fraction=0.0,
        model_selection="last",
        eval_every_epochs=epochs,
        plots=False,
        **(settings or {}),
    )
    task = ClipPretrainTask(cfg, dataset, config, image_size, fast)
    train(task, resume=resume, stop_after_steps=stop_after_steps, inside_run=inside_run)
    torch.set_rng_state(task.rng_after_init)  # what follows draws as it did after the hand-written loop
    return Path(output_dir) / CLIP_DIR


def epoch_losses(output_dir: str | os.PathLike) -> list[float]:
    """The mean training loss of each epoch of a pre-training run, from its ``metrics.jsonl``."""
    from modeling_tagclip.engine.tracker import read_records

    losses: dict[int, list[float]] = {}
    for record in read_records(Path(output_dir) / "metrics.jsonl").values():
        losses.setdefault(record["epoch"], []).append(record["loss"])
    return [sum(v) / len(v) for _, v in sorted(losses.items())]
