"""ViSA as a training task: P x K identity batches, SGD/AdamW with fast-reid's schedule and per-tensor clip,
held-out-identity validation, ``best/`` with its Hub code, every test protocol of the dataset."""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from modeling_tagclip.atomic_io import write_json
from modeling_tagclip.engine.accelerator import UnusedParameters
from modeling_tagclip.engine.config import ViSATrainConfig
from modeling_tagclip.engine.samplers import IdentityBatchSampler
from modeling_tagclip.engine.tasks.data_guard import may_render
from modeling_tagclip.models.visa.image_processing_visa import build_visa_image_processor
from modeling_tagclip.progress import main_process

logger = logging.getLogger(__name__)
DEFAULT_DATA_DIR = "data/synthetic_reid"
LORA_HEADS = ["classifier", "local_classifier", "view_classifier", "view_bnneck", "etgm", "dlfm", "fusion"]


class ReIDImages(torch.utils.data.Dataset):
    """(pixel_values, view_labels, labels) per ``(index, draw)`` item; augmentation seeded by (seed, draw)."""

    def __init__(self, table, labels: np.ndarray, transform, seed: int):
        self.paths, self.views = table["image_path"], np.asarray(table["view"])
        self.labels, self.transform, self.seed = labels, transform, seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: tuple[int, int]) -> dict[str, torch.Tensor]:
        index, draw = item
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.SeedSequence([self.seed, draw]).generate_state(1)[0]))
            pixels = self.transform(Image.open(self.paths[index]))
        return {
            "pixel_values": pixels,
            "view_labels": torch.tensor(int(self.views[index])),
            "labels": torch.tensor(int(self.labels[index])),
        }


def ensure_data(cfg: ViSATrainConfig):
    """Load the dataset; ``dataset: synthetic`` is rendered first into the default folder (or when asked)."""
    from modeling_tagclip.data.reid import load_reid_dataset

    root = Path(cfg.data_dir)
    if cfg.dataset == "synthetic" and not (root / "dataset_info.json").is_file():
        may_render(root, DEFAULT_DATA_DIR, cfg.render_synthetic, "dataset_info.json (synthetic re-ID set)")
        from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

        if main_process():
            print(
                f"rendering the synthetic re-ID set ({cfg.synthetic_identities} identities) into {root} (once)"
            )
        generate_reid_dataset(root, num_identities=cfg.synthetic_identities, progress=main_process())
    return load_reid_dataset(cfg.dataset, root)


def split_validation(data, fraction: float, seed: int):
    """Hold out identities of train as a validation query (first image per identity and view) / gallery."""
    from modeling_tagclip.data.reid import ReIDDataset
    from modeling_tagclip.metrics.reid import Protocol

    pids = np.asarray(data.train["person_id"])
    unique = np.unique(pids)
    n_val = round(fraction * len(unique))
    if fraction <= 0 or n_val < 2 or len(unique) - n_val < 2:
        return data.train, None
    val_ids = np.random.default_rng(seed).permutation(unique)[:n_val]
    is_val = np.isin(pids, val_ids)
    val = data.train.select(np.flatnonzero(is_val))
    seen, query_rows = set(), []
    for i, (pid, view) in enumerate(zip(val["person_id"], val["view"], strict=True)):
        if (pid, view) not in seen:
            seen.add((pid, view))
            query_rows.append(i)
    gallery_rows = sorted(set(range(len(val))) - set(query_rows))
    protocol = {"ALL": Protocol(description="validation: held-out train identities")}
    validation = ReIDDataset("validation", val, val.select(query_rows), val.select(gallery_rows), protocol)
    return data.train.select(np.flatnonzero(~is_val)), validation


