"""``tagclip eval``'s flags, importable without torch or transformers (``--help`` and a bad flag answer before the
evaluator is imported): the flags of both tasks in one parser, as ``tagclip train``'s, each task's in its group."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from modeling_tagclip.flags import (
    EVAL_TASK_HELP,
    nonnegative_int,
    positive_int,
    renamed_values,
    torch_device,
    usage_error,
)

__all__ = ["add_arguments", "check_task_flags", "parse_reid_args", "parse_retrieval_args"]

DESCRIPTION = (
    "Evaluate a model on a dataset's test protocol and print its metrics: text-to-person retrieval of a TAG-CLIP "
    "model (--task retrieval: R@1/5/10, mAP, mINP, per view) or aerial-ground re-ID of a ViSA model (--task reid: "
    "every protocol of the dataset). Results JSON and a retrieval grid on request."
)
# the flags of one task only (their destinations): given with the other task, they are a usage error
TASK_FLAGS = {
    "retrieval": ("split", "image_dir", "dtype", "distributed", "no_probe", "trust_remote_code"),
    "reid": ("dataset", "rerank", "rerank_k1", "rerank_k2", "rerank_lambda"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip eval`` (both tasks; ``--task`` picks the evaluator in ``run``)."""
    p.description = DESCRIPTION
    p.add_argument("--task", choices=("retrieval", "reid"), default="retrieval", help=EVAL_TASK_HELP)
    p.add_argument(
        "--model",
        required=True,
        help="saved model folder or Hub id: TAG-CLIP (save_pretrained, a "
        "LoRA run or its adapter), ViSA with --task reid (save_pretrained or converted)",
    )
    p.add_argument(
        "--data",
        required=True,
        help="dataset folder (TAG-PEDES layout: {split}_reid.json; re-ID: "
        "the dataset's folder or its parent datasets/ folder)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=64, help="images per forward pass (captions: 4x)"
    )
    p.add_argument("--workers", type=nonnegative_int, default=2, help="image decoding worker processes")
    p.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--output", default=None, help="JSON file for the results (default: print only)")
    p.add_argument("--grid", default=None, help="PNG file for a grid of example queries and their top-5")
    text = p.add_argument_group("TAG-CLIP (--task retrieval)")
    text.add_argument("--split", default="test", help="annotation split to evaluate ({split}_reid.json)")
    text.add_argument("--image-dir", default=None, help="image root (default: DATA/images)")
    text.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="autocast dtype (bf16 is the one to use on a GPU)",
    )
    renamed_values(text, "--amp", "dtype", {"none": "fp32", "bf16": "bf16", "fp16": "fp16"})
    text.add_argument(
        "--distributed",
        action="store_true",
        help="under torchrun / accelerate launch: split encoding and scoring over the ranks",
    )
    text.add_argument("--no-probe", action="store_true", help="skip the linear view probe")
    text.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model type that is not this package's to run the code its folder ships",
    )
    reid = p.add_argument_group("ViSA (--task reid); re-ranking: Zhong et al. 2017, off as in the reference")
    reid.add_argument(
        "--dataset", default=None, help="cargo, agreidv2, lagper, market1501, synthetic (default: detect)"
    )
    reid.add_argument("--rerank", action="store_true", help="rank by k-reciprocal re-ranked distances")
    # the defaults of metrics.rerank.RerankConfig (a test keeps them equal; that module imports torch)
    reid.add_argument("--rerank-k1", type=positive_int, default=20, help="k-reciprocal neighbours")
    reid.add_argument("--rerank-k2", type=positive_int, default=6, help="query expansion neighbours")
    reid.add_argument("--rerank-lambda", type=float, default=0.3, help="weight of the original distance")


def check_task_flags(args: argparse.Namespace) -> None:
    """A flag of the other task set to a value of its own is a usage error naming the task it belongs to."""
    other = "reid" if args.task == "retrieval" else "retrieval"
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    for action in parser._actions:
        if action.dest in TASK_FLAGS[other] and getattr(args, action.dest) != action.default:
            usage_error(
                "tagclip eval",
                f"{action.option_strings[0]} is a flag of --task {other}, not of --task {args.task}",
            )


def parse_eval_args(argv: Sequence[str] | None, task: str) -> argparse.Namespace:
    """``tagclip eval --task TASK ARGV`` as ``run`` receives it."""
    from modeling_tagclip.cli import parse

    args = parse("eval", ["--task", task, *(argv or [])])
    check_task_flags(args)
    return args


def parse_retrieval_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``tagclip eval`` (``--task retrieval``, text-to-image retrieval of a TAG-CLIP model)."""
    return parse_eval_args(argv, "retrieval")


def parse_reid_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``tagclip eval --task reid`` (aerial-ground re-ID of a ViSA model)."""
    return parse_eval_args(argv, "reid")
