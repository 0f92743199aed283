"""Image-tower throughput and peak memory against a dense transformers baseline, timed in the same run.

TAG-CLIP towers (vit / moe / hrmoe blocks) run against transformers' `CLIPVisionModel` (`clip`) of the same
width, depth and input size. ViSA towers (`visa` = `ViSAModel` at `ViSAConfig()`, the paper's model: ViT-B,
256x128, 16x16 patches at stride 12; `visa-vit` = its trunk alone, preset `vit`) run against `hf-vit`:
transformers' `ViTModel` of ViSA's trunk shape with ViSA's overlapping patch convolution swapped in. One run
benchmarks one family. All towers are timed interleaved; each row prints the measured time ratio (tower /
baseline, median of per-round ratios) next to the FLOP-ideal ratio (linear-layer MACs the forward executes:
routed experts read from TAG-CLIP's expert masks, ViSA's top-k experts from `common.visa_macs`, over the
baseline's). `overhead` = measured / ideal.

    python benchmarks/bench_towers.py                 # ViT-B/16 at 224, batches 1 4 8
    python benchmarks/bench_towers.py --towers visa visa-vit --batch-sizes 1 8    # ViSA at 256x128
    python benchmarks/bench_towers.py --quick         # tiny tower, seconds
    python benchmarks/bench_towers.py --compile --towers hrmoe --batch-sizes 8 --threads 1 --clock cpu
                                                      # torch.compile (inductor) of every tower, baseline too

On a GPU, `--device cuda` (the default `auto` picks it) runs the same rows under bf16 autocast.
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
    add_run_args,
    autocast_dtype,
    benchmark_parser,
    machine_info,
    median,
    paired_ratios,
    peak_bf16_tflops,
    peak_memory_mib,
    pick_device,
    print_table,
    reset_peak_rss,
    resolve_args,
    time_interleaved,
    visa_macs,
    vision_tower_macs,
    write_json,
)

SIZES: dict[str, dict[str, Any]] = {
    "base": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=224,
        patch_size=16,
        moe_layers=[6, 7, 8],
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        moe_layers=[1, 2],
    ),
}
VISA_SIZES: dict[str, dict[str, Any]] = {
    "base": {},  # ViSAConfig() defaults = the paper's CARGO model
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=[32, 16],
        patch_size=8,
        patch_stride=[6, 6],
        num_experts=3,
        num_prompt_tokens=2,
        expert_intermediate_size=128,
        graph_top_k=4,
        fusion_intermediate_size=256,
    ),
}
VISA_TOWERS = ("visa", "visa-vit")
CANDIDATES = ("vit", "moe", "hrmoe", "hrmoe-dense", *VISA_TOWERS)


def is_visa(name: str) -> bool:
    """Whether a tower (or the `hf-vit` baseline) belongs to the ViSA family."""
    return name in (*VISA_TOWERS, "hf-vit")


def baseline_of(towers: list[str]) -> str:
    """The dense transformers baseline of a run's towers: `hf-vit` for ViSA, `clip` for TAG-CLIP."""
    return "hf-vit" if is_visa(towers[0]) else "clip"


def visa_config(name: str, size: str, attn: str = "sdpa") -> Any:
    """ViSAConfig of a ViSA tower: preset `cargo` (= defaults) for `visa`, `vit` (trunk only) otherwise."""
    from modeling_tagclip.models.visa.configuration_visa import ViSAConfig

    preset = "cargo" if name == "visa" else "vit"
    return ViSAConfig.from_preset(preset, attn_implementation=attn, **VISA_SIZES[size])


def build_clip(size: str, attn: str) -> torch.nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    clip_fields = {k: v for k, v in SIZES[size].items() if k != "moe_layers"}
    config = CLIPVisionConfig(hidden_act="quick_gelu", attn_implementation=attn, **clip_fields)
    return CLIPVisionModel(config)


