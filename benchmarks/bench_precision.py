"""Serving precision: the same checkpoint in fp32, bf16 and fp16 autocast, side by side in one run.

Per variant: test-split retrieval metrics (the project's evaluator), the cosine of every global and TSE
embedding to its fp32 value, the share of top-1 answers and of TSE token sets (images, captions) equal to
fp32's, the share of rows re-run in fp32, and the model's CPU time (process clock, median of interleaved rounds,
inputs preprocessed once). Variants: `fp32`; `bf16` (autocast, what serving runs: rows near a tie of TSE's
selection or of the aerial/ground routing are re-run in fp32 and take its outputs,
the model's `precision_policy`, `NearTieRerun`); `bf16-tse-only` (the routing part off, `routing_recheck_eps = 0`: the
rows the previous re-check re-ran); `bf16-fixed-eps` (the TSE threshold a fixed 1 bf16 epsilon, not scaled by the
row's `log_score_spread`); `bf16-plain` (no re-run); `bf16-weights` (weights cast to bf16, as `dtype="bf16"`
loads them: no fp32 weights to re-run with); `fp16`. `--localise` adds where plain bf16's token-set disagreement
comes from: plain bf16 with parts of a tower kept in fp32, fp32 on bf16-rounded pixels, and how near fp32's own
selections are to a tie. `--criteria` adds, for the rows plain bf16 changes, their bf16 margin under both TSE
criteria and the share of rows each flags, and the same for the images whose routing plain bf16 flips.

    python benchmarks/bench_precision.py --model outputs/mainjob/seed0/best --data data/synthetic --threads 1 \\
        --localise --criteria
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import add_allow_dirty, write_json  # noqa: E402
from modeling_tagclip.evaluation.text_retrieval import (  # noqa: E402
    load_eval_dataset,
    load_model,
    run_retrieval,
    summarize,
)
from modeling_tagclip.flags import accept_both_spellings, positive_int  # noqa: E402
from modeling_tagclip.models.tagclip import precision_tagclip  # noqa: E402
from modeling_tagclip.models.tagclip.modeling_tagclip import image_tse_scores, text_tse_scores  # noqa: E402
from modeling_tagclip.models.tagclip.precision_tagclip import log_score_spread, selection_margin  # noqa: E402
from modeling_tagclip.retrieval.encode import load_rgb  # noqa: E402

FIXED_EPS = 1.0  # an earlier TSE threshold: a fixed 1 bf16 epsilon
# variant -> (autocast dtype, tse_recheck_eps, routing_recheck_eps (None: the model's defaults), weights dtype)
VARIANTS = {
    "fp32": (None, None, None, torch.float32),
    "bf16": ("bf16", None, None, torch.float32),
    "bf16-tse-only": ("bf16", None, 0.0, torch.float32),
    "bf16-fixed-eps": ("bf16", FIXED_EPS, None, torch.float32),
    "bf16-plain": ("bf16", 0.0, 0.0, torch.float32),
    "bf16-weights": (None, None, None, torch.bfloat16),  # what `dtype="bf16"` loads (handler, demo, pipeline)
    "fp16": ("fp16", None, None, torch.float32),
}
# fp16 autocast barely casts on CPU (slow)
DEFAULT_VARIANTS = ["fp32", "bf16", "bf16-tse-only", "bf16-plain", "bf16-weights"]
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
METRICS = ("R@1", "R@5", "R@10", "mAP", "mINP")
BF16_EPS = torch.finfo(torch.bfloat16).eps


@contextlib.contextmanager
def recheck(
    model, eps: float | None, routing_eps: float | None = None, fixed: bool = False
) -> Iterator[None]:
    """`model.precision_policy.tse_recheck_eps = eps`, `model.precision_policy.routing_recheck_eps = routing_eps` inside the block (None: leave the
    default); `fixed`: the TSE threshold `eps` epsilons whatever the row's score spread (the spread replaced by 1)."""
    defaults, spread = (
        (model.precision_policy.tse_recheck_eps, model.precision_policy.routing_recheck_eps),
        precision_tagclip.log_score_spread,
    )
    model.precision_policy.tse_recheck_eps = defaults[0] if eps is None else eps
    model.precision_policy.routing_recheck_eps = defaults[1] if routing_eps is None else routing_eps
    if fixed:
        precision_tagclip.log_score_spread = lambda scores: torch.ones(scores.shape[0], device=scores.device)
    try:
        yield
    finally:
        (
            (model.precision_policy.tse_recheck_eps, model.precision_policy.routing_recheck_eps),
            precision_tagclip.log_score_spread,
        ) = (
            defaults,
            spread,
        )


