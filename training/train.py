"""Train TAG-CLIP (``--task retrieval``, default) or ViSA (``--task reid``) with accelerate on CPU, one GPU or many.

With no arguments, ``accelerate launch training/train.py`` renders the synthetic aerial-ground set into
``data/synthetic`` (if absent), trains a small TAG-CLIP from scratch with ``training/configs/default.yaml``,
selects the best epoch on a validation split carved from train by identity, evaluates it on the test split and
prints R@1/mAP. Outputs in ``--output_dir``: ``best/`` (model + processor + retrieval pipeline; ``best/adapter``
with ``--lora``), ``checkpoints/step_N`` (safetensors + JSON), ``metrics.jsonl``, ``eval_results.json``,
``training_curves.png`` and ``retrieval_grid.png``. ``--help`` lists every setting of both tasks.

Examples::

    accelerate launch training/train.py
    accelerate launch training/train.py --config training/configs/tag-pedes.yaml --init_from models/clip-init
    accelerate launch training/train.py --resume_from_checkpoint latest
    accelerate launch training/train.py --set model.vision_config.num_hidden_layers=4 --learning_rate 2e-3
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 training/train.py   # 2 gloo ranks
    accelerate launch training/train.py --task reid --output_dir outputs/visa-synthetic      # ViSA re-ID
    accelerate launch training/train.py --config training/configs/visa-cargo.yaml --data_dir datasets/CARGO

With several processes the contrastive losses (N-ITC, R-ITC) use the all-gathered batch as negatives, with
gradients; the per-image terms (ID, view, orthogonal) stay local. The engine lives in
``modeling_tagclip.engine``; this file is only the command.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (accelerate launch): make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_tagclip.engine.config import load_config, parse_args  # noqa: E402

__all__ = ["load_config", "main", "make_task"]


def make_task(cfg):
    """The family's task object for a config (``TagClipTrainConfig`` or ``ViSATrainConfig``)."""
    if cfg.task == "reid":
        from modeling_tagclip.engine.tasks.visa import ViSATask

        return ViSATask(cfg)
    from modeling_tagclip.engine.tasks.tagclip import TagClipTask

    return TagClipTask(cfg)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Parse flags, then train (or ``--eval_only``); returns the test results on the main process."""
    from modeling_tagclip.engine.accelerator import quiet_libraries
    from modeling_tagclip.engine.loop import train

    args, cfg = parse_args(argv)
    quiet_libraries()
    import modeling_tagclip  # noqa: F401  (registers the Auto classes)

    if args.eval_only:
        if cfg.task == "reid":
            from modeling_tagclip.engine.tasks.visa import eval_only
        else:
            from modeling_tagclip.engine.tasks.tagclip import eval_only
        return eval_only(cfg)
    result = train(make_task(cfg), resume=args.resume_from_checkpoint, stop_after_steps=args.stop_after_steps)
    if result is not None and cfg.task == "retrieval":
        from modeling_tagclip.engine.tasks.tagclip import next_steps

        print(next_steps(cfg))
    return result


if __name__ == "__main__":
    from modeling_tagclip.engine.config import ConfigError

    try:
        main()
    except ConfigError as error:  # a settings mistake: the message, not a traceback
        sys.exit(f"train.py: error: {error}")
