"""``tagclip eval``'s argument parsers, importable without torch or transformers (``--help`` and a bad flag
answer before the evaluator is imported)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from modeling_tagclip.flags import (
    accept_both_spellings,
    add_task_flag,
    nonnegative_int,
    positive_int,
    show_defaults,
    torch_device,
)

__all__ = ["parse_reid_args", "parse_retrieval_args"]

REID_DESCRIPTION = "Evaluate a ViSA model on an image re-ID dataset: every protocol of the dataset, results JSON, retrieval grid."


def parse_retrieval_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``tagclip eval`` (``--task retrieval``, text-to-image retrieval of a TAG-CLIP model)."""
    p = argparse.ArgumentParser(
        prog="tagclip eval", description="Text-to-image retrieval evaluation of a TAG-CLIP model."
    )
    add_task_flag(p, "retrieval")
    p.add_argument(
        "--model", required=True, help="saved model folder (save_pretrained) or peft adapter folder"
    )
    p.add_argument(
        "--data", required=True, help="dataset directory or name (see modeling_tagclip.data.text_retrieval)"
    )
    p.add_argument("--split", default="test", help="annotation split to evaluate ({split}_reid.json)")
    p.add_argument("--image_dir", default=None, help="image root (default: DIR/images for TAG-PEDES folders)")
    p.add_argument("--batch_size", type=positive_int, default=64, help="image batch size (captions: 4x)")
    p.add_argument("--output", default=None, help="JSON file for the results (default: print only)")
    p.add_argument("--grid", default=None, help="PNG file for a grid of example queries and their top-5")
    p.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="autocast dtype (default none: fp32; bf16 is the one to use on a GPU)")  # fmt: skip
    p.add_argument("--num_workers", type=nonnegative_int, default=2, help="image decoding worker processes")
    p.add_argument(
        "--distributed", action="store_true",
        help="under torchrun / accelerate launch: split encoding and scoring over the ranks",
    )  # fmt: skip
    p.add_argument("--no_probe", action="store_true", help="skip the linear view probe")
    p.add_argument(
        "--trust_remote_code", action="store_true",
        help="allow a model type that is not this package's to run the code its folder ships",
    )  # fmt: skip
    return accept_both_spellings(show_defaults(p)).parse_args(argv)


def parse_reid_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``tagclip eval --task reid`` (aerial-ground re-ID of a ViSA model)."""
    p = argparse.ArgumentParser(prog="tagclip eval --task reid", description=REID_DESCRIPTION)
    add_task_flag(p, "reid")
    p.add_argument(
        "--model", required=True, help="saved ViSA folder (save_pretrained / converted checkpoint)"
    )
    p.add_argument("--data", required=True, help="dataset folder (or its parent `datasets/` folder)")
    p.add_argument(
        "--dataset", default=None, help="cargo, agreidv2, lagper, market1501, synthetic (default: detect)"
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per forward pass")
    p.add_argument("--num-workers", type=nonnegative_int, default=2, help="image decoding worker processes")
    p.add_argument("--device", type=torch_device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--output", default=None, help="JSON file for the results (default: print only)")
    p.add_argument("--grid", default=None, help="PNG file for a retrieval grid (default: none)")
    rerank = p.add_argument_group("re-ranking (Zhong et al. 2017; off by default, as in the reference)")
    rerank.add_argument("--rerank", action="store_true", help="rank by k-reciprocal re-ranked distances")
    # the defaults of metrics.rerank.RerankConfig (a test keeps them equal; that module imports torch)
    rerank.add_argument("--rerank-k1", type=positive_int, default=20, help="k-reciprocal neighbours")
    rerank.add_argument("--rerank-k2", type=positive_int, default=6, help="query expansion neighbours")
    rerank.add_argument("--rerank-lambda", type=float, default=0.3, help="weight of the original distance")
    return accept_both_spellings(show_defaults(p)).parse_args(argv)