@contextlib.contextmanager
def kept_in_fp32(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Run `modules` in fp32 under autocast (autocast off, first input cast to fp32): a measurement harness."""
    for module in modules:
        forward = module.forward

        def fp32_forward(first, *args, _forward=forward, **kwargs):
            with torch.autocast(first.device.type, enabled=False):
                return _forward(first.float(), *args, **kwargs)

        module.forward = fp32_forward
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def load_inputs(processor, dataset) -> dict[str, torch.Tensor]:
    """Pixels, view labels and caption ids of a split, preprocessed once."""
    images = processor(images=[load_rgb(p) for p in dataset["image_path"]], views=list(dataset["view"]))
    captions = [caption for captions in dataset["captions"] for caption in captions]
    return {**images, "input_ids": processor(text=captions)["input_ids"]}


def encode(model, inputs: dict, amp: str | None, batch_size: int, pixels: torch.Tensor | None = None) -> dict:
    """TSE indices, global and TSE embeddings of every image and caption, and the rows re-run in fp32."""
    rerun = {"image": 0, "text": 0}

    def count(side):
        def hook(module, args, kwargs):
            if amp and not torch.is_autocast_enabled("cpu"):
                rerun[side] += kwargs.get("pixel_values", kwargs.get("input_ids")).shape[0]

        return hook

    hooks = [
        model.vision_model.register_forward_pre_hook(count("image"), with_kwargs=True),
        model.text_model.register_forward_pre_hook(count("text"), with_kwargs=True),
    ]
    pixels = inputs["pixel_values"] if pixels is None else pixels
    out = {"image": [], "text": []}
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=AMP.get(amp), enabled=amp is not None):
            for start in range(0, len(pixels), batch_size):
                rows = slice(start, start + batch_size)
                labels = inputs["view_labels"][rows] if "view_labels" in inputs else None
                out["image"].append(model.get_image_features(pixels[rows], labels))
            for start in range(0, len(inputs["input_ids"]), 4 * batch_size):
                out["text"].append(
                    model.get_text_features(inputs["input_ids"][start : start + 4 * batch_size])
                )
    finally:
        for hook in hooks:
            hook.remove()
    return {side: _concat(parts) | {"rerun": rerun[side]} for side, parts in out.items()}


def _concat(parts) -> dict[str, torch.Tensor]:
    return {
        key: torch.cat([getattr(p, name).float() for p in parts])
        for key, name in (("indices", "tse_indices"), ("global", "pooler_output"), ("local", "local_embeds"))
    }


def sets_equal(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Per row: the same set of TSE tokens (for captions, of the first min(k, words) that TSE pools)."""
    if counts is not None:
        dropped = torch.arange(a.shape[1])[None, :] >= counts.clamp(max=a.shape[1])[:, None]
        a, b = a.masked_fill(dropped, -1), b.masked_fill(dropped, -1)
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1)


def _share(mask: torch.Tensor) -> float:
    return round(float(mask.float().mean()), 4)


def word_counts(model, inputs: dict) -> torch.Tensor:
    return (inputs["input_ids"] != model.config.text_config.pad_token_id).sum(dim=1) - 2


def agreement(model, inputs: dict, run: dict, reference: dict) -> dict[str, float]:
    """Shares of token sets equal to fp32's, TSE-embedding cosines, shares of rows re-run in fp32."""
    row = {}
    for side, counts in (("image", None), ("text", word_counts(model, inputs))):
        same = sets_equal(run[side]["indices"], reference[side]["indices"], counts)
        row[f"{side}_tse_sets_equal"] = _share(same)
        cos = F.cosine_similarity(run[side]["local"], reference[side]["local"], dim=-1)
        row[f"{side}_tse_cos_min"] = round(float(cos.min()), 5)
        row[f"{side}_rerun_fp32"] = round(run[side]["rerun"] / len(same), 4)
    return row


def _cosines(run, reference) -> dict[str, float]:
    """Minimum and mean cosine of each embedding kind to the fp32 run."""
    out = {}
    for side in ("text", "image"):
        for key in ("global", "local"):
            a, b = getattr(run, side).get(key), getattr(reference, side).get(key)
            if a is None or b is None:
                continue
            cos = F.cosine_similarity(a.float(), b.float(), dim=-1)
            out[f"{side}_{key}_cos_min"] = float(cos.min())
            out[f"{side}_{key}_cos_mean"] = float(cos.mean())
    return out


