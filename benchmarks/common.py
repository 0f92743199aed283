"""Shared helpers of the benchmark scripts: interleaved timing, machine info, peak memory, MAC counts, search.

Run the scripts from the repository root (`python benchmarks/bench_towers.py --quick`); they put the root on
`sys.path` themselves.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from modeling_tagclip.flags import nonnegative_int, positive_int

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# ---------------------------------------------------------------------------------------------------------
# Machine, devices, output
# ---------------------------------------------------------------------------------------------------------


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() as a fallback)."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


# The instruction-set flags that decide CPU kernel speed (the rest of /proc/cpuinfo's list is not recorded).
SPEED_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
)


def cpu_record() -> dict[str, Any]:
    """CPU model, family/model/stepping, the speed-relevant ISA flags, cache size and core count."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "model": cpu_name(),
        "vendor": info.get("vendor_id"),
        "family_model_stepping": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "flags": [flag for flag in SPEED_FLAGS if flag in flags],
        "hypervisor": "hypervisor" in flags,
        "cache": info.get("cache size"),
        "logical_cpus": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def git_commit() -> str | None:
    """The checkout's HEAD commit, with `+dirty` when tracked files differ from it (None outside git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, timeout=30).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "numpy", "faiss", "onnxruntime"):
        try:
            versions[name] = importlib.metadata.version(name if name != "faiss" else "faiss-cpu")
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def run_info() -> dict[str, Any]:
    """Commit, date, load average and the CPU's SIMD flags of this run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return {
        "commit": commit.strip(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "fma", "avx512_bf16", "amx_bf16"}),
    }


def machine_record(device: torch.device | None = None) -> dict[str, Any]:
    """What a results file was measured on and how it was made; every results file embeds it.

    The command line, git commit, UTC date, CPU (model, ISA flags), torch threads, the load average when the
    record is taken, the GPU (or none) and the package versions.
    """
    gpu = None
    if torch.cuda.is_available():
        index = device.index if device is not None and device.type == "cuda" and device.index else 0
        gpu = torch.cuda.get_device_name(index)
    return {
        "command": " ".join(["python", *sys.argv]) if sys.argv and sys.argv[0] else None,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device) if device is not None else None,
        "cpu": cpu_record(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "gpu": gpu,
        "versions": _versions(),
    }


def machine_info(device: torch.device) -> dict[str, Any]:
    """The machine record of `device` (the name the benchmark scripts call)."""
    return machine_record(device)


def pick_device(name: str) -> torch.device:
    """`auto` = CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# Dense (no sparsity) bf16 tensor-core peaks in TFLOPS per GPU, from the vendors' datasheets, keyed on a
# pattern of `torch.cuda.get_device_name` (case-insensitive); the first match wins, so a board variant (PCIe,
# NVL) comes before its family. An H100 or H200 named by neither variant ("NVIDIA H100 80GB HBM3",
# "NVIDIA H200") is the SXM module.
PEAK_BF16_TFLOPS = (
    (r"GH200", "GH200 (Grace Hopper)", 989.4),
    (r"H100.*PCIe", "H100 PCIe", 756.5),
    (r"H100.*NVL", "H100 NVL", 835.5),
    (r"H100", "H100 SXM", 989.4),
    (r"H800.*PCIe", "H800 PCIe", 756.5),
    (r"H800", "H800 SXM", 989.4),
    (r"H200.*NVL", "H200 NVL", 835.5),
    (r"H200", "H200 SXM", 989.4),
    (r"A100", "A100", 312.0),
    (r"L40S", "L40S", 362.1),
    (r"4090", "RTX 4090", 165.2),
)


def gpu_peak(name: str) -> tuple[str, float] | None:
    """(model, dense bf16 TFLOPS) of the GPU a device name denotes (`PEAK_BF16_TFLOPS`), else None."""
    return next(
        (
            (model, peak)
            for pattern, model, peak in PEAK_BF16_TFLOPS
            if re.search(pattern, name, re.IGNORECASE)
        ),
        None,
    )


def peak_bf16_tflops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak (for MFU) when its name is in `PEAK_BF16_TFLOPS`, else None."""
    if device.type != "cuda":
        return None
    found = gpu_peak(torch.cuda.get_device_name(device))
    return found[1] if found else None


