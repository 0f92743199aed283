"""Train ViSA for aerial-ground image re-ID with accelerate (recipe: docs/visa-reference.md §5).

With no arguments it renders the synthetic re-ID set into ``data/synthetic_reid`` (if absent) and trains a
small ViSA from scratch on CPU (``--recipe synthetic``). ``--recipe reference`` is the paper's recipe: SGD lr
0.008, momentum 0.9, weight decay 1e-4 (5e-4 for biases and norms), per-tensor gradient-norm clip 5, 2000
iterations of linear warmup from 0.01x, then cosine per epoch to 1.6e-6 over 120 epochs, P x K = 32 x 4,
fp16 on GPU. The best epoch on a validation split (identities held out from train) is saved to
``<output_dir>/best`` and evaluated on every test protocol (``eval_results.json``).

Examples::

    python -m training.train_reid
    accelerate launch -m training.train_reid --recipe reference --dataset cargo --data datasets/ \\
        --imagenet-vit jx_vit_base_p16_224-80ecf9dd.pth --output-dir outputs/visa-cargo
    python -m training.train_reid --resume latest
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

if __package__ in (None, ""):  # run as a file (accelerate launch training/train_reid.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_tagclip.data.reid import (
    IdentityBatchSampler,
    ReIDDataset,
    ReIDTransform,
    load_reid_dataset,
    relabel,
)
from modeling_tagclip.metrics.reid import Protocol

logger = logging.getLogger("training.train_reid")

SYNTHETIC_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "image_size": [64, 32],
    "patch_size": 8,
    "patch_stride": [6, 6],
    "num_experts": 4,
    "num_prompt_tokens": 4,
    "expert_intermediate_size": 128,
    "graph_top_k": 16,
    "fusion_intermediate_size": 128,
    "drop_path_rate": 0.0,
}
RECIPES: dict[str, dict[str, Any]] = {
    "reference": {
        "preset": "cargo",
        "model": {},
        "epochs": 120,
        "batch_size": 128,
        "num_instances": 4,
        "optimizer": "sgd",
        "lr": 0.008,
        "warmup_iters": 2000,
        "mixed_precision": "fp16",
        "eval_every": 120,
        "random_erasing": 0.5,
    },
    "synthetic": {
        "preset": "cargo",
        "model": SYNTHETIC_MODEL,
        "optimizer": "adamw",
        "epochs": 30,
        "batch_size": 32,
        "num_instances": 4,
        "lr": 5e-3,
        "warmup_iters": 50,
        "mixed_precision": "no",
        "eval_every": 5,
        "random_erasing": 0.0,
    },
}


@dataclass
class ReIDTrainConfig:
    """All settings of a run; `recipe` fills the defaults that it names, explicit values win."""

    recipe: str = "synthetic"
    dataset: str = "synthetic"
    data: str = "data/synthetic_reid"
    output_dir: str = "outputs/visa-synthetic"
    synthetic_identities: int = 200
    preset: str = "cargo"
    model: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    imagenet_vit: str | None = None
    epochs: int = 30
    batch_size: int = 32
    num_instances: int = 4
    optimizer: str = "adamw"
    lr: float = 5e-3
    momentum: float = 0.9
    weight_decay: float = 1e-4
    weight_decay_bias: float = 5e-4
    weight_decay_norm: float = 5e-4
    clip_norm: float = 5.0
    warmup_iters: int = 50
    warmup_factor: float = 0.01
    eta_min: float = 1.6e-6
    mixed_precision: str = "no"
    eval_every: int = 5
    random_erasing: float = 0.0
    val_fraction: float = 0.1
    eval_batch_size: int = 64
    max_steps: int = -1
    lora_rank: int = 0
    seed: int = 0
    num_workers: int = 0
    resume: str | None = None

    @classmethod
    def from_recipe(cls, recipe: str = "synthetic", **overrides) -> ReIDTrainConfig:
        if recipe not in RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; choose from {sorted(RECIPES)}")
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}")
        return cls(
            recipe=recipe, **{**RECIPES[recipe], **{k: v for k, v in overrides.items() if v is not None}}
        )


# ----------------------------------------------------------------------------- data


class ReIDImages(torch.utils.data.Dataset):
    """(pixel_values, view_labels, labels) per row of a re-ID table."""

    def __init__(self, table, labels: np.ndarray, transform: ReIDTransform):
        self.paths, self.views = table["image_path"], np.asarray(table["view"])
        self.labels, self.transform = labels, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": self.transform(Image.open(self.paths[index])),
            "view_labels": torch.tensor(int(self.views[index])),
            "labels": torch.tensor(int(self.labels[index])),
        }


def ensure_data(cfg: ReIDTrainConfig) -> ReIDDataset:
    """Load the dataset; for `dataset="synthetic"` render it first if the folder is missing."""
    if cfg.dataset == "synthetic" and not (Path(cfg.data) / "dataset_info.json").is_file():
        from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

        generate_reid_dataset(cfg.data, num_identities=cfg.synthetic_identities, progress=False)
    return load_reid_dataset(cfg.dataset, cfg.data)


def split_validation(data: ReIDDataset, fraction: float, seed: int) -> tuple[Any, ReIDDataset | None]:
    """Hold out identities of train as a validation query (first image per identity and view) / gallery."""
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


# ----------------------------------------------------------------------------- model and optimisation


def build_model(cfg: ReIDTrainConfig, num_identities: int):
    """ViSAForReID from the preset + overrides, optionally initialised from a ViSA folder or ImageNet ViT."""
    from modeling_tagclip.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.visa.modeling_visa import ViSAForReID

    if cfg.init_from:
        return ViSAForReID.from_pretrained(
            cfg.init_from, num_identities=num_identities, ignore_mismatched_sizes=True, **cfg.model
        )
    config = ViSAConfig.from_preset(cfg.preset, num_identities=num_identities, **cfg.model)
    model = ViSAForReID(config)
    if cfg.imagenet_vit:
        from modeling_tagclip.convert.visa import load_imagenet_vit

        load_imagenet_vit(model.visa, cfg.imagenet_vit)
    return model


def apply_lora(model, rank: int):
    """peft LoRA on the trunk's attention projections; heads, BNNecks, experts and fusion stay trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=r".*encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
        modules_to_save=[
            "classifier",
            "local_classifier",
            "view_classifier",
            "view_bnneck",
            "etgm",
            "dlfm",
            "fusion",
        ],
    )
    return get_peft_model(model, config)