def build_model(cfg: ViSATrainConfig, num_identities: int):
    """ViSAForReID from the preset + overrides, optionally initialised from a ViSA folder or ImageNet ViT."""
    from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID

    if cfg.init_from:
        return ViSAForReID.from_pretrained(
            cfg.init_from, num_identities=num_identities, ignore_mismatched_sizes=True, **cfg.model
        )
    torch.manual_seed(cfg.seed)
    model = ViSAForReID(ViSAConfig.from_preset(cfg.preset, num_identities=num_identities, **cfg.model))
    if cfg.imagenet_vit:
        from modeling_tagclip.convert.visa import load_imagenet_vit

        load_imagenet_vit(model.visa, cfg.imagenet_vit)
    return model


def apply_lora(model, cfg: ViSATrainConfig):
    """peft LoRA on the trunk's attention projections; heads, BNNecks, experts and fusion stay trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=r".*encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
        modules_to_save=LORA_HEADS,
    )
    return get_peft_model(model, config)


def param_groups(model, cfg: ViSATrainConfig) -> list[dict[str, Any]]:
    """fast-reid's weight decay: 1e-4 for weights, 5e-4 for every `bias` and for LayerNorm / BatchNorm params."""
    norm_types = (torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm)
    norm_params = {
        id(p) for m in model.modules() if isinstance(m, norm_types) for p in m.parameters(recurse=False)
    }
    decays = {"weight": cfg.weight_decay, "bias": cfg.weight_decay_bias, "norm": cfg.weight_decay_norm}
    groups = {key: {"params": [], "weight_decay": decay, "name": key} for key, decay in decays.items()}
    for name, param in model.named_parameters():
        if param.requires_grad:
            key = "norm" if id(param) in norm_params else "bias" if name.endswith("bias") else "weight"
            groups[key]["params"].append(param)
    return [g for g in groups.values() if g["params"]]


def learning_rate(cfg: ViSATrainConfig, iteration: int, epoch: int, iters_per_epoch: int) -> float:
    """Linear warmup per iteration (factor 0.01 -> 1), then cosine per epoch to `eta_min` (fast-reid)."""
    if iteration < cfg.warmup_iters:
        alpha = iteration / cfg.warmup_iters
        return cfg.learning_rate * (cfg.warmup_factor * (1 - alpha) + alpha)
    delay = math.ceil(cfg.warmup_iters / max(1, iters_per_epoch))
    t_max = max(1, cfg.num_train_epochs - delay)
    progress = min(max(0, epoch - delay), t_max)
    return cfg.eta_min + (cfg.learning_rate - cfg.eta_min) * (1 + math.cos(math.pi * progress / t_max)) / 2


