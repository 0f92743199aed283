"""Image-tower throughput and peak memory: TAG-CLIP (vit / moe / hrmoe blocks) vs transformers' CLIP tower.

All towers share width, depth and input size and are timed in the same run, interleaved; each row prints the
measured time ratio (ours / CLIP, median of per-round ratios) next to the FLOP-ideal ratio (linear-layer MACs
the routing actually executed, read from the expert masks, over CLIP's). `overhead` = measured / ideal.

    python benchmarks/bench_towers.py                 # ViT-B/16 at 224, batches 1 4 8
    python benchmarks/bench_towers.py --quick         # tiny tower, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    autocast_dtype,
    machine_info,
    median,
    paired_ratios,
    peak_memory_mib,
    pick_device,
    print_table,
    reset_peak_rss,
    time_interleaved,
    vision_tower_macs,
    write_json,
)

SIZES: dict[str, dict[str, Any]] = {
    "base": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=224, patch_size=16, moe_layers=[6, 7, 8],
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        image_size=32, patch_size=8, moe_layers=[1, 2],
    ),
}  # fmt: skip
CANDIDATES = ("vit", "moe", "hrmoe", "hrmoe-dense")


def build_tower(name: str, size: str, attn: str = "sdpa") -> torch.nn.Module:
    """`clip` = transformers' CLIPVisionModel; else a TagClipVisionModel.

    Suffix `-dense`: `moe_dispatch="dense"` (every expert on every token, the reference formula).
    """
    torch.manual_seed(0)
    fields = SIZES[size]
    if name == "clip":
        from transformers import CLIPVisionConfig, CLIPVisionModel

        clip_fields = {k: v for k, v in fields.items() if k != "moe_layers"}
        config = CLIPVisionConfig(hidden_act="quick_gelu", attn_implementation=attn, **clip_fields)
        return CLIPVisionModel(config).eval()
    from modeling_tagclip import TagClipVisionConfig
    from modeling_tagclip.modeling_tagclip import TagClipVisionModel

    block_type, _, dispatch = name.partition("-")
    config = TagClipVisionConfig(
        block_type=block_type, moe_dispatch="dense" if dispatch == "dense" else "sparse",
        attn_implementation=attn,
        **fields,
    )  # fmt: skip
    return TagClipVisionModel(config).eval()


def make_pixels(batch: int, size: str, device: torch.device) -> torch.Tensor:
    side = SIZES[size]["image_size"]
    generator = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 3, side, side, generator=generator).to(device)


def forward_fn(model: torch.nn.Module, pixels: torch.Tensor, amp: torch.dtype | None):
    """A no-argument inference call (inference_mode, autocast when `amp`)."""

    def run():
        autocast = (
            torch.autocast(pixels.device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
        )
        with torch.inference_mode(), autocast:
            return model(pixel_values=pixels)

    return run


def executed_expert_pairs(model: torch.nn.Module, pixels: torch.Tensor) -> list[int]:
    """(token, expert) pairs each MoE block computes: the expert mask's sum (all pairs for dense dispatch)."""
    config = model.config
    if config.block_type == "vit":
        return []
    with torch.inference_mode():
        routing = model(pixel_values=pixels, output_router_logits=True).router_logits
    if config.moe_dispatch == "dense":
        return [int(r.expert_mask.numel()) for r in routing]
    return [int(r.expert_mask.sum()) for r in routing]


def tower_macs(model: torch.nn.Module, pixels: torch.Tensor) -> dict[str, int]:
    if not hasattr(model.config, "block_type"):
        return vision_tower_macs(model.config, pixels.shape[0])
    return vision_tower_macs(model.config, pixels.shape[0], executed_expert_pairs(model, pixels))


def measure_memory(
    name: str,
    batches: list[int],
    size: str,
    device_name: str,
    dtype: str,
    model: torch.nn.Module | None = None,
) -> list[dict]:
    """Peak extra memory of one forward per batch size (after one warm-up forward), in this process."""
    device = pick_device(device_name)
    model = model if model is not None else build_tower(name, size).to(device)
    results = []
    for batch in batches:
        run = forward_fn(model, make_pixels(batch, size, device), autocast_dtype(device, dtype))
        run()
        peak, method = peak_memory_mib(run, device)
        results.append({"peak_mib": round(peak, 1), "method": method})
    return results