def build_hf_vit(size: str, attn: str) -> torch.nn.Module:
    """transformers' ViTModel (no pooler) of ViSA's trunk shape, GELU and LayerNorm eps; its stride-`patch`
    patch convolution is replaced by ViSA's overlapping one and the position table resized to ViSA's grid."""
    from transformers import ViTConfig, ViTModel

    visa = visa_config("visa-vit", size, attn)
    fields = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_channels",
        "image_size",
        "patch_size",
        "hidden_act",
        "layer_norm_eps",
    )
    config = ViTConfig(attn_implementation=attn, **{name: getattr(visa, name) for name in fields})
    model = ViTModel(config, add_pooling_layer=False)
    dim = visa.hidden_size
    model.embeddings.patch_embeddings.projection = torch.nn.Conv2d(
        visa.num_channels, dim, visa.patch_size, stride=tuple(visa.patch_stride)
    )
    model.embeddings.position_embeddings = torch.nn.Parameter(
        0.02 * torch.randn(1, 1 + visa.num_patches, dim)
    )
    return model


def build_tagclip(name: str, size: str, attn: str) -> torch.nn.Module:
    """A TagClipVisionModel; suffix `-dense`: `moe_dispatch="dense"` (every expert on every token)."""
    from modeling_tagclip import TagClipVisionConfig
    from modeling_tagclip.models.tagclip.modeling_tagclip import TagClipVisionModel

    block_type, _, dispatch = name.partition("-")
    config = TagClipVisionConfig(
        block_type=block_type,
        moe_dispatch="dense" if dispatch == "dense" else "sparse",
        attn_implementation=attn,
        **SIZES[size],
    )
    return TagClipVisionModel(config)


def build_tower(name: str, size: str, attn: str = "sdpa") -> torch.nn.Module:
    """A tower by name in eval mode: `clip`, `hf-vit` (baselines), a ViSA tower or a TAG-CLIP tower."""
    torch.manual_seed(0)
    if name == "clip":
        return build_clip(size, attn).eval()
    if name == "hf-vit":
        return build_hf_vit(size, attn).eval()
    if name in VISA_TOWERS:
        from modeling_tagclip.models.visa.modeling_visa import ViSAModel

        return ViSAModel(visa_config(name, size, attn)).eval()
    return build_tagclip(name, size, attn).eval()


