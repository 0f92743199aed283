"""Training samples/s of the full TAG-CLIP loss (`model(..., return_loss=True)` + backward + AdamW step).

Variants: gradient checkpointing off/on, `torch.compile` off/on, timed in interleaved rounds (one step each
per round), so their ratios come from the same run. Each checkpointing setting has its own model and optimizer
(same seed, same weights), shared by its eager and compiled variants: toggling checkpointing on one model
made the compiled forward recompile at every switch (dynamo guards on `gradient_checkpointing` and on the
forward hook that each `activation_checkpointing_enable` adds).

    python benchmarks/bench_train_step.py                        # ViT-B/16 + 12-layer text, batch 4, eager
    python benchmarks/bench_train_step.py --compile              # also the compiled variants
    python benchmarks/bench_train_step.py --quick                # tiny model, seconds (compile only if asked)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
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
    pick_device,
    print_table,
    resolve_args,
    time_interleaved,
    write_json,
)
from modeling_tagclip.flags import positive_int  # noqa: E402

SOT, EOS = 49406, 49407
SIZES: dict[str, dict[str, Any]] = {
    "base": dict(vision={}, text={}, top={}),
    "small": dict(
        vision=dict(
            hidden_size=384,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=6,
            image_size=[128, 64],
            patch_size=16,
            moe_layers=[3, 4],
        ),
        text=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
        top=dict(projection_dim=256, tse_embed_dim=512),
    ),
    "tiny": dict(
        vision=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=[32, 16],
            patch_size=8,
            moe_layers=[1],
        ),
        text=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
        ),
        top=dict(projection_dim=16, tse_embed_dim=24),
    ),
}


def build_model(
    size: str, num_identities: int, device: torch.device, checkpointing: bool = False
) -> torch.nn.Module:
    """A randomly initialised TagClipModel of the size preset (seed 0), in train mode."""
    from modeling_tagclip import TagClipConfig, TagClipModel

    torch.manual_seed(0)
    preset = SIZES[size]
    config = TagClipConfig(
        vision_config=preset["vision"],
        text_config=preset["text"],
        num_identities=num_identities,
        attn_implementation="sdpa",
        **preset["top"],
    )
    model = TagClipModel(config).to(device).train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def make_batch(model: torch.nn.Module, batch: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random images, captions (SOT, words, EOS, 0-padding), view labels and identities (pairs share ids)."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    height, width = config.vision_config.image_hw
    length = config.text_config.max_position_embeddings
    ids = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        words = int(torch.randint(3, length - 2, (1,), generator=generator))
        ids[row, 0], ids[row, words + 1] = config.text_config.bos_token_id, config.text_config.eos_token_id
        ids[row, 1 : words + 1] = torch.randint(1, min(SOT, config.text_config.vocab_size - 2), (words,))
    tensors = dict(
        pixel_values=torch.randn(batch, 3, height, width, generator=generator),
        input_ids=ids,
        view_labels=torch.randint(0, 2, (batch,), generator=generator),
        person_ids=torch.arange(batch) // 2 % config.num_identities,
    )
    return {name: value.to(device) for name, value in tensors.items()}


def step_fn(
    forward: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    amp: torch.dtype | None,
) -> Callable[[], float]:
    """One optimisation step of the full loss."""

    def run() -> float:
        device_type = batch["pixel_values"].device.type
        autocast = torch.autocast(device_type, dtype=amp) if amp is not None else contextlib.nullcontext()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = forward(**batch, return_loss=True).loss
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return run


def compile_stats(forward: Callable[[], Any]) -> dict[str, Any]:
    """Seconds of the first (compiling) call and the dynamo graph / graph-break counts it left."""
    import torch._dynamo

    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    forward()
    seconds = time.perf_counter() - start
    counters = torch._dynamo.utils.counters
    breaks = dict(counters["graph_break"])
    return dict(
        first_call_s=round(seconds, 2),
        graphs=int(counters["stats"].get("unique_graphs", 0)),
        graph_breaks=sum(breaks.values()),
        graph_break_reasons=[r.splitlines()[0] for r in sorted(breaks, key=breaks.get, reverse=True)[:8]],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__, "tiny model, batch 2, 2 repeats", SIZES)
    parser.add_argument("--batch-size", type=positive_int, default=None, help="default 4 (2 with --quick)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd variants")
    parser.add_argument("--no-eager", action="store_true", help="only the compiled variants")
    parser.add_argument(
        "--repeats", type=positive_int, default=None, help="timed rounds (default 3, quick 2)"
    )
    parser.add_argument("--num-identities", type=positive_int, default=64)
    add_run_args(parser)
    quick = dict(size="tiny", batch_size=2, repeats=2)
    full = dict(size="base", batch_size=4, repeats=3)
    return resolve_args(parser.parse_args(argv), quick, full, "train_step_{size}.json")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.device)
    amp = autocast_dtype(device, args.dtype)
    models = {ckpt: build_model(args.size, args.num_identities, device, ckpt) for ckpt in (False, True)}
    optimizers = {ckpt: torch.optim.AdamW(m.parameters(), lr=1e-5) for ckpt, m in models.items()}
    batch = make_batch(models[False], args.batch_size, device)
    modes = [] if args.no_eager else ["eager"]
    if args.compile:
        # torch 2.13: with the AOTAutograd cache on, replaying the model's aliased outputs (views such as
        # `dense[:, 0]`) hits a ViewMeta use-after-free, "RuntimeError: shape '[<garbage>]' is invalid"
        # (pytorch/pytorch#185630, fixed in #184774); without the cache the same graphs run correctly.
        torch._functorch.config.enable_autograd_cache = False
        modes.append("compile")
    fns, compile_info = {}, {}
    for mode in modes:
        for checkpointing, model in models.items():
            name = f"{mode}{'+ckpt' if checkpointing else ''}"
            forward = torch.compile(model) if mode == "compile" else model
            fns[name] = step_fn(forward, optimizers[checkpointing], batch, amp)
            if mode == "compile":
                compile_info[name] = compile_stats(fns[name])
    times = time_interleaved(fns, args.repeats, args.warmup, device, args.clock)
    base = next(iter(times))
    rows = [
        dict(
            variant=name,
            batch=args.batch_size,
            median_s=median(ts),
            samples_per_s=args.batch_size / median(ts),
            time_vs_first=median(t / b for t, b in zip(ts, times[base], strict=True)),
            times_s=[round(t, 4) for t in ts],
            **compile_info.get(name, {}),
        )
        for name, ts in times.items()
    ]
    columns = ["variant", "batch", "median_s", "samples_per_s", "time_vs_first"]
    print_table(rows, columns + (["first_call_s", "graphs", "graph_breaks"] if args.compile else []))
    payload = dict(
        benchmark="train_step",
        machine=machine_info(device),
        size=args.size,
        config=SIZES[args.size],
        dtype=str(amp or "float32"),
        clock=args.clock,
        repeats=args.repeats,
        warmup=args.warmup,
        baseline=base,
        rows=rows,
        num_parameters=sum(p.numel() for p in models[False].parameters()),
    )
    if args.compile:  # frames compiled since the last first call (counters cleared there): > 1 = recompiles
        payload["dynamo_frames"] = dict(torch._dynamo.utils.counters["frames"])
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
