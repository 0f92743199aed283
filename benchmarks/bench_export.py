"""onnxruntime vs PyTorch on the exported TAG-CLIP image graph (`modeling_tagclip.export`), timed in the same run.

Both run the same graph on CPU (fp32, the configured thread count): PyTorch `get_image_features` in
inference mode (eager, sparse HR-MoE dispatch) and the onnxruntime session of `image.onnx` (dense dispatch,
the only form ONNX has). Timed interleaved; `ratio` = onnxruntime time / PyTorch time, the median of
per-round ratios. Each row also checks parity (max |diff| of the global and TSE embeddings, TSE indices equal).

    python benchmarks/bench_export.py --threads 1 --clock cpu      # ViT-B/16 at 224, batches 1 8
    python benchmarks/bench_export.py --quick                      # tiny model, seconds (plus the export)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_towers import SIZES  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_run_args,
    benchmark_parser,
    machine_info,
    median,
    paired_ratios,
    print_table,
    resolve_args,
    time_interleaved,
    write_json,
)
from modeling_tagclip.flags import positive_int  # noqa: E402


def build_model(size: str) -> Any:
    """A TagClipModel whose image tower is the bench_towers preset (HR-MoE, sparse dispatch), random init."""
    from modeling_tagclip import TagClipConfig, TagClipModel

    vision = {**SIZES[size], "block_type": "hrmoe"}
    text = dict(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_hidden_layers=2,
        num_attention_heads=vision["num_attention_heads"],
    )
    torch.manual_seed(0)
    return TagClipModel(TagClipConfig(vision_config=vision, text_config=text)).eval()


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    import onnxruntime as ort

    from modeling_tagclip.export import export_onnx

    model = build_model(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        export_onnx(model, tmp)
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = ort.InferenceSession(
            str(Path(tmp) / "image.onnx"), options, providers=["CPUExecutionProvider"]
        )
    return [bench_batch(model, session, batch, args) for batch in args.batch_sizes]


def bench_batch(model: Any, session: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row: both runtimes timed interleaved at `batch`, with the parity of their outputs."""
    generator = torch.Generator().manual_seed(batch)
    pixels = torch.randn(batch, 3, *model.config.vision_config.image_hw, generator=generator)
    feed = {"pixel_values": pixels.numpy()}

    def run_torch():
        with torch.inference_mode():
            return model.get_image_features(pixels)

    fns = {"pytorch": run_torch, "onnxruntime": lambda: session.run(None, feed)}
    times = time_interleaved(fns, args.repeats, args.warmup, torch.device("cpu"), args.clock)
    ours, theirs = run_torch(), session.run(None, feed)
    return dict(
        batch=batch,
        pytorch_s=median(times["pytorch"]),
        onnxruntime_s=median(times["onnxruntime"]),
        ratio=median(paired_ratios(times["onnxruntime"], times["pytorch"])),
        max_diff_global=float(np.abs(theirs[0] - ours.pooler_output.numpy()).max()),
        max_diff_tse=float(np.abs(theirs[1] - ours.local_embeds.numpy()).max()),
        tse_indices_equal=bool((theirs[-1] == ours.tse_indices.numpy()).all()),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, "tiny model, batches 1 2, 3 repeats", SIZES)
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None)
    parser.add_argument("--repeats", type=positive_int, default=None)
    add_run_args(parser)
    args = parser.parse_args(argv)
    quick = dict(size="tiny", batch_sizes=[1, 2], repeats=3)
    full = dict(size="base", batch_sizes=[1, 8], repeats=5)
    return resolve_args(args, quick, full, "export_{size}.json")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rows = bench(args)
    print_table(
        rows,
        [
            "batch",
            "pytorch_s",
            "onnxruntime_s",
            "ratio",
            "max_diff_global",
            "max_diff_tse",
            "tse_indices_equal",
        ],
    )
    payload = dict(
        benchmark="export",
        machine=machine_info(torch.device("cpu")),
        size=args.size,
        clock=args.clock,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        warmup=args.warmup,
        rows=rows,
    )
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