def autocast_dtype(device: torch.device, name: str) -> torch.dtype | None:
    """Autocast dtype: `auto` = bf16 (fp16 without bf16 support) on GPU, none (fp32) on CPU."""
    if name == "fp32" or (name == "auto" and device.type != "cuda"):
        return None
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def benchmark_parser(
    description: str, quick_help: str, sizes: Collection[str] = ()
) -> argparse.ArgumentParser:
    """A parser showing the script's docstring, with `--quick` and, given `sizes`, `--size` (None = default)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    if sizes:
        parser.add_argument(
            "--size", choices=sorted(sizes), default=None, help="default base (tiny with --quick)"
        )
    return parser


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The options the benchmark scripts share: --warmup, --device, --dtype, --clock, --threads, --output."""
    parser.add_argument("--warmup", type=nonnegative_int, default=1)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu = process CPU time (use with --threads 1 on a shared CPU machine)",
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--output", type=Path, default=None)
    add_allow_dirty(parser)


def add_allow_dirty(parser: argparse.ArgumentParser) -> None:
    """`--allow-dirty`: publish a results file measured on a tree with uncommitted changes (marked in the figure)."""
    parser.add_argument(
        "--allow-dirty",
        action=_AllowDirty,
        nargs=0,
        default=False,
        help="write into benchmarks/results/ although the checkout has uncommitted changes (the figure says so)",
    )


class _AllowDirty(argparse.Action):
    """`--allow-dirty` sets TAGCLIP_BENCH_ALLOW_DIRTY for `check_publishable`, wherever the script writes."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        os.environ[ALLOW_DIRTY] = "1"
        setattr(namespace, self.dest, True)


def resolve_args(
    args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any], output: str
) -> argparse.Namespace:
    """Fill the options left at None with their `--quick` or full default, `--output` with
    `RESULTS_DIR / output.format(**vars(args))`, and apply `--threads` to torch."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.output is None:
        args.output = RESULTS_DIR / output.format(**vars(args))
    check_publishable(args.output)  # before the measurement, not after it
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


ALLOW_DIRTY = "TAGCLIP_BENCH_ALLOW_DIRTY"  # set to 1 (or pass --allow-dirty) to publish from a changed tree


def published(path: str | Path) -> bool:
    """Whether `path` is a published results file (under `benchmarks/results/`)."""
    return Path(os.path.realpath(path)).parent == RESULTS_DIR.resolve()


def check_publishable(path: str | Path, commit: str | None = None) -> None:
    """Refuse (SystemExit, one line) to publish a measurement of a tree with uncommitted changes: a published
    figure names the commit it measured. `--allow-dirty` (or TAGCLIP_BENCH_ALLOW_DIRTY=1) publishes it anyway,
    and the rendered figure then says so."""
    commit = git_commit() if commit is None else commit
    if published(path) and (commit or "").endswith("+dirty") and os.environ.get(ALLOW_DIRTY) != "1":
        raise SystemExit(
            f"refusing to write {path}: the checkout has uncommitted changes, so the figure could not name the "
            "code it measured; commit first, write elsewhere with --output, or pass --allow-dirty"
        )


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write `payload` as indented JSON, atomically (creating the folder), with the machine record under
    `machine` (a record the payload already has is kept, the fields it lacks are added). A published results
    file must come from a committed tree (`check_publishable`)."""
    from modeling_tagclip.atomic_io import write_json as atomic_write_json

    path = Path(path)
    if os.path.realpath(path) == os.devnull:  # a caller discarding the file (gpu_report without --raw-dir)
        return path
    payload = {**payload, "machine": {**machine_record(), **payload.get("machine", {})}}
    check_publishable(path, payload["machine"].get("commit"))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, payload, indent=2, allow_nan=True)
    return path


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print `rows` as a fixed-width text table of `columns`."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    table = [list(columns)] + [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)))


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_call(fn: Callable[[], Any], device: torch.device, clock: str = "wall") -> float:
    """Seconds of one call, synchronised: `wall` clock, or `cpu` = CPU time of this process (all threads).

    With one torch thread, `cpu` time is the compute actually spent, unaffected by other processes taking
    turns on the cores (a shared machine); it is not meaningful for GPU work.
    """
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    fn()
    synchronize(device)
    return now() - start


def time_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int, device: torch.device, clock: str = "wall"
) -> dict[str, list[float]]:
    """Seconds per call of each function, measured in interleaved rounds (order rotated each round).

    Interleaving makes load drift on a shared machine hit every candidate alike; compare with medians or
    with per-round ratios (`paired_ratios`).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_call(fns[name], device, clock))
    return times