def clip_per_tensor(parameters, max_norm: float) -> None:
    """Per-parameter-tensor L2-norm clip (fast-reid `CLIP_TYPE: norm`), not one global norm; batched."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (norm + 1e-6)).clamp(max=1.0) for norm in norms])


def _register_custom_code() -> None:
    """Make `save_pretrained` ship the modeling files (Hub custom code)."""
    from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID, ViSAModel

    ViSAConfig.register_for_auto_class()
    ViSAModel.register_for_auto_class("AutoModel")
    ViSAForReID.register_for_auto_class("AutoModelForImageClassification")


class ViSATask:
    """ViSA aerial-ground image re-ID (``--task reid``)."""

    project = "visa"
    phase = "fine-tuning"

    def __init__(self, cfg: ViSATrainConfig):
        self.cfg = cfg
        self.data = self.train_table = self.validation = self.labels = self.sampler = None
        self.image_size = None
        self.unused = UnusedParameters()

    def prepare(self) -> None:
        from modeling_tagclip.data.reid import relabel

        self.data = ensure_data(self.cfg)
        self.train_table, self.validation = split_validation(
            self.data, self.cfg.validation_fraction, self.cfg.seed
        )
        self.labels, self.mapping = relabel(self.train_table)

    def has_validation(self) -> bool:
        return self.validation is not None

    def build_model(self, accelerator):
        model = build_model(self.cfg, len(self.mapping))
        self.image_size = model.config.image_size
        return apply_lora(model, self.cfg) if self.cfg.lora.enabled else model

    def build_optimizer(self, model):
        groups = param_groups(model, self.cfg)
        if self.cfg.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.cfg.learning_rate, momentum=self.cfg.momentum)
        # AdamW for the from-scratch synthetic recipe: a tiny random ViT learns its expert / fusion branch far
        # faster with Adam than with SGD in a few hundred steps.
        return torch.optim.AdamW(groups, lr=self.cfg.learning_rate)

    def build_loader(self):
        from modeling_tagclip.data.reid import ReIDTransform

        cfg = self.cfg
        transform = ReIDTransform(self.image_size, train=True, erasing=cfg.random_erasing)
        self.sampler = IdentityBatchSampler(
            self.labels, cfg.per_device_batch_size, cfg.num_instances, seed=cfg.seed
        )
        return torch.utils.data.DataLoader(
            ReIDImages(self.train_table, self.labels, transform, cfg.seed),
            batch_sampler=self.sampler,
            num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory,
            persistent_workers=cfg.persistent_workers,
        )

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def sampler_state(self) -> dict | None:
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def set_learning_rate(self, optimizer, step: int, epoch: int, steps_per_epoch: int, total: int) -> float:
        lr = learning_rate(self.cfg, step, epoch, steps_per_epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def training_step(self, model, batch, step: int, epoch: int, steps_per_epoch: int, accelerator):
        out = model(**batch)
        logs = {
            k: v.detach().float()
            for k, v in out.items()
            if k.startswith("loss") and v is not None and v.ndim == 0
        }
        return self.unused.touch(out.loss, model), logs

    def clip_gradients(self, accelerator, model) -> None:
        self.unused.release()  # right after backward (the loop's post-backward hook)
        if accelerator.sync_gradients:
            accelerator.unscale_gradients()
            clip_per_tensor(model.parameters(), self.cfg.clip_norm)

    def evaluate(self, model, split: str) -> dict[str, Any]:
        from modeling_tagclip.evaluation.reid import evaluate_reid_model

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        visa = base.visa
        was_training = visa.training
        visa.eval()
        if split == "test":
            metrics = evaluate_reid_model(visa, self.data, self.cfg.eval_batch_size)["protocols"]
            metrics = metrics.get("ALL", next(iter(metrics.values())))
        else:
            metrics = evaluate_reid_model(visa, self.validation, self.cfg.eval_batch_size)["protocols"]["ALL"]
        visa.train(was_training)
        return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

    def save_best(self, accelerator, model) -> Path:
        best = Path(self.cfg.output_dir) / "best"
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        if self.cfg.lora.enabled:  # a merged copy: a plain ViSAForReID; training goes on with the adapters
            unwrapped = copy.deepcopy(unwrapped).merge_and_unload()
        _register_custom_code()
        unwrapped.save_pretrained(best)
        build_visa_image_processor(*unwrapped.config.image_size).save_pretrained(best)
        return best

    def summary(self) -> dict[str, Any]:
        return {
            "config": asdict(self.cfg),
            "data": str(self.cfg.data_dir),
            "split": "test",
            "train_images": len(self.train_table),
            "train_identities": len(self.mapping),
        }

    def final_evaluation(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Every test protocol for ``best/``; printed, then written to ``eval_results.json``."""
        from modeling_tagclip.evaluation.reid import evaluate_reid_model, format_table
        from modeling_tagclip.retrieval.loading import load_model

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model, _ = load_model(Path(self.cfg.output_dir) / "best", device, family="visa")
        run = evaluate_reid_model(model, self.data, self.cfg.eval_batch_size)
        results = {"dataset": self.data.name, **extra, "protocols": run["protocols"]}
        print(format_table(run["protocols"]))
        write_json(
            Path(self.cfg.output_dir) / "eval_results.json", results, indent=2, default=str, allow_nan=True
        )
        return results


def eval_only(cfg: ViSATrainConfig) -> dict[str, Any]:
    task = ViSATask(cfg)
    task.prepare()
    return task.final_evaluation({"config": asdict(cfg), "data": str(cfg.data_dir), "split": "test"})