def memory_in_subprocess(name: str, batches: list[int], args: argparse.Namespace) -> list[dict]:
    """`measure_memory` in a fresh interpreter (glibc mmap threshold pinned so freed buffers leave the RSS).

    One worker per tower covers all batch sizes when the RSS peak can be reset, else one per configuration.
    """
    if len(batches) > 1 and not reset_peak_rss():
        return [row for batch in batches for row in memory_in_subprocess(name, [batch], args)]
    spec = dict(name=name, batches=batches, size=args.size, device_name=args.device, dtype=args.dtype)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, __file__, "--memory-worker", json.dumps(spec)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        failure = {"peak_mib": None, "method": f"worker failed: {proc.stderr.strip()[-300:]}"}
        return [failure] * len(batches)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_memory(
    rows: list[dict[str, Any]], args: argparse.Namespace, models: dict[str, torch.nn.Module]
) -> None:
    """Fill `memory_peak_mib` / `memory_method` of each row (`--memory` off/inprocess/subprocess)."""
    if args.memory == "off":
        return
    measure = memory_in_subprocess if args.memory == "subprocess" else None
    for name in dict.fromkeys(row["tower"] for row in rows):
        mine = [row for row in rows if row["tower"] == name]
        batches = [row["batch"] for row in mine]
        if measure is not None:
            found = measure(name, batches, args)
        else:
            found = measure_memory(name, batches, args.size, args.device, args.dtype, models[name])
        for row, memory in zip(mine, found, strict=True):
            row.update({f"memory_{k}": v for k, v in memory.items()})


