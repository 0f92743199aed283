"""``tagclip convert``'s flags, importable without torch or transformers (``--help`` and a bad flag answer before a
converter is imported). Every kind takes the same form: ``tagclip convert KIND --checkpoint SRC --output DST``
(``tagclip convert KIND SRC DST``, positionals, works too)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from modeling_tagclip.flags import nonnegative_int, path_flag, positive_int

__all__ = ["add_arguments", "parse_visa_args", "parse_vocab_args"]

DESCRIPTION = (
    "Convert a checkpoint of another codebase into a model folder of this package (transformers layout, "
    "safetensors): a transformers CLIPModel or an official TAG-PR checkpoint into TAG-CLIP, an official ViSA "
    "checkpoint into ViSA; or OpenAI CLIP's BPE vocabulary into vocab.json + merges.txt."
)
VOCAB_DESCRIPTION = "Convert OpenAI CLIP's ``bpe_simple_vocab_16e6.txt.gz`` into ``vocab.json`` + ``merges.txt`` with TAG-PR's mask."


def _source_and_output(parser: argparse.ArgumentParser, source: str, output: str) -> None:
    """``--checkpoint SRC --output DST``, also accepted as the positionals ``SRC DST``."""
    path_flag(parser, "--checkpoint", "checkpoint_positional", help=source, metavar="SRC")
    path_flag(parser, "--output", "output_positional", help=output, metavar="DST")


def _image_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--image-size", type=positive_int, nargs=2, metavar=("H", "W"), help="interpolate to H x W"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip convert hf-clip|tagpr|visa|vocab``."""
    parser.description = DESCRIPTION
    sub = parser.add_subparsers(dest="command", required=True)
    hf = sub.add_parser(
        "hf-clip",
        help="transformers CLIPModel folder -> TAG-CLIP",
        description="Convert a transformers CLIPModel folder into a TAG-CLIP folder.",
    )
    _source_and_output(hf, "transformers CLIPModel folder (save_pretrained)", "new TAG-CLIP folder")
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
    hf.add_argument(
        "--num-identities",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="ID classifier classes (0: none)",
    )
    _image_size(hf)
    tagpr = sub.add_parser(
        "tagpr",
        help="official TAG-PR / TBPS-CLIP / OpenAI CLIP checkpoint -> TAG-CLIP",
        description="Convert an official TAG-PR / TBPS-CLIP / OpenAI CLIP checkpoint into a TAG-CLIP folder.",
    )
    _source_and_output(
        tagpr,
        "checkpoint_best.pth or a state_dict file (read without unpickling code)",
        "new TAG-CLIP folder",
    )
    tagpr.add_argument(
        "--num-identities",
        type=nonnegative_int,
        metavar="N",
        help="classifier classes (default: the checkpoint's)",
    )
    _image_size(tagpr)
    tagpr.add_argument("--vision-heads", type=positive_int, metavar="N", help="default: width // 64")
    tagpr.add_argument("--text-heads", type=positive_int, metavar="N", help="default: width // 64")
    visa = sub.add_parser(
        "visa",
        help="official ViSA model_best.pth -> ViSA folder",
        description="Convert an official ViSA checkpoint (model_best.pth) to a ViSA folder.",
    )
    _source_and_output(visa, "official model_best.pth (read without unpickling code)", "new ViSA folder")
    visa.add_argument("--config", default=None, help="JSON dict of ViSAConfig overrides (e.g. expert_top_k)")
    vocab = sub.add_parser(
        "vocab", help="OpenAI CLIP bpe vocabulary -> vocab.json + merges.txt", description=VOCAB_DESCRIPTION
    )
    path_flag(vocab, "--vocab", "vocab_positional", help="bpe_simple_vocab_16e6.txt.gz", metavar="SRC")
    path_flag(
        vocab,
        "--output",
        "output_positional",
        metavar="DST",
        help="output directory (e.g. modeling_tagclip/clip_vocab)",
    )


def parse_convert_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """``tagclip convert ARGV`` (``ARGV`` starts with the kind) as ``run`` receives it."""
    from modeling_tagclip.cli import parse

    return parse("convert", list(argv or []))


def parse_visa_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags of ``tagclip convert visa``."""
    return parse_convert_args(["visa", *(argv or [])])


def parse_vocab_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments of ``tagclip convert vocab``."""
    return parse_convert_args(["vocab", *(argv or [])])
