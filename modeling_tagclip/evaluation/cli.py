"""``tagclip eval``: text-to-person retrieval (``--task retrieval``, default; ``text_retrieval.py``) or aerial-ground
re-ID (``--task reid``; ``reid.py``), the same ``--task`` switch as ``tagclip train``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from modeling_tagclip.flags import accept_both_spellings


def main(argv: Sequence[str] | None = None) -> Any:
    """Pick the evaluator by ``--task`` and run it with the rest of the arguments."""
    picker = accept_both_spellings(argparse.ArgumentParser(prog="tagclip eval", add_help=False))
    picker.add_argument("--task", choices=("retrieval", "reid"), default="retrieval")
    args, _ = picker.parse_known_args(argv)
    if args.task == "reid":
        from modeling_tagclip.evaluation.reid import main as evaluate
    else:
        from modeling_tagclip.evaluation.text_retrieval import main as evaluate
    return evaluate(argv)