def _top1_agreement(run, reference) -> float:
    return float((run.scores().argmax(1) == reference.scores().argmax(1)).float().mean())


def variant(models: dict, name: str) -> tuple:
    """(model, autocast dtype, re-check context) of a variant; `models` caches the model per weights dtype."""
    amp, eps, routing_eps, weights = VARIANTS[name]
    if weights not in models:
        models[weights] = copy.deepcopy(models[torch.float32]).to(weights)
    return models[weights], amp, recheck(models[weights], eps, routing_eps, fixed=name == "bf16-fixed-eps")


def cpu_seconds(
    models: dict, inputs: dict, variants: list[str], batch_size: int, rounds: int
) -> dict[str, float]:
    """Median process-CPU seconds to encode every image and caption, per variant, rounds interleaved."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            net, amp, context = variant(models, name)
            with context:
                start = time.process_time()
                encode(net, inputs, amp, batch_size)
                times[name].append(time.process_time() - start)
    return {name: round(statistics.median(values), 3) for name, values in times.items()}


def measure(
    model_dir: str,
    data: str,
    batch_size: int,
    variants: list[str],
    rounds: int = 3,
    limit: int | None = None,
    split: str = "test",
) -> tuple:
    """One row per variant (the first must be fp32, the reference), and (fp32 model, inputs, fp32 features)."""
    model, processor = load_model(model_dir)
    dataset = load_eval_dataset(data, split=split)
    dataset = dataset.select(range(min(limit, len(dataset)))) if limit else dataset
    inputs = load_inputs(processor, dataset)
    models = {torch.float32: model}
    seconds = cpu_seconds(models, inputs, variants, batch_size, rounds)
    rows, reference, features = [], None, None
    for name in variants:
        net, amp, context = variant(models, name)
        with context:
            run = run_retrieval(net, processor, dataset, batch_size=batch_size, amp=amp, progress=False)
            encoded = encode(net, inputs, amp, batch_size)
        metrics = summarize(run, probe=False)
        reference, features = reference or run, features or encoded
        row = {"variant": name, "model_cpu_s": seconds[name], **{k: round(metrics[k], 2) for k in METRICS}}
        row.update({k: round(v, 5) for k, v in _cosines(run, reference).items()})
        row["top1_same_as_fp32"] = round(_top1_agreement(run, reference), 4)
        row.update(agreement(model, inputs, encoded, features))
        rows.append(row)
    return rows, (model, inputs, features)


def localise(model, inputs: dict, reference: dict, batch_size: int) -> dict:
    """Plain bf16 with parts of a tower kept in fp32 (token-set agreement with fp32), fp32 on bf16-rounded
    pixels, and fp32's own image selection margins."""
    vision, blocks, text_blocks = (
        model.vision_model,
        model.vision_model.encoder.layers,
        model.text_model.encoder.layers,
    )
    parts = {"image: patch embedding": [vision.embeddings]}
    parts.update({f"image: last {j} block(s)": blocks[-j:] for j in range(1, len(blocks) + 1)})
    parts["image: patch embedding + every block"] = [vision.embeddings, *blocks]
    parts.update({f"text: last {j} block(s)": text_blocks[-j:] for j in range(1, len(text_blocks) + 1)})
    with recheck(model, 0.0, 0.0):
        plain = encode(model, inputs, "bf16", batch_size)
        rows = [{"fp32 part": "none (plain bf16)", **_agreement_only(model, inputs, plain, reference)}]
        for name, modules in parts.items():
            with kept_in_fp32(list(modules)):
                run = encode(model, inputs, "bf16", batch_size)
            side = name.split(":")[0]
            rows.append({"fp32 part": name, **_agreement_only(model, inputs, run, reference, side)})
    rounded = encode(model, inputs, None, batch_size, pixels=inputs["pixel_values"].bfloat16().float())
    rows.append(
        {
            "fp32 part": "image: all, on bf16-rounded pixels",
            **_agreement_only(model, inputs, rounded, reference, "image"),
        }
    )
    flipped = ~sets_equal(plain["image"]["indices"], reference["image"]["indices"])
    return {"rows": rows, "fp32_image_margins": margins(model, inputs, flipped, batch_size)}


def _agreement_only(model, inputs: dict, run: dict, reference: dict, side: str = "") -> dict:
    """`agreement` without the re-run shares, only the columns of `side` ("image", "text"; "" = both)."""
    row = agreement(model, inputs, run, reference)
    return {k: v for k, v in row.items() if k.startswith(side) and "rerun" not in k}


