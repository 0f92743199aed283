"""Collect finished training runs (their `eval_results.json`) into one results file with the machine record.

    python benchmarks/collect_runs.py outputs/mainjob/seed0 outputs/mainjob/seed1 outputs/mainjob/seed2

Each run folder gives one row (R@1/5/10, mAP, mINP, best step, training time); the last row is the mean ±
95% Student-t half-width over the runs. Writes `benchmarks/results/mainjob_seeds.json` unless `--output`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, write_json  # noqa: E402

METRICS = ("R@1", "R@5", "R@10", "mAP", "mINP")


def run_row(folder: Path) -> dict[str, Any]:
    """One run's test metrics; a folder without a readable eval_results.json is a ValueError naming it."""
    path = folder / "eval_results.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a finished run ({error})") from error
    missing = [m for m in METRICS if not isinstance(result.get(m), (int, float))]
    if missing:
        raise ValueError(f"{path}: lacks {', '.join(missing)}")
    seed = result.get(
        "seed", result.get("config", {}).get("seed") if isinstance(result.get("config"), dict) else None
    )
    return {"seed": seed if seed is not None else folder.name, **{m: result[m] for m in METRICS},
            "best_step": result.get("best_step"), "wall_s": result.get("train_time_s")}  # fmt: skip


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from modeling_tagclip.ablation import mean_ci

    row: dict[str, Any] = {"seed": "mean ± 95% CI"}
    for metric in METRICS:
        stats = mean_ci([r[metric] for r in rows])
        row[metric] = f"{stats['mean']:.2f} ± {stats['ci95']:.2f}" if len(rows) > 1 else stats["mean"]
    return row


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="training output folders (with eval_results.json)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "mainjob_seeds.json")
    args = parser.parse_args(argv)
    try:
        rows = [run_row(folder) for folder in args.runs]
    except ValueError as error:
        parser.error(str(error))
    path = write_json(args.output, {"benchmark": "runs", "runs": [str(r) for r in args.runs],
                                    "rows": rows + [mean_row(rows)]})  # fmt: skip
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
