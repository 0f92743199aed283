"""k-reciprocal re-ranking on the synthetic aerial-ground re-ID set (CARGO layout): mAP and R@1 of each
protocol with and without re-ranking, per trained ViSA model (one per seed), and what re-ranking costs.

    accelerate launch training/train.py --task reid --seed S --output runs/visa-sS   # for S in 0 1 2
    python benchmarks/bench_rerank.py --models runs/visa-s0/best runs/visa-s1/best runs/visa-s2/best

Each model is encoded once; the plain ranking and the re-ranked one (`tagclip eval --task reid --rerank`,
k1 20, k2 6, lambda 0.3 unless given) use the same features. Rows: one per protocol, mean ± 95% Student-t
half-width over the models; `rerank_s` is the re-ranking's CPU time for every protocol of one model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, check_publishable, write_json  # noqa: E402

PROTOCOLS = ("ALL", "A<->G", "G->A", "G<->G", "A<->A")


def measure(model_path: str, data_path: str, config: Any) -> dict[str, Any]:
    """One model: features once, then every protocol plain and re-ranked (metrics and CPU time)."""
    from modeling_tagclip.data.reid import load_reid_dataset
    from modeling_tagclip.evaluation.reid import encode, load_visa
    from modeling_tagclip.metrics.reid import evaluate_protocols

    data = load_reid_dataset(data_path)
    model = load_visa(model_path, "cpu")
    query, gallery = encode(model, data.query), encode(model, data.gallery)
    protocols = {name: data.protocols[name] for name in PROTOCOLS}
    plain = evaluate_protocols(query, gallery, data.query, data.gallery, protocols)
    start = time.process_time()
    reranked = evaluate_protocols(query, gallery, data.query, data.gallery, protocols, rerank=config)
    return {
        "model": model_path,
        "plain": plain,
        "reranked": reranked,
        "rerank_s": time.process_time() - start,
        "query": len(data.query),
        "gallery": len(data.gallery),
    }


def summary_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per protocol: mean ± 95% CI over the models of mAP and R@1, plain and re-ranked."""
    from modeling_tagclip.ablation import mean_ci

    def cell(values: list[float]) -> str:
        stats = mean_ci(values)
        return f"{stats['mean']:.2f}" if stats["n"] == 1 else f"{stats['mean']:.2f} ± {stats['ci95']:.2f}"

    rows = []
    for name in PROTOCOLS:
        row: dict[str, Any] = {"protocol": name, "models": len(runs)}
        for kind in ("plain", "reranked"):
            for metric in ("mAP", "R1"):
                row[f"{metric}_{kind}"] = cell([run[kind][name][metric] for run in runs])
        row["mAP_gain"] = cell([run["reranked"][name]["mAP"] - run["plain"][name]["mAP"] for run in runs])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    from modeling_tagclip.metrics.rerank import RerankConfig

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", required=True, help="saved ViSA folders, one per seed")
    parser.add_argument("--data", default="data/synthetic_reid", help="the re-ID set (default: %(default)s)")
    parser.add_argument("--k1", type=int, default=RerankConfig.k1)
    parser.add_argument("--k2", type=int, default=RerankConfig.k2)
    parser.add_argument("--lambda-value", type=float, default=RerankConfig.lambda_value)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "rerank_cpu.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    check_publishable(args.output)
    config = RerankConfig(args.k1, args.k2, args.lambda_value)
    runs = [measure(model, args.data, config) for model in args.models]
    payload = {
        "benchmark": "rerank",
        "rows": summary_rows(runs),
        "runs": runs,
        "rerank": {"k1": config.k1, "k2": config.k2, "lambda_value": config.lambda_value},
    }
    print(f"wrote {write_json(args.output, payload)}")
    for row in payload["rows"]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