def margins(model, inputs: dict, flipped: torch.Tensor, batch_size: int) -> dict:
    """fp32 image selection margins (relative gap k-th / (k+1)-th score) in units of bf16's epsilon."""
    with torch.inference_mode():
        rows = [
            vision_row(model, inputs["pixel_values"][s : s + batch_size])
            for s in range(0, len(flipped), batch_size)
        ]
    margin = selection_margin(image_tse_scores(torch.cat(rows)), model.image_tse_k) / BF16_EPS
    return {
        "quantiles_1_5_10_50": [round(float(margin.quantile(q)), 3) for q in (0.01, 0.05, 0.1, 0.5)],
        "share_below_1_eps": _share(margin < 1),
        "of_images_plain_bf16_changes": sorted(round(float(m), 3) for m in margin[flipped]),
    }


def vision_row(model, pixels: torch.Tensor) -> torch.Tensor:
    return model.vision_model(pixel_values=pixels).attention_row


def criteria(model, inputs: dict, reference: dict, batch_size: int) -> dict:
    """Per side: how far bf16 moves `selection_margin` from fp32's (in epsilons, and over the bf16 row's
    `log_score_spread`), and for the rows plain bf16 changes, their bf16 margin under the previous criterion
    (epsilons) and the current one (epsilons x spread): the largest (the smallest constant re-checking them
    all), the share of rows flagged at it, and at each criterion's default (1; `tse_recheck_eps`); and the same
    for the images whose aerial/ground routing plain bf16 flips (`routing_criteria`)."""
    with recheck(model, 0.0, 0.0):
        plain = encode(model, inputs, "bf16", batch_size)
    bf16, fp32 = tse_scores(model, inputs, batch_size, "bf16"), tse_scores(model, inputs, batch_size, None)
    out = {}
    for side, counts in (("image", None), ("text", word_counts(model, inputs))):
        changed = ~sets_equal(plain[side]["indices"], reference[side]["indices"], counts)
        k = min(model.image_tse_k if side == "image" else model.text_tse_k, bf16[side].shape[1] - 1)
        margin = selection_margin(bf16[side], k, counts) / BF16_EPS
        spread = log_score_spread(bf16[side])
        shift = (margin - selection_margin(fp32[side], k, counts) / BF16_EPS).abs()
        out[side] = {
            "rows": len(changed),
            "changed_by_plain_bf16": int(changed.sum()),
            "spread_median": round(float(spread.median()), 3),
            "margin_shift_eps_q50_q99_max": _quantiles(shift),
            "margin_shift_over_spread_q50_q99_max": _quantiles(shift / spread),
            "corr_log_shift_log_spread": round(
                float(torch.corrcoef(torch.stack([shift.clamp_min(1e-3).log(), spread.log()]))[0, 1]), 3
            ),
            "fixed_eps": _flagged(margin, changed, FIXED_EPS),
            "eps_x_spread": _flagged(margin / spread, changed, model.precision_policy.tse_recheck_eps),
        }
    out["image"]["routing"] = routing_criteria(model, inputs, batch_size)
    return out


def routing_criteria(model, inputs: dict, batch_size: int) -> dict:
    """Images whose aerial/ground argmax decision plain bf16 flips in some HR-MoE block, their smallest bf16
    `view_margin` over the blocks in epsilons (what `routing_recheck_eps` bounds), and how far bf16 moves the
    margins (|bf16 - fp32| of the signed margins, in epsilons, every block); {} without argmax routing."""
    (bf16, bf16_group), (fp32, fp32_group) = (
        view_margins(model, inputs, batch_size, amp) for amp in ("bf16", None)
    )
    if bf16 is None:
        return {}
    flipped = (bf16_group != fp32_group).any(dim=1)
    sign = lambda group: 1 - 2 * group.float()  # noqa: E731  (aerial +, ground -)
    shift = (bf16 * sign(bf16_group) - fp32 * sign(fp32_group)).abs() / BF16_EPS
    smallest = bf16.amin(dim=1) / BF16_EPS
    return {
        "flipped_by_plain_bf16": int(flipped.sum()),
        "margin_eps_q01_q05_q50": [round(float(smallest.quantile(q)), 3) for q in (0.01, 0.05, 0.5)],
        "margin_shift_eps_q50_q99_max": _quantiles(shift.flatten()),
        "eps": _flagged(smallest, flipped, model.precision_policy.routing_recheck_eps),
    }