def make_inputs(name: str, batch: int, size: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Random pixels of the tower's input size (seeded by batch); ViSA towers also get view labels
    (alternating aerial / ground, so a batch of 8 runs both view branches)."""
    image_size = visa_config("visa", size).image_size if is_visa(name) else [SIZES[size]["image_size"]] * 2
    generator = torch.Generator().manual_seed(batch)
    inputs = {"pixel_values": torch.randn(batch, 3, *image_size, generator=generator).to(device)}
    if name in VISA_TOWERS:
        inputs["view_labels"] = (torch.arange(batch) % 2).to(device)
    return inputs


def forward_fn(model: torch.nn.Module, inputs: dict[str, torch.Tensor], amp: torch.dtype | None):
    """A no-argument inference call (inference_mode, autocast when `amp`)."""
    device_type = inputs["pixel_values"].device.type

    def run():
        autocast = torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()
        with torch.inference_mode(), autocast:
            return model(**inputs)

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


def tower_macs(name: str, model: torch.nn.Module, pixels: torch.Tensor, size: str) -> dict[str, int]:
    """Linear and attention-matmul MACs of one forward; `hf-vit` is counted as ViSA's trunk (preset `vit`)."""
    batch = pixels.shape[0]
    if is_visa(name):
        return visa_macs(model.config if name in VISA_TOWERS else visa_config("visa-vit", size), batch)
    if not hasattr(model.config, "block_type"):
        return vision_tower_macs(model.config, batch)
    return vision_tower_macs(model.config, batch, executed_expert_pairs(model, pixels))


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
        run = forward_fn(model, make_inputs(name, batch, size, device), autocast_dtype(device, dtype))
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
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
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


def add_memory_ratios(rows: list[dict[str, Any]]) -> None:
    """`memory_ratio_vs_baseline`: each row's peak memory over the baseline's at the same batch size."""
    base = {row["batch"]: row.get("memory_peak_mib") for row in rows if row["tower"] == row["baseline"]}
    for row in rows:
        mine, theirs = row.get("memory_peak_mib"), base.get(row["batch"])
        row["memory_ratio_vs_baseline"] = mine / theirs if mine and theirs else None


def param_mib(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def tower_row(
    name: str, batch: int, times: dict[str, list[float]], macs: dict[str, dict[str, int]], baseline: str
) -> dict[str, Any]:
    """One table row: throughput, time ratio vs the baseline (median of per-round ratios), FLOP-ideal ratios."""
    mine, base, seconds = macs[name], macs[baseline], median(times[name])
    ratio = median(paired_ratios(times[name], times[baseline]))
    ideal = mine["linear"] / base["linear"]
    total = mine["linear"] + mine["attention_matmul"]
    return dict(
        tower=name,
        batch=batch,
        baseline=baseline,
        median_s=seconds,
        images_per_s=batch / seconds,
        ratio_vs_baseline=ratio,
        flop_ideal_ratio=ideal,
        overhead=ratio / ideal,
        flop_ideal_ratio_incl_attn_matmul=total / (base["linear"] + base["attention_matmul"]),
        gmacs_linear=mine["linear"] / 1e9,
        gmacs_attention_matmul=mine["attention_matmul"] / 1e9,
        achieved_gmacs_per_s=total / 1e9 / seconds,
        times_s=[round(t, 5) for t in times[name]],
    )


def add_mfu(rows: list[dict[str, Any]], peak_tflops: float | None) -> None:
    """Model FLOPs utilisation of each row: 2 x executed MACs/s (linear + attention matmuls) / the peak."""
    for row in rows:
        row["mfu"] = 2 * row["achieved_gmacs_per_s"] / 1e3 / peak_tflops if peak_tflops else None


def bench_batch(
    models: dict[str, torch.nn.Module],
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    runners: dict[str, torch.nn.Module] | None = None,
) -> list[dict[str, Any]]:
    """Time all towers interleaved at one batch size; one row per tower (the first model is the baseline).
    `runners` (e.g. the compiled towers) are timed in place of `models`, which count the MACs."""
    inputs = {name: make_inputs(name, batch, args.size, device) for name in models}
    amp = autocast_dtype(device, args.dtype)
    runners = runners or models
    fns = {name: forward_fn(runners[name], inputs[name], amp) for name in models}
    times = time_interleaved(fns, args.repeats, args.warmup, device, args.clock)
    macs = {
        name: tower_macs(name, model, inputs[name]["pixel_values"], args.size)
        for name, model in models.items()
    }
    return [tower_row(name, batch, times, macs, next(iter(models))) for name in models]


def moe_layer_inputs(size: str, batch: int, device: torch.device) -> tuple[Any, ...]:
    """An HR-MoE block of the preset, input [batch, tokens + view, D], half the images in each group."""
    from modeling_tagclip import TagClipVisionConfig
    from modeling_tagclip.models.tagclip.modeling_tagclip import TagClipHRMoE

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
        dict(
            dispatch=name,
            batch=batch,
            median_s=median(ts),
            time_vs_experts_only=median(paired_ratios(ts, times["experts_only"])),
            times_s=[round(t, 5) for t in ts],
        )
        for name, ts in times.items()
    ]


def make_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__, "tiny tower, batches 1 2, 3 repeats", SIZES)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument(
        "--towers",
        nargs="+",
        choices=CANDIDATES,
        default=["vit", "moe", "hrmoe"],
        help="TAG-CLIP towers (baseline clip) or ViSA towers (baseline hf-vit), not both",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, quick 3)")
    add_run_args(parser)
    parser.add_argument(
        "--memory",
        choices=["subprocess", "inprocess", "off"],
        default=None,
        help="peak-memory measurement (default subprocess; inprocess with --quick)",
    )
    parser.add_argument(
        "--layer-batch", type=int, default=None, help="MoE-layer dispatch batch (0 = skip; skipped for ViSA)"
    )
    parser.add_argument("--layer-repeats", type=int, default=None, help="MoE-layer rounds (default 15)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak for the mfu column (default: the GPU's dense bf16 peak when known; none on CPU)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="time torch.compile'd towers (inductor; fullgraph for TAG-CLIP / ViSA), the baseline compiled too",
    )
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options with their defaults filled in (`--quick` or full); applies `--threads`."""
    parser = make_parser()
    args = parser.parse_args(argv)
    visa = is_visa(args.towers[0])
    if any(is_visa(name) != visa for name in args.towers):
        parser.error("--towers: benchmark TAG-CLIP and ViSA towers in separate runs (different baselines)")
    quick = dict(
        memory="inprocess", size="tiny", batch_sizes=[1, 2], repeats=3, layer_batch=2, layer_repeats=3
    )
    full = dict(
        memory="subprocess", size="base", batch_sizes=[1, 4, 8], repeats=5, layer_batch=8, layer_repeats=15
    )
    args.suffix = "_compiled" if args.compile else ""
    name = "towers_visa_{size}{suffix}.json" if visa else "towers_{size}{suffix}.json"
    args = resolve_args(args, quick, full, name)
    args.layer_batch = 0 if visa else args.layer_batch
    return args


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The preset's fields for the JSON; for ViSA also its grid and the paper-accounting GFLOPs per image."""
    if not is_visa(args.towers[0]):
        return SIZES[args.size]
    from modeling_tagclip.models.visa.complexity_visa import visa_complexity

    config = visa_config("visa", args.size)
    fields = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "image_size",
        "patch_size",
        "patch_stride",
        "num_experts",
        "num_prompt_tokens",
        "expert_top_k",
        "graph_top_k",
    )
    summary = {name: getattr(config, name) for name in fields}
    return {**summary, "grid_size": list(config.grid_size), "gflops_paper": visa_complexity(config)["gflops"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.memory_worker:
        print(json.dumps(measure_memory(**json.loads(args.memory_worker))))
        return {}
    device = pick_device(args.device)
    names = [baseline_of(args.towers), *args.towers]
    models = {name: build_tower(name, args.size).to(device) for name in names}
    runners = None
    if args.compile:
        runners = {name: torch.compile(m, fullgraph=name != names[0]) for name, m in models.items()}
    rows = [row for batch in args.batch_sizes for row in bench_batch(models, batch, args, device, runners)]
    add_memory(rows, args, models)
    add_memory_ratios(rows)
    peak = args.peak_tflops or peak_bf16_tflops(device)
    add_mfu(rows, peak)
    columns = [
        "tower",
        "batch",
        "images_per_s",
        "ratio_vs_baseline",
        "flop_ideal_ratio",
        "overhead",
        "flop_ideal_ratio_incl_attn_matmul",
        "memory_peak_mib",
        "memory_ratio_vs_baseline",
    ] + (["mfu"] if peak else [])
    print_table(rows, columns)
    layer_rows = bench_moe_layer(args, args.layer_batch, device) if args.layer_batch else []
    if layer_rows:
        print(f"\nHR-MoE block dispatch alone, batch {args.layer_batch} ({device}, fp32):")
        print_table(layer_rows, ["dispatch", "batch", "median_s", "time_vs_experts_only"])
    amp = autocast_dtype(device, args.dtype)
    payload = dict(
        benchmark="towers",
        machine=machine_info(device),
        size=args.size,
        baseline=names[0],
        config=run_config(args),
        dtype=str(amp or "float32"),
        memory=args.memory,
        clock=args.clock,
        repeats=args.repeats,
        warmup=args.warmup,
        peak_tflops=peak,
        compiled=args.compile,
        param_mib={name: round(param_mib(m), 1) for name, m in models.items()},
        rows=rows,
        moe_layer=layer_rows,
    )
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
