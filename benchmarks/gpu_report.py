"""One command for the GPU measurements of the model path (issue #14, item 6); writes a markdown report.

On a CUDA machine (`--device cuda`, the default when one is present) each section runs at full size and names
the script that measured it (the bench scripts are called in-process with the arguments the report prints):
- host syncs per image / text forward, counted here with `torch.cuda.set_sync_debug_mode("warn")` on the real
  eager forward, nothing patched (input checks are device-side asserts), with and without the fp32 re-run of
  near-tied rows (under autocast it reads its list of rows once per batch);
- bf16-autocast vs fp32 parity of the global and TSE embeddings (TSE token sets equal, cosines), computed here
  on the device: with `--data`, on a split's real images and captions (`--checkpoint` required, e.g. the main
  job's `best/`; inputs and token-set comparison from `bench_precision`), else on random pixels;
- image-tower time ratio vs `CLIPVisionModel` in bf16, images/s and MFU at batch 64/256/512, and ViSA
  images/s at 256x128 (`bench_towers`);
- gallery encoding end to end from JPEG files through `build_index` (what `tagclip index` runs: bf16, DataLoader
  workers, batch 256) vs the bare forward at the same batch and dtype, and "1M crops in N minutes" extrapolated
  from the measured end-to-end rate (`bench_index`);
- training samples/s of the full loss on one GPU, bf16 autocast, checkpointing off/on (`bench_train_step`).
Not covered: training under DDP (`bench_train_step` runs one process; the report says so when the machine has
more than one GPU), `torch.compile` variants, and peak memory (`bench_towers --memory`, run separately).

Without CUDA (or with `--quick`) every section runs at small sizes in seconds (tests/e2e/test_gpu_report.py does;
the parity on at most 32 test images), and every section heading says that these are CPU (or smoke-run)
figures, not GPU figures.

    python benchmarks/gpu_report.py --checkpoint outputs/mainjob/seed0/best --data data/synthetic \\
        --out benchmarks/gpu_report.md --raw-dir benchmarks/results/gpu
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_tagclip.atomic_io import atomic_write  # noqa: E402
from modeling_tagclip.flags import finite_float, nonnegative_int, positive_int, torch_device  # noqa: E402

TOWER_BATCHES, VISA_BATCH = ("64", "256", "512"), "64"
INDEX_IMAGES, INDEX_BATCH, TRAIN_BATCH = 4096, 256, 64
PARITY_BATCH, QUICK_PARITY_LIMIT = 64, 32


def count_host_syncs(fn) -> int | None:
    """Device-to-host syncs of one call (CUDA only: `set_sync_debug_mode("warn")` warns once per sync)."""
    if not torch.cuda.is_available():
        return None
    fn()  # warm-up (lazy init may sync)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


@torch.inference_mode()
def encode(model: Any, inputs: dict, amp: torch.dtype | None) -> dict[str, dict[str, torch.Tensor]]:
    """TSE token indices, global and TSE embeddings of every image (and caption, when `inputs` has
    `input_ids`) on the model's device under `amp` autocast (None: fp32); results on the CPU."""
    device = next(model.parameters()).device
    pixels, labels, ids = inputs["pixel_values"], inputs.get("view_labels"), inputs.get("input_ids")
    step = PARITY_BATCH
    parts: dict[str, list] = {"image": []}
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        for s in range(0, len(pixels), step):
            views = None if labels is None else labels[s : s + step].to(device)
            parts["image"].append(model.get_image_features(pixels[s : s + step].to(device), views))
        if ids is not None:
            chunks = range(0, len(ids), 4 * step)
            parts["text"] = [model.get_text_features(ids[s : s + 4 * step].to(device)) for s in chunks]
    names = (("indices", "tse_indices"), ("global", "pooler_output"), ("local", "local_embeds"))
    return {
        side: {key: torch.cat([getattr(p, name).cpu() for p in out]) for key, name in names}
        for side, out in parts.items()
    }


def parity(model: Any, inputs: dict) -> dict[str, float]:
    """bf16 autocast (the model's default fp32 re-run of near-tie rows on) vs fp32: per side, the share of TSE
    token sets equal (captions: the tokens TSE pools, `bench_precision.sets_equal`) and the minimum cosines."""
    from benchmarks.bench_precision import sets_equal, word_counts

    full, low = encode(model, inputs, None), encode(model, inputs, torch.bfloat16)
    row: dict[str, float] = {}
    for side in full:
        counts = word_counts(model, inputs) if side == "text" else None
        row["images" if side == "image" else "captions"] = len(full[side]["indices"])
        row[f"{side}_tse_sets_equal"] = float(
            sets_equal(low[side]["indices"], full[side]["indices"], counts).float().mean()
        )
        for key in ("local", "global"):
            cos = F.cosine_similarity(low[side][key].float(), full[side][key].float(), dim=-1)
            row[f"{side}_{'tse' if key == 'local' else key}_cos_min"] = float(cos.min())
    return row