def param_groups(model, cfg: ReIDTrainConfig) -> list[dict[str, Any]]:
    """fast-reid's weight decay: 1e-4 for weights, 5e-4 for every `bias` and for LayerNorm / BatchNorm params."""
    norm_types = (torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm)
    norm_params = {
        id(p) for m in model.modules() if isinstance(m, norm_types) for p in m.parameters(recurse=False)
    }
    groups = {
        key: {"params": [], "weight_decay": decay, "name": key}
        for key, decay in (
            ("weight", cfg.weight_decay),
            ("bias", cfg.weight_decay_bias),
            ("norm", cfg.weight_decay_norm),
        )
    }
    for name, param in model.named_parameters():
        if param.requires_grad:
            key = "norm" if id(param) in norm_params else "bias" if name.endswith("bias") else "weight"
            groups[key]["params"].append(param)
    return [g for g in groups.values() if g["params"]]


def make_optimizer(model, cfg: ReIDTrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum (reference); AdamW for the from-scratch synthetic recipe (a tiny ViT trained from random
    init learns its expert / fusion branch far faster with Adam than with SGD in a few hundred steps)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(param_groups(model, cfg), lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {cfg.optimizer!r}")


def learning_rate(cfg: ReIDTrainConfig, iteration: int, epoch: int, iters_per_epoch: int) -> float:
    """Linear warmup per iteration (factor 0.01 -> 1), then cosine per epoch to `eta_min` (fast-reid)."""
    if iteration < cfg.warmup_iters:
        alpha = iteration / cfg.warmup_iters
        return cfg.lr * (cfg.warmup_factor * (1 - alpha) + alpha)
    delay = math.ceil(cfg.warmup_iters / max(1, iters_per_epoch))
    t_max = max(1, cfg.epochs - delay)
    progress = min(max(0, epoch - delay), t_max)
    return cfg.eta_min + (cfg.lr - cfg.eta_min) * (1 + math.cos(math.pi * progress / t_max)) / 2


def clip_per_tensor(parameters, max_norm: float) -> None:
    """Per-parameter-tensor L2-norm clip (fast-reid `CLIP_TYPE: norm`), not one global norm; batched."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    norms = torch._foreach_norm(grads)
    torch._foreach_mul_(grads, [(max_norm / (norm + 1e-6)).clamp(max=1.0) for norm in norms])


# ----------------------------------------------------------------------------- loop


def _validate(model, validation: ReIDDataset | None, batch_size: int) -> dict[str, float] | None:
    from modeling_tagclip.evaluation.reid import evaluate_reid_model

    if validation is None:
        return None
    base = model.visa if hasattr(model, "visa") else model.base_model.model.visa
    base.eval()
    metrics = evaluate_reid_model(base, validation, batch_size)["protocols"]["ALL"]
    base.train()
    return metrics


def _save_best(accelerator, model, cfg: ReIDTrainConfig) -> Path:
    best = Path(cfg.output_dir) / "best"
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if cfg.lora_rank > 0:  # save a merged copy: a plain ViSAForReID; training goes on with the adapters
            unwrapped = copy.deepcopy(unwrapped).merge_and_unload()
        _register_custom_code()
        unwrapped.save_pretrained(best)
    accelerator.wait_for_everyone()
    return best


def _register_custom_code() -> None:
    """Make `save_pretrained` ship the modeling files (Hub custom code)."""
    from modeling_tagclip.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.visa.modeling_visa import ViSAForReID, ViSAModel

    ViSAConfig.register_for_auto_class()
    ViSAModel.register_for_auto_class("AutoModel")
    ViSAForReID.register_for_auto_class("AutoModelForImageClassification")


def _log(accelerator, record: dict[str, Any], path: Path) -> None:
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def train(cfg: ReIDTrainConfig) -> dict[str, Any]:
    """Train, keep the best validation epoch, evaluate it on the test protocols; returns the results."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import set_seed

    from training.train import TrainState, resolve_resume, save_checkpoint

    mixed = cfg.mixed_precision if torch.cuda.is_available() else "no"
    accelerator = Accelerator(
        mixed_precision=mixed, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)]
    )
    set_seed(cfg.seed)
    output = Path(cfg.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    with accelerator.main_process_first():
        data = ensure_data(cfg)
    train_table, validation = split_validation(data, cfg.val_fraction, cfg.seed)
    labels, mapping = relabel(train_table)
    model = build_model(cfg, len(mapping))
    if cfg.lora_rank > 0:
        model = apply_lora(model, cfg.lora_rank)
    transform = ReIDTransform(model.config.image_size, train=True, erasing=cfg.random_erasing)
    sampler = IdentityBatchSampler(labels, cfg.batch_size, cfg.num_instances, seed=cfg.seed)
    loader = torch.utils.data.DataLoader(
        ReIDImages(train_table, labels, transform), batch_sampler=sampler, num_workers=cfg.num_workers
    )
    optimizer = make_optimizer(model, cfg)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = TrainState(steps_per_epoch=len(loader))
    accelerator.register_for_checkpointing(state)
    resume = resolve_resume(cfg.output_dir, cfg.resume)
    if resume is not None:
        accelerator.load_state(str(resume))
    (output / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    log_path = output / "metrics.jsonl"
    start_epoch = state.step // max(1, len(loader))
    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        for batch in loader:
            lr = learning_rate(cfg, state.step, epoch, len(loader))
            for group in optimizer.param_groups:
                group["lr"] = lr
            out = model(**batch)
            accelerator.backward(out.loss)
            if accelerator.sync_gradients:
                accelerator.unscale_gradients(optimizer)
                clip_per_tensor(model.parameters(), cfg.clip_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            terms = {
                k: float(v.detach())
                for k, v in out.items()
                if k.startswith("loss") and v is not None and v.ndim == 0
            }
            _log(
                accelerator,
                {"kind": "train", "step": state.step, "epoch": epoch, "lr": lr, **terms},
                log_path,
            )
            if 0 < cfg.max_steps <= state.step:
                break
        last_epoch = epoch + 1 == cfg.epochs or 0 < cfg.max_steps <= state.step
        if (epoch + 1) % cfg.eval_every == 0 or last_epoch:
            _evaluate_and_select(accelerator, model, validation, cfg, state, epoch, log_path)
            save_checkpoint(accelerator, cfg.output_dir, state.step, keep=1)
        if 0 < cfg.max_steps <= state.step:
            break
    return final_evaluation(accelerator, cfg, data, state)


def _evaluate_and_select(accelerator, model, validation, cfg, state, epoch: int, log_path: Path) -> None:
    """Validation metrics; save `best/` when (mAP + R1) / 2 improves (always, without a validation split)."""
    from accelerate.utils import broadcast_object_list

    metrics = None
    if accelerator.is_main_process:
        metrics = _validate(accelerator.unwrap_model(model), validation, cfg.eval_batch_size)
    metric = metrics["metric"] if metrics else float(state.step)
    metric = broadcast_object_list([metric])[0]  # every rank takes the same save decision (barriers inside)
    _log(accelerator, {"kind": "validation", "step": state.step, "epoch": epoch, **(metrics or {})}, log_path)
    if metric > state.best_metric:
        state.best_metric, state.best_step = metric, state.step
        _save_best(accelerator, model, cfg)
    state.last_eval_step = state.step


def final_evaluation(accelerator, cfg: ReIDTrainConfig, data: ReIDDataset, state) -> dict[str, Any]:
    """Every test protocol for the best model; writes `eval_results.json` (main process)."""
    from modeling_tagclip.evaluation.reid import evaluate_reid_model, format_table, load_visa

    results: dict[str, Any] = {}
    if accelerator.is_main_process:
        model = load_visa(Path(cfg.output_dir) / "best", accelerator.device)
        run = evaluate_reid_model(model, data, cfg.eval_batch_size)
        results = {
            "dataset": data.name,
            "best_step": state.best_step,
            "best_validation_metric": state.best_metric,
            "protocols": run["protocols"],
        }
        (Path(cfg.output_dir) / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
        print(format_table(run["protocols"]))
    accelerator.wait_for_everyone()
    return results


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> ReIDTrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="synthetic", choices=sorted(RECIPES))
    p.add_argument("--dataset", default=None, help="synthetic (default), cargo, agreidv2, lagper, market1501")
    p.add_argument("--data", default=None, help="dataset folder (default data/synthetic_reid)")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--preset", default=None, help="ViSAConfig preset: cargo, agreidv2, lagper, vdt, vit")
    p.add_argument("--model", default=None, help="JSON dict of ViSAConfig overrides")
    p.add_argument("--init-from", default=None, help="ViSA folder (e.g. a converted official checkpoint)")
    p.add_argument("--imagenet-vit", default=None, help="timm ViT-B/16 state dict for the trunk")
    for name, kind in (
        ("epochs", int),
        ("batch-size", int),
        ("num-instances", int),
        ("lr", float),
        ("warmup-iters", int),
        ("eval-every", int),
        ("max-steps", int),
        ("lora-rank", int),
        ("seed", int),
        ("synthetic-identities", int),
        ("val-fraction", float),
        ("random-erasing", float),
        ("num-workers", int),
    ):
        p.add_argument(f"--{name}", type=kind, default=None)
    p.add_argument("--mixed-precision", default=None, choices=["no", "fp16", "bf16"])
    p.add_argument("--optimizer", default=None, choices=["sgd", "adamw"])
    p.add_argument("--resume", default=None, help="checkpoint folder, or 'latest'")
    args = vars(p.parse_args(argv))
    recipe = args.pop("recipe")
    if args["model"] is not None:
        args["model"] = {**RECIPES[recipe]["model"], **json.loads(args["model"])}
    return ReIDTrainConfig.from_recipe(recipe, **args)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point (`python -m training.train_reid`, or `training/train.py --task reid` once wired)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