def param_mib(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def bench_batch(
    models: dict[str, torch.nn.Module], batch: int, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """Time all towers interleaved at one batch size; one row per tower."""
    pixels = make_pixels(batch, args.size, device)
    amp = autocast_dtype(device, args.dtype)
    fns = {name: forward_fn(model, pixels, amp) for name, model in models.items()}
    times = time_interleaved(fns, args.repeats, args.warmup, device, args.clock)
    clip_macs = tower_macs(models["clip"], pixels)
    rows = []
    for name, model in models.items():
        macs = tower_macs(model, pixels)
        ratio = median(paired_ratios(times[name], times["clip"]))
        ideal = macs["linear"] / clip_macs["linear"]
        ideal_attn = (macs["linear"] + macs["attention_matmul"]) / (
            clip_macs["linear"] + clip_macs["attention_matmul"]
        )
        row = dict(
            tower=name, batch=batch, median_s=median(times[name]), images_per_s=batch / median(times[name]),
            ratio_vs_clip=ratio, flop_ideal_ratio=ideal, overhead=ratio / ideal,
            flop_ideal_ratio_incl_attn_matmul=ideal_attn, gmacs_linear=macs["linear"] / 1e9,
            gmacs_attention_matmul=macs["attention_matmul"] / 1e9,
            achieved_gmacs_per_s=(macs["linear"] + macs["attention_matmul"]) / 1e9 / median(times[name]),
            times_s=[round(t, 5) for t in times[name]],
        )  # fmt: skip
        rows.append(row)
    return rows


def moe_layer_inputs(size: str, batch: int, device: torch.device) -> tuple[Any, ...]:
    """An HR-MoE block of the preset, input [batch, tokens + view, D], half the images in each group."""
    from modeling_tagclip import TagClipVisionConfig
    from modeling_tagclip.modeling_tagclip import TagClipHRMoE

    torch.manual_seed(0)
    config = TagClipVisionConfig(**SIZES[size])
    moe = TagClipHRMoE(config).eval().to(device)
    hidden = torch.randn(batch, config.num_patches + 2, config.hidden_size, device=device)
    groups = torch.nn.functional.one_hot(torch.arange(batch, device=device) % 2, 2).float()
    with torch.inference_mode():
        weights, selected = moe.routing_weights(moe.fea_router(hidden).float(), groups)
    return moe, hidden, groups, weights, selected


def bench_moe_layer(args: argparse.Namespace, batch: int, device: torch.device) -> list[dict[str, Any]]:
    """One HR-MoE block's dispatch in isolation: sparse (grouped by expert) and dense dispatch vs
    `experts_only` (each expert on its tokens pre-gathered outside the timing = the GEMM floor)."""
    moe, hidden, groups, weights, selected = moe_layer_inputs(args.size, batch, device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    gathered = [flat[selected.reshape(-1, selected.shape[-1])[:, e]] for e in range(len(moe.experts))]
    calls = {
        "experts_only": lambda: [expert(x) for expert, x in zip(moe.experts, gathered, strict=True)],
        "sparse": lambda: moe.dispatch_sparse(hidden, weights, selected),
        "dense": lambda: moe.dispatch_dense(hidden, weights, selected),
        "routing": lambda: moe.routing_weights(
            moe.fea_router(hidden).float(), weights.new_ones(batch, 2) / 2
        ),
    }
    fns = {name: torch.inference_mode()(call) for name, call in calls.items()}
    times = time_interleaved(fns, args.layer_repeats, 1, device, args.clock)
    return [
        dict(dispatch=name, batch=batch, median_s=median(ts), time_vs_experts_only=median(
            paired_ratios(ts, times["experts_only"])), times_s=[round(t, 5) for t in ts])
        for name, ts in times.items()
    ]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny tower, batches 1 2, 3 repeats")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default base (tiny with --quick)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--towers", nargs="+", choices=CANDIDATES, default=["vit", "moe", "hrmoe"])
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="cpu = process CPU time (use with --threads 1 on a shared CPU machine)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--memory", choices=["subprocess", "inprocess", "off"], default=None,
        help="peak-memory measurement (default subprocess; inprocess with --quick)",
    )  # fmt: skip
    parser.add_argument("--layer-batch", type=int, default=None, help="MoE-layer dispatch batch (0 = skip)")
    parser.add_argument("--layer-repeats", type=int, default=None, help="MoE-layer rounds (default 15)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.memory = args.memory or ("inprocess" if args.quick else "subprocess")
    args.size = args.size or ("tiny" if args.quick else "base")
    args.batch_sizes = args.batch_sizes or ([1, 2] if args.quick else [1, 4, 8])
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.layer_batch = 2 if args.quick and args.layer_batch is None else args.layer_batch
    args.layer_batch = 8 if args.layer_batch is None else args.layer_batch
    args.layer_repeats = args.layer_repeats or (3 if args.quick else 15)
    args.output = args.output or RESULTS_DIR / f"towers_{args.size}.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        print(json.dumps(measure_memory(**json.loads(args.memory_worker))))
        return {}
    device = pick_device(args.device)
    models = {name: build_tower(name, args.size).to(device) for name in ["clip", *args.towers]}
    rows = [row for batch in args.batch_sizes for row in bench_batch(models, batch, args, device)]
    add_memory(rows, args, models)
    columns = ["tower", "batch", "images_per_s", "ratio_vs_clip", "flop_ideal_ratio", "overhead",
               "flop_ideal_ratio_incl_attn_matmul", "memory_peak_mib"]  # fmt: skip
    print_table(rows, columns)
    layer_rows = bench_moe_layer(args, args.layer_batch, device) if args.layer_batch else []
    if layer_rows:
        print(f"\nHR-MoE block dispatch alone, batch {args.layer_batch} ({device}, fp32):")
        print_table(layer_rows, ["dispatch", "batch", "median_s", "time_vs_experts_only"])
    amp = autocast_dtype(device, args.dtype)
    payload = dict(
        benchmark="towers", machine=machine_info(device), size=args.size, config=SIZES[args.size],
        dtype=str(amp or "float32"), memory=args.memory, clock=args.clock, repeats=args.repeats,
        warmup=args.warmup,
        param_mib={name: round(param_mib(m), 1) for name, m in models.items()}, rows=rows,
        moe_layer=layer_rows,
    )  # fmt: skip
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
