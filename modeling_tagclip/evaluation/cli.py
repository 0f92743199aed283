"""``tagclip eval``: text-to-person retrieval (``--task retrieval``, default; ``text_retrieval.py``) or aerial-ground
re-ID (``--task reid``; ``reid.py``), the same ``--task`` switch as ``tagclip train``."""

from __future__ import annotations

import argparse

from modeling_tagclip.evaluation.arguments import add_arguments, check_task_flags

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """Evaluate with the evaluator of ``--task``; the exit status."""
    check_task_flags(args)
    if args.task == "reid":
        from modeling_tagclip.evaluation.reid import run as evaluate
    else:
        from modeling_tagclip.evaluation.text_retrieval import run as evaluate
    evaluate(args)
    return 0