def paired_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Per-round time ratios of two interleaved series."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---------------------------------------------------------------------------------------------------------
# Peak memory (CPU: resident set size of this process; GPU: the CUDA caching allocator)
# ---------------------------------------------------------------------------------------------------------


def rss_mib() -> float:
    """Current resident set size of this process, MiB (Linux /proc; else the peak)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


def peak_rss_mib() -> float:
    """Peak resident set size, MiB: VmHWM (resettable) where /proc has it, else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Reset the peak RSS to the current RSS (Linux `clear_refs` 5); False where not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_mib(fn: Callable[[], Any], device: torch.device) -> tuple[float, str]:
    """Extra peak memory of one call over the memory held before it, MiB, and how it was measured.

    Run it in a fresh process per configuration on CPU: the RSS high-water mark only grows unless reset.
    """
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20, "cuda.max_memory_allocated"
    before = rss_mib()
    method = "VmHWM after clear_refs reset" if reset_peak_rss() else "ru_maxrss delta (no reset)"
    if not method.startswith("VmHWM"):
        before = peak_rss_mib()
    fn()
    return max(0.0, peak_rss_mib() - before), method


# ---------------------------------------------------------------------------------------------------------
# MAC counts (multiply-accumulates of the linear layers a forward actually executes)
# ---------------------------------------------------------------------------------------------------------


def patch_embed_macs(num_patches: int, channels: int, patch: int, hidden: int) -> int:
    """The patch-embedding convolution = one linear layer per patch."""
    return num_patches * channels * patch * patch * hidden


def attention_linear_macs(tokens: int, hidden: int) -> int:
    """q, k, v and out projections."""
    return 4 * tokens * hidden * hidden


def attention_matmul_macs(batch: int, tokens: int, hidden: int) -> int:
    """QK^T and attention x V (not linear layers; reported separately)."""
    return 2 * batch * tokens * tokens * hidden


def mlp_macs(tokens: int, hidden: int, intermediate: int) -> int:
    """fc1 + fc2 of one MLP (or one expert) over `tokens` tokens."""
    return 2 * tokens * hidden * intermediate


