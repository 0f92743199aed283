"""``tagclip convert``'s argument parsers, importable without torch or transformers (``--help`` and a bad flag
answer before a converter is imported)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from modeling_tagclip.flags import accept_both_spellings, nonnegative_int, positive_int, show_defaults

__all__ = ["convert_parser", "parse_visa_args", "parse_vocab_args"]

CONVERT_DESCRIPTION = (
    "Convert CLIP and official TAG-PR checkpoints into `TagClipModel` (transformers layout, safetensors)."
)
VOCAB_DESCRIPTION = "Convert OpenAI CLIP's ``bpe_simple_vocab_16e6.txt.gz`` into ``vocab.json`` + ``merges.txt`` with TAG-PR's mask."


def convert_parser() -> argparse.ArgumentParser:
    """The parser of ``tagclip convert`` (``hf-clip``, ``tagpr``; ``visa`` and ``vocab`` listed in its help)."""
    parser = argparse.ArgumentParser(prog="tagclip convert", description=CONVERT_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    hf = sub.add_parser("hf-clip", help="transformers CLIPModel folder -> TAG-CLIP")
    hf.add_argument("src_dir", help="transformers CLIPModel folder (save_pretrained)")
    hf.add_argument("out_dir", help="new TAG-CLIP folder")
    hf.add_argument(
        "--block-type", default="hrmoe", choices=("vit", "moe", "hrmoe"), help="vision block type"
    )
    hf.add_argument("--no-view-token", action="store_true", help="no view token (not with hrmoe)")
    hf.add_argument(
        "--moe-layers",
        type=nonnegative_int,
        nargs="+",
        metavar="N",
        help="0-based expert blocks (default: [6, 7, 8] of 12)",
    )
    hf.add_argument("--num-identities", type=nonnegative_int, default=0, metavar="N",
                    help="ID classifier classes (0: none)")  # fmt: skip
    hf.add_argument(
        "--image-size", type=positive_int, nargs=2, metavar=("H", "W"), help="interpolate to H x W"
    )
    tagpr = sub.add_parser("tagpr", help="official TAG-PR / TBPS-CLIP / OpenAI CLIP checkpoint -> TAG-CLIP")
    tagpr.add_argument(
        "checkpoint", help="checkpoint_best.pth or a state_dict file (read without unpickling code)"
    )
    tagpr.add_argument("out_dir", help="new TAG-CLIP folder")
    tagpr.add_argument("--num-identities", type=nonnegative_int, metavar="N",
                       help="classifier classes (default: the checkpoint's)")  # fmt: skip
    tagpr.add_argument(
        "--image-size", type=positive_int, nargs=2, metavar=("H", "W"), help="interpolate to H x W"
    )
    tagpr.add_argument("--vision-heads", type=positive_int, metavar="N", help="default: width // 64")
    tagpr.add_argument("--text-heads", type=positive_int, metavar="N", help="default: width // 64")
    sub.add_parser("visa", help="official ViSA model_best.pth -> ViSA folder (tagclip convert visa --help)",
                   add_help=False)  # fmt: skip
    sub.add_parser("vocab", help="OpenAI CLIP bpe vocabulary -> vocab.json + merges.txt", add_help=False)
    return accept_both_spellings(show_defaults(parser))


def parse_visa_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``tagclip convert visa``."""
    p = argparse.ArgumentParser(
        prog="tagclip convert visa",
        description="Convert an official ViSA checkpoint (model_best.pth) to a HF folder.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="official model_best.pth (read without unpickling code)"
    )
    p.add_argument("--output", required=True, help="new ViSA folder")
    p.add_argument("--config", default=None, help="JSON dict of ViSAConfig overrides (e.g. expert_top_k)")
    return accept_both_spellings(show_defaults(p)).parse_args(argv)


def parse_vocab_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of ``tagclip convert vocab``."""
    parser = argparse.ArgumentParser(prog="tagclip convert vocab", description=VOCAB_DESCRIPTION)
    parser.add_argument("src", help="bpe_simple_vocab_16e6.txt.gz")
    parser.add_argument("out_dir", help="output directory (e.g. modeling_tagclip/clip_vocab)")
    return show_defaults(parser).parse_args(argv)
