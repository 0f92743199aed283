"""``tagclip export``: its arguments are read before the exporter (torch) is imported."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from modeling_tagclip.flags import path_flag, positive_int

__all__ = ["add_arguments", "run"]

DESCRIPTION = "ONNX export of the inference graphs, each with a dynamic batch dimension."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``tagclip export onnx --model M --output DIR [--opset N]`` (``onnx M DIR``, positionals, works too)."""
    parser.description = DESCRIPTION
    sub = parser.add_subparsers(dest="format", required=True)
    onnx = sub.add_parser(
        "onnx", help="ONNX graphs with a dynamic batch (needs the `export` extra)", description=DESCRIPTION
    )
    path_flag(onnx, "--model", "model_positional", help="saved TAG-CLIP or ViSA folder, or Hub repo id")
    path_flag(onnx, "--output", "output_positional", help="folder for the .onnx files and onnx_export.json")
    onnx.add_argument("--opset", type=positive_int, default=18, metavar="N", help="ONNX opset version")


def run(args: argparse.Namespace) -> int:
    """Export the model; the exit status."""
    from modeling_tagclip.export import export_onnx, quiet_exporter
    from modeling_tagclip.retrieval.loading import load_model

    try:
        with quiet_exporter():
            model, _ = load_model(args.model)
            manifest = export_onnx(model, args.output, opset=args.opset)
    except (ValueError, ImportError) as error:
        print(f"tagclip export: error: {error}", file=sys.stderr)
        return 2
    for name, graph in manifest["graphs"].items():
        print(
            f"wrote {Path(args.output) / name}: {', '.join(graph['inputs'])} -> {', '.join(graph['outputs'])}"
        )
    print(f"wrote {Path(args.output) / 'onnx_export.json'} (the graphs' inputs and outputs)")
    return 0
