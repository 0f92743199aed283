"""Gallery indexing end to end (`index_build.build_index` from JPEG files) vs the bare image-tower forward.

Both run the same model (random init, default ViT-B/16 TAG-CLIP config unless --tiny) on the same images
at the same batch size, in interleaved rounds after one warm-up of each. `ratio` = the median over rounds of
end-to-end images/s / forward-only images/s (target: >= 0.95 on CPU; the shard writer thread's checks, writes
and hashes count in the CPU time).
With `--workers 0` decoding and resizing run in the timed process, so on CPU with the CPU-time clock the
ratio is a lower bound of what DataLoader workers on spare cores give. `--dtype` is the autocast dtype of both
(as `tagclip index --dtype`); `--device cuda` times with the wall clock (the CPU clock is refused there).

    python benchmarks/bench_index.py --images 32 --batch-size 16 --repeats 5 --threads 1 --clock cpu
    python benchmarks/bench_index.py --device cuda --dtype bf16 --images 4096 --batch-size 256 --workers 8
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    add_allow_dirty,
    machine_info,
    median,
    paired_ratios,
    print_table,
    run_info,
    time_interleaved,
    write_json,
)
from modeling_tagclip import TagClipConfig, TagClipModel, TagClipProcessor  # noqa: E402
from modeling_tagclip.flags import nonnegative_int, positive_int  # noqa: E402
from modeling_tagclip.retrieval.embedded.index_build import build_index  # noqa: E402
from modeling_tagclip.retrieval.encode import autocast, load_rgb  # noqa: E402


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` random 256x128 JPEG person-crop-sized images."""
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    paths = []
    for i in range(count):
        pixels = torch.randint(0, 256, (256, 128, 3), generator=generator, dtype=torch.uint8).numpy()
        paths.append(folder / f"{i:05d}.jpg")
        Image.fromarray(pixels).save(paths[-1], quality=90)
    return paths


def index_row(times: dict[str, list[float]], args: argparse.Namespace) -> dict[str, Any]:
    """Median images/s of each, and the median of the per-round ratios (forward time / index time)."""
    forward_s, index_s = median(times["forward"]), median(times["index"])
    return {
        "images": args.images,
        "batch": args.batch_size,
        "workers": args.workers,
        "repeats": args.repeats,
        "forward_img_s": round(args.images / forward_s, 3),
        "index_img_s": round(args.images / index_s, 3),
        "ratio": round(median(paired_ratios(times["forward"], times["index"])), 3),
        "ratios": [round(r, 3) for r in paired_ratios(times["forward"], times["index"])],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=positive_int, default=48)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--workers", type=nonnegative_int, default=0)
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="interleaved rounds (after one warm-up)"
    )
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--clock", choices=["wall", "cpu"], default=None, help="default cpu (wall on CUDA)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast dtype")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (seconds; for smoke tests)")
    parser.add_argument("--output", default=str(RESULTS_DIR / "index_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    if device.type == "cuda" and args.clock == "cpu":
        parser.error("--clock cpu does not time GPU work: use --clock wall with --device cuda")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = TagClipConfig()
    if args.tiny:
        config.vision_config.update(
            dict(
                hidden_size=64,
                intermediate_size=256,
                num_hidden_layers=4,
                num_attention_heads=4,
                image_size=32,
                patch_size=8,
            )
        )
    model = TagClipModel(config).eval().to(device)
    size = config.vision_config.image_size
    processor = TagClipProcessor.from_defaults(size, size)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_images(Path(tmp) / "images", args.images)
        pixels = processor(images=[load_rgb(p) for p in paths])["pixel_values"].to(device)

        @torch.inference_mode()
        def forward_only() -> None:
            for start in range(0, len(paths), args.batch_size):
                with autocast(device, args.dtype):
                    model.get_image_features(pixel_values=pixels[start : start + args.batch_size])

        def end_to_end(run=[0]) -> None:  # noqa: B006 - a fresh index folder per call
            run[0] += 1
            build_index(
                model,
                processor,
                Path(tmp) / "images",
                Path(tmp) / f"idx{run[0]}",
                batch_size=args.batch_size,
                num_workers=args.workers,
                dtype=args.dtype,
                progress=False,
            )

        times = time_interleaved(
            {"forward": forward_only, "index": end_to_end}, args.repeats, 1, device, args.clock
        )
    rows = [index_row(times, args)]
    print_table(rows, list(rows[0]))
    payload = {
        "command": "python benchmarks/bench_index.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(device),
        **run_info(),
        "threads": args.threads,
        "clock": args.clock,
        "dtype": args.dtype,
        "model": "tiny" if args.tiny else "TagClipConfig() (ViT-B/16, HR-MoE), random init",
        "rows": rows,
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
