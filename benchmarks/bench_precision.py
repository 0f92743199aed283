"""Serving precision: the same checkpoint evaluated in fp32, bf16 and fp16 autocast, side by side in one run.

For each dtype: test-split retrieval metrics (the project's evaluator), the cosine of every global and TSE
embedding to its fp32 value, the share of top-1 answers equal to fp32's, and the encoding time.

    python benchmarks/bench_precision.py --model outputs/tagclip-synthetic/best --data data/synthetic
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from modeling_tagclip.evaluation.text_retrieval import (  # noqa: E402
    load_eval_dataset,
    load_model,
    run_retrieval,
    summarize,
)
from modeling_tagclip.flags import accept_both_spellings  # noqa: E402

DTYPES = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}
METRICS = ("R@1", "R@5", "R@10", "mAP", "mINP")


def _cosines(run, reference) -> dict[str, float]:
    """Minimum and mean cosine of each embedding kind to the fp32 run."""
    out = {}
    for side in ("text", "image"):
        for key in ("global", "local"):
            a, b = getattr(run, side).get(key), getattr(reference, side).get(key)
            if a is None or b is None:
                continue
            cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
            out[f"{side}_{key}_cos_min"] = float(cos.min())
            out[f"{side}_{key}_cos_mean"] = float(cos.mean())
    return out


def _top1_agreement(run, reference) -> float:
    return float((run.scores().argmax(1) == reference.scores().argmax(1)).float().mean())


def measure(model_dir: str, data: str, batch_size: int, dtypes: list[str]) -> list[dict]:
    """One row per dtype; the first must be fp32 (the reference)."""
    model, processor = load_model(model_dir)
    dataset = load_eval_dataset(data)
    rows, reference = [], None
    for name in dtypes:
        start = time.perf_counter()
        run = run_retrieval(model, processor, dataset, batch_size=batch_size, amp=DTYPES[name], progress=False)
        seconds = time.perf_counter() - start
        metrics = summarize(run, probe=False)
        reference = reference or run
        row = {"dtype": name, "encode_s": round(seconds, 2), **{k: round(metrics[k], 2) for k in METRICS}}
        row.update({k: round(v, 5) for k, v in _cosines(run, reference).items()})
        row["top1_same_as_fp32"] = round(_top1_agreement(run, reference), 4)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="data/synthetic")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", default="benchmarks/results/precision_cpu.json")
    args = accept_both_spellings(p).parse_args(argv)
    if args.dtypes[0] != "fp32":
        p.error("the first dtype is the reference and must be fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.model, args.data, args.batch_size, args.dtypes)
    for row in rows:
        print(json.dumps(row))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"model": args.model, "data": args.data, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
