"""Gradient caching (`grad_cache_chunks`): time and peak memory of one TAG-CLIP training step (full loss,
backward, AdamW) on one batch computed whole and in k chunks (same loss and gradients: tests/engine/test_grad_cache.py).

Memory: `saved_mib`, the peak of the activations autograd holds for backward (counted through
`saved_tensors_hooks`, any device), and on a GPU `peak_mib`, the step's extra peak in the caching allocator
over what the model and optimizer hold. Timings come from interleaved rounds.

    python benchmarks/bench_grad_cache.py --threads 1 --clock cpu          # small model, batch 64, k = 1 2 4 8
    python benchmarks/bench_grad_cache.py --size base --batch-size 320 --chunks 1 5 --dtype bf16   # a GPU
    python benchmarks/bench_grad_cache.py --quick                          # tiny model, seconds
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_train_step import SIZES, build_model, make_batch  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_run_args,
    autocast_dtype,
    benchmark_parser,
    machine_info,
    median,
    peak_memory_mib,
    pick_device,
    print_table,
    resolve_args,
    time_interleaved,
    write_json,
)
from modeling_tagclip.engine.tasks.tagclip import cached_training_loss  # noqa: E402
from modeling_tagclip.flags import positive_int  # noqa: E402


class SavedActivations:
    """Peak bytes of the tensors autograd holds for backward (``saved_tensors_hooks``): activation memory."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        meter, size = self, tensor.numel() * tensor.element_size()

        class Held:
            def __init__(self):
                self.tensor, meter.live = tensor, meter.live + size
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                meter.live -= size

        return Held()

    @staticmethod
    def unpack(held) -> torch.Tensor:
        return held.tensor


def memory_mib(fn: Callable[[], Any], device: torch.device) -> tuple[float, float | None]:
    """(peak saved activations, GPU allocator peak or None on CPU) of one call, MiB."""
    meter, peak = SavedActivations(), None
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        if device.type == "cuda":
            peak = peak_memory_mib(fn, device)[0]
        else:
            fn()
    return meter.peak / 2**20, peak


def step_fn(model, optimizer, batch: dict, chunks: int, amp: torch.dtype | None) -> Callable[[], float]:
    """One optimisation step: the full batch (k = 1) or gradient caching over ``chunks`` chunks."""
    device_type = batch["pixel_values"].device.type

    def autocast():
        return torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()

    def run() -> float:
        optimizer.zero_grad(set_to_none=True)
        if chunks == 1:
            with autocast():
                loss = model(**batch, return_loss=True).loss
            loss.backward()
        else:
            loss, _ = cached_training_loss(model, batch, None, chunks, torch.Tensor.backward, autocast)
        optimizer.step()
        return float(loss.detach())

    return run


def parse_args(argv: list[str] | None = None):
    parser = benchmark_parser(__doc__, "tiny model, batch 8, k = 1 2 4, 2 repeats", SIZES)
    parser.add_argument("--batch-size", type=positive_int, default=None, help="default 64 (8 with --quick)")
    parser.add_argument(
        "--chunks", type=positive_int, nargs="+", default=None, help="default 1 2 4 8 (quick 1 2 4)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=None, help="timed rounds (default 3, quick 2)"
    )
    parser.add_argument("--num-identities", type=positive_int, default=64)
    add_run_args(parser)
    quick = dict(size="tiny", batch_size=8, chunks=[1, 2, 4], repeats=2)
    full = dict(size="small", batch_size=64, chunks=[1, 2, 4, 8], repeats=3)
    return resolve_args(parser.parse_args(argv), quick, full, "grad_cache_{size}.json")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if 1 not in args.chunks or any(not 1 <= k <= args.batch_size for k in args.chunks):
        raise SystemExit(f"--chunks must include 1 (the baseline) and lie in [1, {args.batch_size}]")
    device = pick_device(args.device)
    amp = autocast_dtype(device, args.dtype)
    model = build_model(args.size, args.num_identities, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = make_batch(model, args.batch_size, device)
    fns = {k: step_fn(model, optimizer, batch, k, amp) for k in sorted(args.chunks)}
    times = time_interleaved(
        fns, args.repeats, args.warmup, device, args.clock
    )  # warm-up: AdamW state exists
    memory = {k: memory_mib(fn, device) for k, fn in fns.items()}
    rows = [
        dict(
            chunks=k,
            batch=args.batch_size,
            median_s=median(ts),
            samples_per_s=args.batch_size / median(ts),
            time_vs_full=median(ts) / median(times[1]),
            saved_mib=round(memory[k][0], 2),
            saved_vs_full=memory[k][0] / memory[1][0],
            peak_mib=memory[k][1],
            times_s=[round(t, 4) for t in ts],
        )
        for k, ts in times.items()
    ]
    columns = ["chunks", "batch", "median_s", "samples_per_s", "time_vs_full", "saved_mib", "saved_vs_full"]
    print_table(rows, columns + ["peak_mib"] * (device.type == "cuda"))
    payload = dict(
        benchmark="grad_cache",
        machine=machine_info(device),
        size=args.size,
        config=SIZES[args.size],
        dtype=str(amp or "float32"),
        clock=args.clock,
        repeats=args.repeats,
        warmup=args.warmup,
        rows=rows,
    )
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
