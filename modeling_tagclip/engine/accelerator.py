"""Accelerator set-up shared by both families: trackers, DDP without ``find_unused_parameters``, the torch 2.13
compile workaround, seeding, quiet logs."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def make_accelerator(
    mixed_precision: str | None,
    output_dir: str | Path,
    keep_until_step: int | None,
    project: str,
    config: dict,
):
    """Accelerator + trackers: ``metrics.jsonl`` (main process) and TensorBoard if installed.

    Built before anything touches ``PartialState``: it reads ``ACCELERATE_USE_CPU`` and only then picks gloo for
    several CPU processes. ``keep_until_step`` (resuming) keeps the metric records up to that step. DDP runs with
    its default ``find_unused_parameters=False``: the tasks pass each loss through [`UnusedParameters`].
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from modeling_tagclip.engine.tracker import JsonlTracker

    output_dir = Path(output_dir)
    try:
        import tensorboard  # noqa: F401

        trackers = ["tensorboard"]
    except ImportError:
        trackers = []
    mixed_precision = resolve_mixed_precision(mixed_precision)
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / "logs")
        ),
    )
    if accelerator.is_main_process:
        accelerator.log_with.append(JsonlTracker(output_dir / "metrics.jsonl", keep_until_step))
        accelerator.init_trackers(project, config=flat_config(config))
    if accelerator.state.dynamo_plugin.backend.value.lower() != "no":
        avoid_autograd_cache_bug()
    return accelerator


def resolve_mixed_precision(mixed_precision: str | None) -> str | None:
    """What the Accelerator gets: ``auto`` is bf16 on a GPU that supports it, else fp16 (no loss scaling
    needed with bf16); fp16 / bf16 / auto on a machine without CUDA train in fp32 (with a warning). A config
    value wins over `accelerate launch --mixed_precision` (warned when they differ); None leaves it to accelerate."""
    if mixed_precision is None:
        return None
    resolved = mixed_precision
    if mixed_precision in ("fp16", "bf16", "auto") and not torch.cuda.is_available():
        logger.warning("mixed_precision %s needs a GPU: training in fp32 on CPU", mixed_precision)
        resolved = "no"
    elif mixed_precision == "auto":
        resolved = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher in ("fp16", "bf16") and launcher != resolved:
        logger.warning(
            "accelerate launch asked for mixed precision %s, the config's mixed_precision %s gives %s: the "
            "config wins (pass --mixed_precision %s to train.py to change it)",
            *(launcher, mixed_precision, resolved, launcher),
        )
    return resolved


class _ZeroGradients(torch.autograd.Function):
    """Identity on the loss whose backward also gives each extra input (a parameter) a zero gradient."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


def reached_leaves(loss: torch.Tensor) -> set[int]:
    """``id`` of every leaf tensor that ``loss``'s autograd graph accumulates a gradient into (host-side walk)."""
    seen, stack, leaves = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return leaves


def touch_parameters(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``loss`` (same value, bit for bit) with ``params`` in its graph: each gets a zero gradient in backward."""
    return _ZeroGradients.apply(loss, *params) if params else loss


class UnusedParameters:
    """DDP without ``find_unused_parameters``: every trainable parameter takes part in every step's graph.

    DDP's reducer waits for the gradient of every parameter it tracks; one a step does not reach (an idle
    expert, the head of a switched-off loss such as TAG-CLIP's ``img_router`` / ``classifier`` without the view
    / ID loss) stops it with "Expected to have finished reduction". [`touch`] walks the loss's autograd graph on
    the host (no device sync) and attaches the unreached parameters through an identity whose backward gives
    them a zero gradient: the loss and every other gradient stay bit-identical. The ranks also agree (one small
    gloo all-reduce of flags) on the parameters that no rank used; [`release`], right after backward, sets their
    gradient back to ``None``, so the optimiser skips them (no AdamW weight decay or moment update), as in one
    process and as DDP with ``find_unused_parameters=True`` (the reference) did. A parameter used by some ranks
    gets the mean over all ranks, zeros included, as before. One process (no process group): both are no-ops.
    """

    def __init__(self):
        self.params: list[torch.Tensor] | None = None
        self.group = None
        self.unused_everywhere: list[torch.Tensor] = []

    @staticmethod
    def distributed() -> bool:
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def touch(self, loss: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
        """``loss`` with the trainable parameters of ``model`` it does not reach attached (see the class)."""
        if not (loss.requires_grad and self.distributed()):
            return loss
        dist = torch.distributed
        if self.params is None:
            self.params = [p for p in model.parameters() if p.requires_grad]
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        reached = reached_leaves(loss)
        unused = [id(p) not in reached for p in self.params]
        counts = torch.tensor(unused, dtype=torch.int32)  # on the host: no device sync
        dist.all_reduce(counts, group=self.group)  # -> the number of ranks that did not use each parameter
        world = dist.get_world_size()
        self.unused_everywhere = [p for p, n in zip(self.params, counts.tolist(), strict=True) if n == world]
        return touch_parameters(loss, [p for p, u in zip(self.params, unused, strict=True) if u])

    def release(self) -> None:
        """After backward: no gradient (``None``) for the parameters that no rank used in this step."""
        for param in self.unused_everywhere:
            param.grad = None
        self.unused_everywhere = []


def avoid_autograd_cache_bug() -> None:
    """Turn off the AOTAutograd cache on torch 2.13 when compiling (``accelerate launch --dynamo_backend``).

    With it on, inductor replaying this model's view outputs hit a use-after-free (pytorch/pytorch#185630):
    a garbage-shape RuntimeError or a segfault in the first training step. Without it the graphs run correctly.
    """
    import torch._functorch.config as functorch_config

    if torch.__version__.startswith("2.13") and functorch_config.enable_autograd_cache:
        functorch_config.enable_autograd_cache = False
        logger.info("torch.compile: AOTAutograd cache off (torch 2.13 bug pytorch/pytorch#185630)")


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the global torch RNG for one step (dropout, gate noise): resume-exact, rank-specific."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed every global RNG a training step may use from (seed, step, rank): no RNG state to checkpoint."""
    torch.manual_seed(step_seed(seed, step, rank))


def quiet_libraries() -> None:
    """INFO logging for the run, warnings only from the libraries; no datasets / hub progress bars."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in (
        "accelerate",
        "datasets",
        "transformers",
        "huggingface_hub",
        "safetensors",
        "faiss",
        "faiss.loader",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    import datasets
    import huggingface_hub.utils

    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def flat_config(cfg: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config → flat ``a.b`` keys with scalar values (trackers accept only scalars)."""
    flat: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            plain = isinstance(value, (int, float, str, bool)) or value is None
            flat[f"{prefix}{key}"] = value if plain else str(value)
    return flat
