"""TAG-CLIP as a training task: model (scratch / converted / LoRA), AdamW groups, per-iteration schedule, TAG-PR Eq. 11
step with all-gathered negatives, retrieval validation, ``best/`` with the retrieval pipeline, test evaluation."""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modeling_tagclip.atomic_io import write_json
from modeling_tagclip.engine import grad_cache
from modeling_tagclip.engine.accelerator import UnusedParameters
from modeling_tagclip.engine.config import TagClipTrainConfig
from modeling_tagclip.engine.tasks import tagclip_data as data
from modeling_tagclip.models.tagclip.losses_tagclip import ContrastiveLoss

logger = logging.getLogger(__name__)

NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm)
TSE_PATTERN = re.compile(r"(^|\.)(visual_tse|textual_tse)\.")
LOSS_TERMS = ("loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho")
# per-sample tower outputs that `TagClipModel.heads` and its losses read (gradient caching caches these)
IMAGE_REPRESENTATIONS = ("pooler_output", "tse_tokens", "view_embeds", "view_logits", "cls_view_cos")
TEXT_REPRESENTATIONS = ("pooler_output", "tse_tokens", "tse_lengths")
LORA_ATTENTION = r"self_attn\.(q_proj|k_proj|v_proj|out_proj)"
LORA_EXPERTS = r"mlp\.experts\.\d+\.(fc1|fc2)"
LORA_HEADS = ["visual_tse", "textual_tse", "classifier", "img_router", "fea_router"]
ARCHITECTURE_KEYS = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "patch_size",
    "num_channels",
    "vocab_size",
    "max_position_embeddings",
    "projection_dim",
    "tse_embed_dim",
    "num_experts",
    "moe_layers",
    "block_type",
    "use_view_token",
    "use_tse",
    "image_size",
}


# ----------------------------------------------------------------------------- model and optimiser


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


NEW_HEADS = (
    "classifier.",
)  # sized by the training set: created here when the init folder has none or another size


