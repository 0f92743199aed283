"""Accelerator set-up shared by both families: trackers, the torch 2.13 compile workaround, seeding, quiet logs."""

from __future__ import annotations

import logging
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
    several CPU processes. ``keep_until_step`` (resuming) keeps the metric records up to that step.
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import ProjectConfiguration

    from modeling_tagclip.engine.tracker import JsonlTracker

    output_dir = Path(output_dir)
    try:
        import tensorboard  # noqa: F401

        trackers = ["tensorboard"]
    except ImportError:
        trackers = []
    if mixed_precision in ("fp16", "bf16") and not torch.cuda.is_available():
        logger.warning("mixed_precision %s needs a GPU: training in fp32 on CPU", mixed_precision)
        mixed_precision = "no"
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / "logs")
        ),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],  # idle experts
    )
    if accelerator.is_main_process:
        accelerator.log_with.append(JsonlTracker(output_dir / "metrics.jsonl", keep_until_step))
        accelerator.init_trackers(project, config=flat_config(config))
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
