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
        from modeling_tagclip.evaluation.arguments import parse_reid_args as parse
    else:
        from modeling_tagclip.evaluation.arguments import parse_retrieval_args as parse
    parsed = parse(argv)  # --help and a bad flag answer before the evaluator (torch) is imported
    if args.task == "reid":
        from modeling_tagclip.evaluation.reid import run
    else:
        from modeling_tagclip.evaluation.text_retrieval import run
    return run(parsed)