@contextlib.contextmanager
def _transformers_errors_only() -> Iterator[None]:
    """No transformers warnings inside (its load report lists the new ID head a fine-tuning init lacks)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _check_init_weights(init_from: str, info: dict) -> None:
    """A fine-tuning init may lack only the ID classifier (a converted CLIP has none); anything else is an error."""
    mismatched = [key for key, *_ in info.get("mismatched_keys", [])]
    lacking = [k for k in [*info.get("missing_keys", []), *mismatched] if not k.startswith(NEW_HEADS)]
    if lacking or info.get("unexpected_keys"):
        raise ValueError(
            f"init_from {init_from} does not fit the model: missing/mismatched {sorted(lacking)[:5]}, unexpected "
            f"{sorted(info.get('unexpected_keys', []))[:5]} (expected a converted TAG-CLIP folder)"
        )


def needs_regrid(cfg: TagClipTrainConfig) -> bool:
    """Whether the ``init_from`` folder's image size differs from the recipe's ``image_size`` (re-grid at load)."""
    from modeling_tagclip import TagClipConfig

    if not cfg.init_from:
        return False
    init_hw = TagClipConfig.from_pretrained(cfg.init_from).vision_config.image_hw
    return tuple(init_hw) != tuple(int(v) for v in cfg.image_size)


def build_model(cfg: TagClipTrainConfig, num_identities: int, init_from: str | None = None):
    """TagClipModel from scratch (``model`` kwargs) or from ``init_from`` (a converted folder; default: the
    config's), ID head sized C."""
    from modeling_tagclip import TagClipConfig, TagClipModel

    height, width = (int(v) for v in cfg.image_size)
    overrides = copy.deepcopy(cfg.model)
    init_from = init_from or cfg.init_from
    if init_from:
        config = TagClipConfig.from_pretrained(init_from)
        _apply_overrides(config, overrides)
        config.num_identities = num_identities
        with warnings.catch_warnings(), _transformers_errors_only():  # the init is checked below instead
            warnings.simplefilter("ignore")
            model, info = TagClipModel.from_pretrained(
                init_from,
                config=config,
                ignore_mismatched_sizes=True,
                strict=False,
                output_loading_info=True,
            )
        _check_init_weights(init_from, info)
        if tuple(config.vision_config.image_hw) != (height, width):
            logger.warning(
                "init_from %s is %dx%d; position embeddings re-gridded to the recipe's image_size %dx%d",
                init_from,
                *config.vision_config.image_hw,
                height,
                width,
            )
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
    torch.manual_seed(cfg.seed)
    return TagClipModel(config)


def apply_lora(
    model, cfg: TagClipTrainConfig, base_dir: Path | None = None, base_reference: str | None = None
):
    """peft LoRA on the attention projections of both towers (+ experts' fc1/fc2 if configured).

    From scratch the base weights are saved to ``base_dir``; the adapter records ``base_reference`` (a portable
    name such as ``base`` relative to the run, or the ``init_from`` id) instead of an absolute path.
    """
    from peft import LoraConfig, get_peft_model

    lora = cfg.lora
    targets = LORA_ATTENTION + (f"|{LORA_EXPERTS}" if lora.target_experts else "")
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    if base_dir is not None:
        model.save_pretrained(base_dir)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=rf".*(text_model|vision_model)\.encoder\.layers\.\d+\.({targets})",
        modules_to_save=[h for h in LORA_HEADS if h in present],
    )
    model = get_peft_model(model, config)
    if base_reference is not None:
        model.peft_config["default"].base_model_name_or_path = base_reference
    return model


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def fused_supported(groups: list[dict[str, Any]]) -> bool:
    """AdamW's fused kernel (one pass over all tensors; about 5x faster than the per-tensor loop on a CPU) when
    every parameter is a floating tensor on a device that has it; the update it computes is AdamW's."""
    params = [p for group in groups for p in group["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


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
    """α ramp of the N-ITC soft labels (TAG-PR): ratio·i/len(loader) in epoch 0, then ratio."""
    return ratio * index / steps_per_epoch if epoch == 0 else ratio


# ----------------------------------------------------------------------------- loss


def training_loss(
    model, batch: dict, alpha: float | torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TAG-PR Eq. 11 of one step, each term once: ``forward(return_loss=True)`` (N-ITC / R-ITC over the all-gathered
    batch by the model's ``ContrastiveLoss``; ID / view / orthogonal terms on the local batch) → (loss, logs)."""
    out = model(**batch, return_loss=True, softlabel_alpha=alpha)
    return out.loss, loss_logs(out)


def loss_logs(out) -> dict[str, torch.Tensor]:
    """The detached loss terms (and router accuracy) of a ``TagClipOutput``, for logging."""
    logs = {k: getattr(out, k).detach().float() for k in LOSS_TERMS if getattr(out, k) is not None}
    logs["loss"] = out.loss.detach().float()
    if out.view_accuracy is not None:
        logs["view_accuracy"] = out.view_accuracy.detach().float()
    return logs


def encode_towers(model, chunk: dict) -> dict[str, dict[str, Any]]:
    """The per-sample representations of a chunk that the heads and losses need (no batch coupling)."""
    image = model.image_tower_features(chunk["pixel_values"], view_labels=chunk.get("view_labels"))
    text = model.text_tower_features(chunk["input_ids"])
    return {
        "image": {k: image[k] for k in IMAGE_REPRESENTATIONS},
        "text": {k: text[k] for k in TEXT_REPRESENTATIONS},
    }


def cached_training_loss(
    model,
    batch: dict,
    alpha: float | torch.Tensor | None,
    chunks: int,
    backward,
    autocast=contextlib.nullcontext,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``training_loss`` and its backward by gradient caching over ``chunks`` chunks of ``batch``: the towers run
    per chunk, TSE (its BatchNorm), the heads and every loss term once on the whole batch, as in one full-batch
    step → (detached loss, logs); the gradients are in ``.grad``. ``model`` is the unwrapped ``TagClipModel``."""

    def encode(chunk):
        with autocast():
            return encode_towers(model, chunk)

    def loss_fn(reps):
        with autocast():
            image = model.embed_tse(reps["image"], model.visual_tse)
            text = model.embed_tse(reps["text"], model.textual_tse)
            views, ids = batch.get("view_labels"), batch.get("person_ids")
            out = model.heads(image, text, views, ids, return_loss=True, softlabel_alpha=alpha)
        return out.loss, loss_logs(out)

    return grad_cache.cached_step(encode, loss_fn, batch, chunks, backward)


# ----------------------------------------------------------------------------- the task


class TagClipTask:
    """TAG-CLIP text-to-person retrieval (``--task retrieval``)."""

    project = "tagclip"
    phase = "fine-tuning"

    def __init__(self, cfg: TagClipTrainConfig):
        self.cfg = cfg
        self.splits: data.DataSplits | None = None
        self.processor = None
        self.pair_ds = None
        self.pixel_table: torch.Tensor | None = None  # uint8 -> pixel_values, on the training device
        self.base_model = None
        self.schedule = None
        self.unused = UnusedParameters()

    # data
    def prepare(self) -> None:
        from modeling_tagclip import TagClipProcessor

        self.splits = data.prepare_data(self.cfg)
        self.processor = TagClipProcessor.from_defaults(*(int(v) for v in self.cfg.image_size))
        self.pixel_table = data.pixel_table(self.processor.image_processor)

    def has_validation(self) -> bool:
        return self.splits.validation is not None

    def build_loader(self):
        loader, self.pair_ds = data.make_train_loader(self.cfg, self.splits.train, self.processor)
        return loader

    def set_epoch(self, epoch: int) -> None:
        pass  # the loader's EpochSampler carries the epoch into every item

    def sampler_state(self) -> dict | None:
        return None  # the order is a function of (seed, epoch)

    def load_sampler_state(self, state: dict) -> None:
        raise ValueError("a TAG-CLIP run has no sampler state; is this a ViSA checkpoint?")

    # model
    def clip_init(self, accelerator) -> str:
        """The run's pre-trained CLIP init (``pretrain_clip``): a phase of the loop that every process takes part in."""
        from modeling_tagclip.engine.clip_pretraining import clip_init_for_run

        return str(clip_init_for_run(self.splits.train, self.cfg, accelerator))

    def build_model(self, accelerator):
        cfg = self.cfg
        init = None
        if cfg.pretrain_clip.epochs and cfg.init_from:
            accelerator.print(
                f"init_from {cfg.init_from}: no pre-training phase (pretrain_clip is for runs from scratch)"
            )
        elif cfg.pretrain_clip.epochs:
            init = self.clip_init(accelerator)
        model = build_model(cfg, len(self.splits.id_mapping), init)
        if cfg.freeze_patch_embedding:
            model.vision_model.embeddings.patch_embedding.requires_grad_(False)
        if (
            cfg.lora.enabled
        ):  # the adapter's base: the init folder as is, else the run's own base/ (re-gridded)
            own_base = not cfg.init_from or needs_regrid(cfg)
            base_dir = Path(cfg.output_dir) / "base" if own_base else None
            reference = "../../base" if own_base else cfg.init_from
            with accelerator.main_process_first():
                model = apply_lora(model, cfg, base_dir if accelerator.is_main_process else None, reference)
                if own_base and accelerator.is_main_process:  # a complete model folder: loadable on its own
                    self.processor.save_pretrained(base_dir)
        trainable, total = count_parameters(model)
        accelerator.print(
            f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)"
        )
        self.base_model = model.get_base_model() if cfg.lora.enabled else model
        self.base_model.contrastive_loss = ContrastiveLoss(gather=cfg.gather_negatives)
        if cfg.grad_cache_chunks > 1:
            base = self.base_model
            grad_cache.check_per_sample(
                [base.vision_model, base.text_model, base.visual_projection, base.text_projection]
            )
            size = -(-cfg.per_device_batch_size // cfg.grad_cache_chunks)
            accelerator.print(
                f"gradient caching: each batch of {cfg.per_device_batch_size} pairs in "
                f"{cfg.grad_cache_chunks} chunks of at most {size}"
            )
        return model

    def build_optimizer(self, model):
        cfg = self.cfg
        groups = param_groups(model, cfg.learning_rate, cfg.weight_decay, cfg.tse_lr_ratio)
        for group in groups:
            group["initial_lr"] = group["lr"]
        return torch.optim.AdamW(
            groups,
            lr=cfg.learning_rate,
            betas=tuple(cfg.adam_betas),
            eps=cfg.adam_eps,
            fused=fused_supported(groups),
        )

    def set_learning_rate(self, optimizer, step: int, epoch: int, steps_per_epoch: int, total: int) -> float:
        """Per-iteration cosine schedule, as LambdaLR(base_lr × schedule[i] / lr) computed it."""
        cfg = self.cfg
        if self.schedule is None:
            warmup = round(cfg.warmup_epochs * steps_per_epoch)
            self.schedule = cosine_schedule(cfg.learning_rate, cfg.lr_end, total, warmup, cfg.lr_start)
        factor = float(self.schedule[min(step, total - 1)] / cfg.learning_rate)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        return float(self.schedule[min(step, total - 1)])

    def training_step(self, model, batch, step: int, epoch: int, steps_per_epoch: int, accelerator):
        ratio = self.cfg.softlabel_ratio
        ratio = self.base_model.config.softlabel_ratio if ratio is None else float(ratio)
        alpha = softlabel_alpha(ratio, epoch, step - epoch * steps_per_epoch, steps_per_epoch)
        # a tensor, so a compiled step is not re-specialised per value; float64 keeps 1 - α as exact as a float
        alpha = torch.tensor(alpha, dtype=torch.float64)
        self.pixel_table = self.pixel_table.to(batch["pixel_values"].device)  # moved once
        batch = {**batch, "pixel_values": data.normalize_pixels(batch["pixel_values"], self.pixel_table)}
        chunks = self.cfg.grad_cache_chunks
        if chunks > 1:  # the gradients are accumulated here; the loop's backward skips the detached loss
            loss, logs = cached_training_loss(
                self.base_model, batch, alpha, chunks, accelerator.backward, accelerator.autocast
            )
            grad_cache.average_gradients(list(model.parameters()))
        else:
            loss, logs = training_loss(model, batch, alpha)
            loss = self.unused.touch(loss, model)  # DDP: parameters this step did not use get a zero gradient
        logs["alpha"] = alpha
        logs["logit_scale"] = self.base_model.logit_scale.detach().exp()
        return loss, logs

    def clip_gradients(self, accelerator, model) -> None:
        self.unused.release()  # right after backward (the loop's post-backward hook)
        if self.cfg.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), float(self.cfg.max_grad_norm))

    # evaluation
    def _eval_routing(self, model):
        """Context: the vision tower routes with ``eval_routing`` (deterministic) for evaluation and saving."""
        return _RoutingAs(model, self.cfg.eval_routing)

    def evaluate(self, model, split: str) -> dict[str, Any]:
        from modeling_tagclip.evaluation.text_retrieval import evaluate_model

        dataset = self.splits.test if split == "test" else self.splits.validation
        with self._eval_routing(model):
            result = evaluate_model(
                model,
                self.processor,
                dataset,
                batch_size=self.cfg.eval_batch_size,
                probe=False,
                progress=False,
                max_length=self.cfg.text_max_length,
            )
        metrics = {k: float(result[k]) for k in ("R@1", "R@5", "R@10", "mAP", "mINP")}
        return {"metric": metrics["R@1"], **metrics}

    def best_path(self) -> Path:
        best = Path(self.cfg.output_dir) / "best"
        return best / "adapter" if self.cfg.lora.enabled and not self.cfg.lora.merge else best

    def save_best(self, accelerator, model) -> Path:
        """``best/``: model + processor + retrieval pipeline; LoRA: ``best/adapter`` (+ merged model in ``best/``)."""
        from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline

        best = Path(self.cfg.output_dir) / "best"
        shutil.rmtree(best, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        with self._eval_routing(unwrapped):
            if self.cfg.lora.enabled:
                unwrapped.save_pretrained(best / "adapter")
                self.processor.save_pretrained(best / "adapter")
                if self.cfg.lora.merge:
                    save_with_pipeline(copy.deepcopy(unwrapped).merge_and_unload(), self.processor, best)
            else:
                save_with_pipeline(unwrapped, self.processor, best)
        return best

    def summary(self) -> dict[str, Any]:
        s = self.splits
        return {
            "config": _plain_config(self.cfg),
            "data": str(self.cfg.data_dir),
            "split": self.cfg.test_split,
            "train_images": len(s.train),
            "train_identities": len(s.id_mapping),
            "validation_images": len(s.validation) if s.validation is not None else 0,
            "test_images": len(s.test),
        }

    def final_evaluation(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Reload ``best/`` from disk, evaluate it on the test split, write eval_results.json and plots."""
        return evaluate_best(self.cfg, self.splits.test, extra)


class _RoutingAs:
    """Temporarily set the vision tower's image-level routing (e.g. argmax for a run trained with gumbel)."""

    def __init__(self, model, routing: str):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.config, self.routing, self.saved = base.config.vision_config, routing, None

    def __enter__(self):
        self.saved, self.config.routing = self.config.routing, self.routing

    def __exit__(self, *exc) -> None:
        self.config.routing = self.saved


def _plain_config(cfg) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)


def evaluate_best(cfg: TagClipTrainConfig, test_ds, extra: dict[str, Any]) -> dict[str, Any]:
    """Test metrics of the saved ``best/`` → ``eval_results.json`` (+ plots); printed before it is written."""
    from modeling_tagclip.evaluation.text_retrieval import load_model, run_retrieval, summarize

    output_dir = Path(cfg.output_dir)
    best = output_dir / "best"
    path = best / "adapter" if cfg.lora.enabled and not cfg.lora.merge else best
    model, processor = load_model(path, "cuda" if torch.cuda.is_available() else "cpu")
    run = run_retrieval(model, processor, test_ds, batch_size=cfg.eval_batch_size)
    result = {**summarize(run), **extra}
    print(
        f"test R@1 {result['R@1']:.2f}  R@5 {result['R@5']:.2f}  mAP {result['mAP']:.2f}  mINP {result['mINP']:.2f}"
        f"  (chance R@1 {result['chance_R@1']:.2f}; best step {result.get('best_step')}; "
        f"train {result.get('train_time_s', 0):.0f}s)"
    )
    write_json(output_dir / "eval_results.json", result, indent=2, default=str, allow_nan=True)
    if cfg.plots:
        from modeling_tagclip.plots import retrieval_grid, training_curves

        if (output_dir / "metrics.jsonl").is_file():
            training_curves(output_dir / "metrics.jsonl", output_dir / "training_curves.png")
        retrieval_grid(run, output_dir / "retrieval_grid.png")
    return result


def eval_only(cfg: TagClipTrainConfig) -> dict[str, Any]:
    """Evaluate ``OUTPUT_DIR/best`` on the test split."""
    test = data.load_split(cfg, cfg.test_split)
    return evaluate_best(
        cfg, test, {"config": _plain_config(cfg), "data": str(cfg.data_dir), "split": cfg.test_split}
    )
