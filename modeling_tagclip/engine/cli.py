"""``tagclip train`` (and ``accelerate launch training/train.py``, the same code): train TAG-CLIP
(``--task retrieval``, default) or ViSA (``--task reid``) with accelerate on CPU, one GPU or many.

With no arguments it renders the synthetic aerial-ground set into ``data/synthetic`` (if absent), trains a small
TAG-CLIP from scratch with the ``default`` recipe, selects the best epoch on a validation split carved from
train by identity, evaluates it on the test split and prints R@1/mAP. Outputs in ``--output``: ``best/``
(model + processor + retrieval pipeline; ``best/adapter`` with ``--lora``), ``checkpoints/step_N``
(safetensors + JSON), ``metrics.jsonl``, ``eval_results.json``, ``training_curves.png`` and
``retrieval_grid.png``. ``--help`` lists every setting of both tasks; ``--list-configs`` the shipped recipes.

With several processes the contrastive losses (N-ITC, R-ITC) use the all-gathered batch as negatives, with
gradients; the per-image terms (ID, view, orthogonal) stay local.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.engine.config import (
    ConfigError,
    add_arguments,
    check_init_from,
    config_from_args,
    load_config,
    parse_args,
)
from modeling_tagclip.progress import line_buffered_output, main_process

__all__ = ["add_arguments", "command", "load_config", "main", "make_task", "run"]


def make_task(cfg):
    """The family's task object for a config (``TagClipTrainConfig`` or ``ViSATrainConfig``)."""
    if cfg.task == "reid":
        from modeling_tagclip.engine.tasks.visa import ViSATask

        return ViSATask(cfg)
    from modeling_tagclip.engine.tasks.tagclip import TagClipTask

    return TagClipTask(cfg)


def _starting(prog: str, cfg) -> None:
    """The run's first line, before torch is imported (which takes seconds on a busy machine)."""
    model = "ViSA" if cfg.task == "reid" else "TAG-CLIP"
    print(f"{prog}: {model} run in {cfg.output_dir} (data: {cfg.data_dir}); loading torch ...")


def main(argv: Sequence[str] | None = None, prog: str = "tagclip train") -> dict[str, Any] | None:
    """Parse flags, then train (or ``--eval-only``); returns the test results on the main process."""
    announce = functools.partial(_starting, prog) if main_process() else None
    args, cfg = parse_args(argv, prog=prog, announce=announce)  # --help and bad flags answer before torch
    return train_with(args, cfg)


def train_with(args: argparse.Namespace, cfg) -> dict[str, Any] | None:
    """Train (or ``--eval-only``) with a validated config; None for ``--list-configs`` (no config)."""
    if cfg is None:  # --list-configs
        return None
    from modeling_tagclip.engine.accelerator import quiet_libraries
    from modeling_tagclip.engine.loop import train

    check_init_from(cfg)
    quiet_libraries()
    from modeling_tagclip import register_auto_classes

    register_auto_classes()

    if args.eval_only:
        if cfg.task == "reid":
            from modeling_tagclip.engine.tasks.visa import eval_only
        else:
            from modeling_tagclip.engine.tasks.tagclip import eval_only
        return eval_only(cfg)
    result = train(make_task(cfg), resume=args.resume_from_checkpoint, stop_after_steps=args.stop_after_steps)
    if result is not None:
        print(outputs(cfg))
        print(next_steps(cfg))
    return result


def outputs(cfg) -> str:
    """Where the run's results are: ``best/``, ``eval_results.json``, ``metrics.jsonl`` and the plots."""
    output = Path(cfg.output_dir)
    plots = ", ".join(str(p) for p in sorted(output.glob("*.png")))
    return (
        f"best model: {output / 'best'}\nresults: {output / 'eval_results.json'}\n"
        f"metrics: {output / 'metrics.jsonl'}" + (f"\nplots: {plots}" if plots else "")
    )


def next_steps(cfg) -> str:
    """The main job's last lines: what to do with the model it saved."""
    best = f"{cfg.output_dir}/best"
    if cfg.task == "reid":
        return f"next: tagclip eval --task reid --model {best} --data {cfg.data_dir} --grid grid.png"
    return (
        f"next: search a folder of person images with the model:\n"
        f"  tagclip index --model {best} --images {cfg.data_dir}/images --output gallery-index\n"
        f'  tagclip search --index gallery-index "a man in a red jacket with a black backpack"'
    )


def _one_line(error: Exception) -> bool:
    """Whether ``error`` is a settings, checkpoint or disk problem (one line, no traceback)."""
    if isinstance(error, (ConfigError, OSError)):
        return True
    from modeling_tagclip.engine.checkpoint import CheckpointError  # torch: only once something else failed

    return isinstance(error, CheckpointError)


def _guarded(work: Callable[[], object], prog: str) -> int:
    """Run ``work``: a settings mistake (exit 2), an unusable checkpoint or a disk error (exit 1) is one
    ``PROG: error: ...`` line, not a traceback."""
    line_buffered_output()
    try:
        work()
    except Exception as error:
        if not _one_line(error):
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    return 0


def command(argv: Sequence[str] | None = None, prog: str = "tagclip train") -> int:
    """``training/train.py``: parse ``argv`` under ``prog`` and train (errors as in ``run``)."""
    return _guarded(lambda: main(argv, prog=prog), prog)


def run(args: argparse.Namespace) -> int:
    """``tagclip train`` with its parsed flags; the exit status."""
    prog = "tagclip train"
    announce = functools.partial(_starting, prog) if main_process() else None
    return _guarded(lambda: train_with(args, config_from_args(args, announce)), prog)