def vision_tower_macs(
    config: Any,
    batch: int,
    executed_experts: Sequence[int] | None = None,
    view_token: bool | None = None,
) -> dict[str, int]:
    """Linear-layer MACs of a ViT tower forward (TAG-CLIP or CLIP config of the same fields).

    `executed_experts[j]`: (token, expert) pairs the j-th MoE block ran (sum of its expert mask); MoE blocks
    also pay the feature router on every token and, for HR-MoE, the image router on the view token. The view
    token adds one token per image up to the last MoE block (the last block without MoE). Returns `linear`
    (patch embedding + all linear layers) and `attention_matmul` (QK^T and AV, for reference).
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    grid = getattr(config, "grid_size", None) or (config.image_size // config.patch_size,) * 2
    patches = grid[0] * grid[1]
    block_type = getattr(config, "block_type", "vit")
    moe_layers = sorted(config.moe_layers) if block_type != "vit" else []
    has_view = getattr(config, "use_view_token", False) if view_token is None else view_token
    exit_index = (moe_layers[-1] if moe_layers else config.num_hidden_layers - 1) if has_view else -1
    if moe_layers and (executed_experts is None or len(executed_experts) != len(moe_layers)):
        raise ValueError(f"need executed_experts for each of the {len(moe_layers)} MoE blocks")
    linear = batch * patch_embed_macs(patches, config.num_channels, config.patch_size, hidden)
    matmul = 0
    for index in range(config.num_hidden_layers):
        per_image = patches + 1 + (1 if index <= exit_index else 0)
        tokens = batch * per_image
        linear += attention_linear_macs(tokens, hidden)
        matmul += attention_matmul_macs(batch, per_image, hidden)
        if index in moe_layers:
            pairs = int(executed_experts[moe_layers.index(index)])
            linear += mlp_macs(pairs, hidden, inter) + tokens * hidden * config.num_experts
            linear += batch * hidden * 2 if block_type == "hrmoe" else 0
        else:
            linear += mlp_macs(tokens, hidden, inter)
    return {"linear": linear, "attention_matmul": matmul}


def visa_macs(config: Any, batch: int) -> dict[str, int]:
    """MACs of a `ViSAModel` forward (a `ViSAConfig`), with the keys of `vision_tower_macs`.

    `linear`: `visa_complexity`'s Linear/Conv count (patch conv, trunk, per branch the router and the top-k
    prompt experts each image runs, the fusion block) plus the DLFM GCN weight on every query, which the paper's
    accounting leaves out. `attention_matmul`: QK^T and AV of the trunk, the experts and the fusion block. The
    DLFM cosine graphs (< 0.1% at the paper's config) are not counted.
    """
    from modeling_tagclip.models.visa.complexity_visa import visa_complexity

    dim, branches, queries = config.hidden_size, 2 if config.has_view_branch else 1, config.queries_per_branch
    linear = visa_complexity(config)["macs"] + (branches * queries * dim * dim if config.use_dlfm else 0)
    tokens = config.num_prefix_tokens + config.num_patches
    matmul = config.num_hidden_layers * attention_matmul_macs(1, tokens, dim)
    if config.use_etgm:  # self-attention over M prompt tokens, cross-attention of M tokens to 1
        prompts = config.num_prompt_tokens
        expert = attention_matmul_macs(1, prompts, dim) + 2 * prompts * dim
        matmul += branches * config.expert_top_k * expert
    if config.has_local_branch:
        matmul += attention_matmul_macs(1, 1 + branches * queries, dim)
    return {"linear": batch * linear, "attention_matmul": batch * matmul}


# ---------------------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------------------


def chunked_topk(
    queries: torch.Tensor, gallery: torch.Tensor, k: int, chunk_size: int = 65536
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-`k` inner-product search without a queries x gallery matrix: (scores, indices), [Q, k].

    Scores `chunk_size` gallery rows at a time and merges each chunk's top-k into the running top-k, so
    memory is O(Q x (chunk_size + k)). Ties keep the lower gallery index first only within a chunk.
    """
    if queries.ndim != 2 or gallery.ndim != 2 or queries.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"need [Q, D] queries and [N, D] gallery, got {tuple(queries.shape)}, {tuple(gallery.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    k = min(k, gallery.shape[0])
    best_scores = queries.new_full((queries.shape[0], 0), float("-inf"))
    best_index = torch.zeros(queries.shape[0], 0, dtype=torch.long, device=queries.device)
    for start in range(0, gallery.shape[0], chunk_size):
        scores = queries @ gallery[start : start + chunk_size].T
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        merged = torch.cat([best_scores, top.values], dim=1)
        merged_index = torch.cat([best_index, top.indices + start], dim=1)
        keep = merged.topk(min(k, merged.shape[1]), dim=1).indices
        best_scores, best_index = merged.gather(1, keep), merged_index.gather(1, keep)
    return best_scores, best_index
