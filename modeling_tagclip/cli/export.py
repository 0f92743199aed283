"""``tagclip export``: its arguments are read before the exporter (torch) is imported."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from modeling_tagclip.flags import accept_both_spellings, positive_int, show_defaults

__all__ = ["main"]

DESCRIPTION = "ONNX export of the inference graphs, each with a dynamic batch dimension."


def main(argv: Sequence[str] | None = None) -> int:
    """`tagclip export onnx MODEL OUT_DIR [--opset N]`."""
    parser = argparse.ArgumentParser(prog="tagclip export", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="format", required=True)
    onnx = sub.add_parser("onnx", help="ONNX graphs with a dynamic batch (needs the `export` extra)")
    onnx.add_argument("model", help="saved TAG-CLIP or ViSA folder, or Hub repo id")
    onnx.add_argument("out_dir", help="folder for the .onnx files and onnx_export.json")
    onnx.add_argument("--opset", type=positive_int, default=18, metavar="N", help="ONNX opset version")
    args = accept_both_spellings(show_defaults(parser)).parse_args(argv)  # before torch is imported
    from modeling_tagclip.export import export_onnx, quiet_exporter
    from modeling_tagclip.retrieval.loading import load_model

    try:
        with quiet_exporter():
            model, _ = load_model(args.model)
            manifest = export_onnx(model, args.out_dir, opset=args.opset)
    except (ValueError, ImportError) as error:
        print(f"tagclip export: error: {error}", file=sys.stderr)
        return 2
    for name, graph in manifest["graphs"].items():
        print(
            f"wrote {Path(args.out_dir) / name}: {', '.join(graph['inputs'])} -> {', '.join(graph['outputs'])}"
        )
    print(f"wrote {Path(args.out_dir) / 'onnx_export.json'} (the graphs' inputs and outputs)")
    return 0