def load_or_build(checkpoint: str | None, device: torch.device) -> tuple[Any, Any]:
    """(model, processor) of a checkpoint, or a tiny random model (seed 0) and None."""
    from modeling_tagclip import TagClipConfig, TagClipModel
    from modeling_tagclip.evaluation.text_retrieval import load_model

    if checkpoint:
        return load_model(checkpoint, device)
    vision = dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=[64, 32],
        patch_size=8,
        moe_layers=[1, 2],
    )
    text = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    return TagClipModel(TagClipConfig(vision_config=vision, text_config=text)).to(device).eval(), None


def parity_inputs(model: Any, processor: Any, data: str | None, limit: int | None, quick: bool) -> dict:
    """A split's images (with view labels) and captions via `bench_precision.load_inputs`, or random pixels."""
    if data is None:
        generator = torch.Generator().manual_seed(0)
        return {
            "pixel_values": torch.randn(
                64 if quick else 512, 3, *model.config.vision_config.image_hw, generator=generator
            )
        }
    from benchmarks.bench_precision import load_inputs
    from modeling_tagclip.evaluation.text_retrieval import load_eval_dataset

    dataset = load_eval_dataset(data, split="test")
    limit = limit or (QUICK_PARITY_LIMIT if quick else None)
    return load_inputs(processor, dataset.select(range(min(limit, len(dataset)))) if limit else dataset)


def sync_rows(model: Any, device: torch.device) -> dict[str, int | None]:
    vision, text = model.config.vision_config, model.config.text_config
    pixels = torch.randn(8, 3, *vision.image_hw, device=device)
    ids = torch.zeros(8, text.max_position_embeddings, dtype=torch.long, device=device)
    ids[:, 0], ids[:, 1], ids[:, 2] = text.bos_token_id, 1, text.eos_token_id

    def forward(features, inputs):
        def run():
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                features(inputs)

        return count_host_syncs(run)

    rows = {
        "image forward": forward(model.get_image_features, pixels),
        "text forward": forward(model.get_text_features, ids),
    }
    defaults = model.precision_policy.tse_recheck_eps, model.precision_policy.routing_recheck_eps
    model.precision_policy.tse_recheck_eps = model.precision_policy.routing_recheck_eps = (
        0.0  # the forward alone, without the near-tie re-run
    )
    try:
        rows["image forward, no near-tie re-run"] = forward(model.get_image_features, pixels)
        rows["text forward, no near-tie re-run"] = forward(model.get_text_features, ids)
    finally:
        model.precision_policy.tse_recheck_eps, model.precision_policy.routing_recheck_eps = defaults
    return rows


# ---------------------------------------------------------------------------------------------------------
# Sections: each returns its markdown lines
# ---------------------------------------------------------------------------------------------------------


def scope(device: torch.device, quick: bool) -> str:
    """What a section's numbers are: the GPU, a GPU smoke run, or CPU figures (never GPU figures)."""
    if device.type != "cuda":
        return "CPU, smoke-run sizes: NOT GPU figures"
    name = torch.cuda.get_device_name(device)
    return f"{name}, smoke-run sizes: not the report's figures" if quick else name


def command(script: str, args: list[str]) -> str:
    return f"- Measured by `python benchmarks/{script} {shlex.join(args)}` (called in-process)."


def header(device: torch.device, quick: bool, argv: list[str]) -> list[str]:
    from benchmarks.common import machine_info

    info = machine_info(device)
    cuda = (
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        if device.type == "cuda"
        else "no CUDA"
    )
    lines = [
        "# GPU report",
        "",
        f"- Command: `python benchmarks/gpu_report.py {shlex.join(argv)}`",
        f"- Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit {info['commit']}",
        f"- Device: {info['gpu'] or 'cpu'} (CPU: {info['cpu']['model']}, {info['cpu']['logical_cpus']} cores, "
        f"{torch.cuda.device_count() if device.type == 'cuda' else 0} GPU(s))",
        f"- CPU flags: {', '.join(info['cpu']['flags'])}; torch threads {info['torch_threads']}; "
        f"load average {info['load_average']}",
        f"- Versions: torch {torch.__version__}, {cuda}, transformers {info['versions'].get('transformers')}, "
        f"Python {platform.python_version()}",
        "",
    ]
    if device.type != "cuda":
        lines += [
            "**No GPU ran.** Every number below was measured on the CPU at small sizes to check that the "
            "report runs; none of them is a GPU figure.",
            "",
        ]
    elif quick:
        lines += ["**Smoke run (`--quick`)**: small sizes on the GPU; not the report's figures.", ""]
    return lines