def view_margins(model, inputs: dict, batch_size: int, amp: str | None) -> tuple:
    """Per image and argmax-routed HR-MoE block: `view_margin` and the chosen group (0 aerial, 1 ground), [N, L]
    each, of a forward under `amp` autocast (None: fp32); (None, None) without argmax routing."""
    margins, groups = [], []
    with torch.inference_mode(), torch.autocast("cpu", dtype=AMP.get(amp), enabled=amp is not None):
        for start in range(0, len(inputs["pixel_values"]), batch_size):
            rows = slice(start, start + batch_size)
            out = model.vision_model(
                pixel_values=inputs["pixel_values"][rows],
                view_labels=inputs["view_labels"][rows],
                output_router_logits=True,
            )
            routed = [r for r in out.router_logits if r.view_margin is not None]
            if not routed:
                return None, None
            margins.append(torch.stack([r.view_margin for r in routed], dim=1))
            groups.append(torch.stack([r.group_weights.argmax(dim=-1) for r in routed], dim=1))
    return torch.cat(margins), torch.cat(groups)


def _quantiles(values: torch.Tensor) -> list[float]:
    return [round(float(values.quantile(q)), 3) for q in (0.5, 0.99, 1.0)]


def _flagged(value: torch.Tensor, changed: torch.Tensor, default: float) -> dict:
    """A criterion `value < constant`: the changed rows' values, the constant flagging them all, shares."""
    needed = float(value[changed].max()) if changed.any() else 0.0
    return {
        "changed_rows": sorted(round(float(v), 3) for v in value[changed]),
        "needed": round(needed, 3),
        "flagged_at_needed": _share(value <= needed),
        "default": default,
        "flagged_at_default": _share(value < default),
        "missed_at_default": int((changed & (value >= default)).sum()),
    }


def tse_scores(model, inputs: dict, batch_size: int, amp: str | None) -> dict[str, torch.Tensor]:
    """TSE's score rows (images, captions) of a forward under `amp` autocast (None: fp32)."""
    ids, pad = inputs["input_ids"], model.config.text_config.pad_token_id
    image, text = [], []
    with torch.inference_mode(), torch.autocast("cpu", dtype=AMP.get(amp), enabled=amp is not None):
        for start in range(0, len(inputs["pixel_values"]), batch_size):
            rows = slice(start, start + batch_size)
            pixels, labels = inputs["pixel_values"][rows], inputs["view_labels"][rows]
            image.append(
                image_tse_scores(model.vision_model(pixel_values=pixels, view_labels=labels).attention_row)
            )
        for start in range(0, len(ids), 4 * batch_size):
            chunk = ids[start : start + 4 * batch_size]
            eos = model.text_model.eos_positions(chunk)
            text.append(text_tse_scores(model.text_model(input_ids=chunk).attention_row, chunk, eos, pad)[0])
    return {"image": torch.cat(image), "text": torch.cat(text)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="data/synthetic")
    p.add_argument("--batch_size", type=positive_int, default=64)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds (median)")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N images of the split")
    p.add_argument("--localise", action="store_true", help="also the fp32-parts / margin measurement")
    p.add_argument("--criteria", action="store_true", help="changed rows' margins, both criteria")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--output", default="benchmarks/results/precision_cpu.json")
    add_allow_dirty(p)
    args = accept_both_spellings(p).parse_args(argv)
    if args.variants[0] != "fp32":
        p.error("the first variant is the reference and must be fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, (model, inputs, reference) = measure(
        args.model, args.data, args.batch_size, args.variants, args.rounds, args.limit, args.split
    )
    command = " ".join(
        ["python benchmarks/bench_precision.py", *(argv if argv is not None else sys.argv[1:])]
    )
    result = {
        "command": command,
        "threads": torch.get_num_threads(),
        "tse_recheck_eps": model.precision_policy.tse_recheck_eps,
        "routing_recheck_eps": model.precision_policy.routing_recheck_eps,
        "torch": torch.__version__,
        "rows": rows,
    }
    for row in rows:
        print(json.dumps(row))
    if args.localise:
        result["localisation"] = localise(model, inputs, reference, args.batch_size)
        print(json.dumps(result["localisation"], indent=1))
    if args.criteria:
        result["criteria"] = criteria(model, inputs, reference, args.batch_size)
        print(json.dumps(result["criteria"]))
    print(f"wrote {write_json(args.output, result)}")
    return rows


if __name__ == "__main__":
    main()