def sync_section(model: Any, device: torch.device, label: str) -> list[str]:
    lines = [
        f"## Host syncs per forward, bf16, eager, batch 8 ({label})",
        "",
        "- Measured by this script (`gpu_report.count_host_syncs`, `torch.cuda.set_sync_debug_mode`).",
        "",
    ]
    return lines + [
        f"- {name}: {'n/a (no CUDA)' if n is None else n}" for name, n in sync_rows(model, device).items()
    ]


def parity_section(row: dict[str, float], source: str, label: str) -> list[str]:
    lines = [
        f"## bf16 autocast vs fp32 embeddings ({label})",
        "",
        f"- Inputs: {source}.",
        "- Measured by this script (`gpu_report.parity`; inputs and `sets_equal` from `bench_precision`).",
        "- Targets: TSE cosine >= 0.999, TSE token sets equal for >= 99% of images.",
        "",
    ]
    return lines + [f"- {key}: {value:.6g}" for key, value in row.items()]


def tower_section(
    device: torch.device, quick: bool, peak: float | None, raw: Path | None, label: str
) -> list[str]:
    from benchmarks import bench_towers

    common = ["--device", str(device), "--dtype", "bf16", "--memory", "off", "--layer-batch", "0"]
    common += ["--peak-tflops", str(peak)] if peak else []
    sizes = ["--quick", "--repeats", "1"] if quick else []
    runs = [("hrmoe", ["2"] if quick else list(TOWER_BATCHES)), ("visa", ["2"] if quick else [VISA_BATCH])]
    lines = [
        f"## Image towers, bf16 autocast ({label})",
        "",
        "The HR-MoE tower vs `CLIPVisionModel` of its shape (full size: ViT-B/16 at 224, FLOP-ideal 1.669); "
        "ViSA vs `ViTModel` with its trunk (full size: the paper's model at 256x128; paper: 429 FPS on an "
        "RTX 4090). MFU = 2 x executed MACs/s / the GPU's dense bf16 peak. Targets: overhead <= 1.05, "
        "MFU >= 40% at batch 256.",
        "",
    ]
    table = [
        "| tower | batch | images/s | ratio vs baseline | FLOP-ideal | overhead | MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [peak_line(device, peak), ""]
    for tower, batches in runs:
        out = raw_path(raw, f"towers_{tower}.json")
        args = [*sizes, "--towers", tower, "--batch-sizes", *batches, *common, "--output", out]
        lines.append(command("bench_towers.py", args))
        for row in bench_towers.main(args)["rows"]:
            mfu = "n/a (no known peak)" if row["mfu"] is None else f"{row['mfu']:.1%}"
            table.append(
                f"| {row['tower']} | {row['batch']} | {row['images_per_s']:.1f} | {row['ratio_vs_baseline']:.3f} "
                f"| {row['flop_ideal_ratio']:.3f} | {row['overhead']:.3f} | {mfu} |"
            )
    return [*lines, "", *table]


def index_section(device: torch.device, quick: bool, workers: int, raw: Path | None, label: str) -> list[str]:
    from benchmarks import bench_index

    sizes = (
        ["--tiny", "--images", "8", "--batch-size", "4", "--repeats", "1"]
        if quick
        else ["--images", str(INDEX_IMAGES), "--batch-size", str(INDEX_BATCH), "--repeats", "3"]
    )
    args = [
        *sizes,
        "--device",
        str(device),
        "--dtype",
        "bf16",
        "--workers",
        str(workers),
        "--clock",
        "wall",
        "--threads",
        str(torch.get_num_threads()),
        "--output",
        raw_path(raw, "index.json"),
    ]
    payload = bench_index.main(args)
    row = payload["rows"][0]
    minutes = 1e6 / row["index_img_s"] / 60
    return [
        f"## Gallery encoding from JPEG files, bf16 ({label})",
        "",
        command("bench_index.py", args),
        f"- Model: {payload['model']}; {row['images']} random-noise 256x128 JPEGs, batch {row['batch']}, "
        f"DataLoader workers: {row['workers']}, {payload['clock']} clock.",
        "",
        "| bare forward images/s | `build_index` end to end images/s | ratio (target >= 0.85) |",
        "|---|---|---|",
        f"| {row['forward_img_s']:.1f} | {row['index_img_s']:.1f} | {row['ratio']:.3f} |",
        "",
        f"Extrapolation (not measured at 1M): 1M crops in {minutes:.1f} min at the measured end-to-end rate "
        f"of {row['images']} images ({label}; target <= 10 min on one H100).",
    ]


def train_section(device: torch.device, quick: bool, raw: Path | None, label: str) -> list[str]:
    from benchmarks import bench_train_step

    sizes = ["--quick", "--repeats", "1"] if quick else ["--size", "base", "--batch-size", str(TRAIN_BATCH)]
    args = [*sizes, "--device", str(device), "--dtype", "bf16", "--output", raw_path(raw, "train_step.json")]
    payload = bench_train_step.main(args)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    ddp = (
        f"not measured: this machine has {gpus} GPUs, but `bench_train_step.py` runs one process (no DDP mode)"
        if gpus > 1
        else "not applicable (fewer than 2 GPUs); `bench_train_step.py` has no DDP mode"
    )
    lines = [
        f"## Training step, full loss, {payload['dtype'].removeprefix('torch.')} autocast, 1 device ({label})",
        "",
        command("bench_train_step.py", args),
        f"- Model size `{payload['size']}`.",
        "",
        "| variant | batch | samples/s | time vs eager (same run) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['variant']} | {r['batch']} | {r['samples_per_s']:.2f} | {r['time_vs_first']:.3f} |"
        for r in payload["rows"]
    ]
    return [*lines, "", f"DDP: {ddp}."]


def peak_line(device: torch.device, given: float | None) -> str:
    """Which dense bf16 peak the MFU column divides by: `--peak-tflops`, else the exact GPU model's
    (`common.gpu_peak` on the device name: PCIe, NVL and SXM boards differ), else none."""
    if given:
        return f"- MFU peak: {given:g} TFLOPS dense bf16 (`--peak-tflops`)."
    if device.type != "cuda":
        return "- MFU peak: none (no GPU)."
    from benchmarks.common import gpu_peak

    name = torch.cuda.get_device_name(device)
    found = gpu_peak(name)
    if found is None:
        return f"- MFU peak: none known for `{name}` (give `--peak-tflops`)."
    return f"- MFU peak: {found[1]:g} TFLOPS dense bf16, the {found[0]}'s datasheet figure (device `{name}`)."


def raw_path(raw: Path, name: str) -> str:
    """Where a bench script writes its JSON (`--raw-dir`, or a scratch folder deleted after the report)."""
    return str(raw / name)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder (no half-written report)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checkpoint", default=None, help="TAG-CLIP folder (default: a tiny random model)")
    parser.add_argument(
        "--data", default=None, help="dataset folder: parity on its test split (needs --checkpoint)"
    )
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help=f"parity on the first N test images (default: all; {QUICK_PARITY_LIMIT} at tiny sizes)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes on any device (always without CUDA)")
    parser.add_argument(
        "--workers",
        type=nonnegative_int,
        default=min(8, max(0, (os.cpu_count() or 1) - 1)),
        help="DataLoader workers of the indexing run (1 at tiny sizes)",
    )
    parser.add_argument(
        "--peak-tflops", type=finite_float, default=None, help="MFU peak (default: known GPUs' bf16 peak)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "gpu_report.md")
    parser.add_argument("--raw-dir", type=Path, default=None, help="keep each bench script's JSON here")
    args = parser.parse_args(argv)
    if args.data is not None and args.checkpoint is None:
        parser.error("--data needs --checkpoint (the model whose bf16 parity is measured)")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be a positive integer, got {args.limit}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    return args


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    quick = args.quick or device.type != "cuda"
    label = scope(device, quick)
    model, processor = load_or_build(args.checkpoint, device)
    inputs = parity_inputs(model, processor, args.data, args.limit, quick)
    images = (
        f"test split of `{args.data}` (images with their view labels, captions)"
        if args.data
        else "random pixels"
    )
    source = f"{images}, model `{args.checkpoint or 'tiny random TAG-CLIP'}`"
    lines = header(device, quick, argv) + parity_section(parity(model, inputs), source, label) + [""]
    lines += sync_section(model, device, label) + [""]
    with tempfile.TemporaryDirectory() as scratch:  # the bench scripts' JSON, unless --raw-dir keeps it
        raw = args.raw_dir if args.raw_dir is not None else Path(scratch)
        lines += tower_section(device, quick, args.peak_tflops, raw, label) + [""]
        lines += index_section(device, quick, 1 if quick else args.workers, raw, label) + [""]
        lines += train_section(device, quick, raw, label)
    report = "\n".join(lines) + "\n"
    write_atomic(args.out, report)
    print(report)
    return report


if __name__ == "__main__":
    main()
