"""The main job over seeds: the README's command (`accelerate launch ... training/train.py`) with `--seed S` for
each seed, one after another, then a row per seed (test R@1 / R@5 / R@10 / mAP / mINP, the torch threads it
ran on, wall and CPU time) and the mean ± 95% Student-t half-width over the seeds.

    python benchmarks/mainjob_seeds.py                         # seeds 0 1 2, the default recipe, every core
    python benchmarks/mainjob_seeds.py --seeds 0 --quick       # a 60-step smoke run of the harness
    python benchmarks/mainjob_seeds.py -- --num_threads 1      # flags after -- go to train.py
    python benchmarks/mainjob_seeds.py --collect outputs/a outputs/b   # finished runs, without training

Writes benchmarks/results/mainjob_seeds.json with the machine record (command, commit, date, CPU model and
flags, load average). Wall time is what the job took; `cpu_s` (its processes' user + system time) tells a
loaded machine's wall time from an idle one's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, git_commit, write_json  # noqa: E402
from modeling_tagclip.cli import MAIN_JOB as CLI_MAIN_JOB  # noqa: E402

METRICS = ("R@1", "R@5", "R@10", "mAP", "mINP")
# The README's main-job command after `accelerate` (the package's MAIN_JOB, which a test keeps equal to the README)
MAIN_JOB = shlex.split(CLI_MAIN_JOB)[1:]


def run_row(folder: Path, seed: Any = None) -> dict[str, Any]:
    """One finished run's row; a folder without a readable eval_results.json is a ValueError naming it."""
    path = folder / "eval_results.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a finished run ({error})") from error
    missing = [m for m in METRICS if not isinstance(result.get(m), (int, float))]
    if missing:
        raise ValueError(f"{path}: lacks {', '.join(missing)}")
    threads = result.get("torch_threads")
    if threads is not None and result.get("num_processes"):
        threads *= result["num_processes"]
    return {
        "seed": seed if seed is not None else folder.name,
        **{m: result[m] for m in METRICS},
        "threads": threads,
        "best_step": result.get("best_step"),
        "wall_s": result.get("train_time_s"),
        "test_images": result.get("test_images"),
        "chance_R@1": result.get("chance_R@1"),
    }


def mean_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± 95% Student-t half-width of each metric over the rows (the mean alone for one row)."""
    from modeling_tagclip.ablation import mean_ci

    row: dict[str, Any] = {"seed": "mean ± 95% CI"}
    for metric in (*METRICS, "wall_s"):
        values = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
        if not values:
            continue
        stats = mean_ci(values)
        row[metric] = f"{stats['mean']:.2f} ± {stats['ci95']:.2f}" if len(values) > 1 else stats["mean"]
    threads = {r.get("threads") for r in rows}
    row["threads"] = threads.pop() if len(threads) == 1 else "mixed"
    return row


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_seed(seed: int, out: Path, extra: list[str]) -> dict[str, Any]:
    """One main-job run into ``out`` (replaced); its row, with the job's wall and CPU seconds."""
    shutil.rmtree(out, ignore_errors=True)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    command = [accelerate, *MAIN_JOB, "--seed", str(seed), "--output", str(out), *extra]
    cpu, wall = children_cpu_s(), time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - wall, children_cpu_s() - cpu
    if proc.returncode:
        raise SystemExit(f"seed {seed} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {**run_row(out, seed), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="60 steps per seed (checks the harness only)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "outputs" / "mainjob")
    parser.add_argument("--collect", type=Path, nargs="+", metavar="RUN", help="rows of finished run folders")
    parser.add_argument("--output", type=Path, default=None, help="default: results/mainjob_seeds.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    output = args.output or RESULTS_DIR / f"mainjob_seeds{'_quick' if args.quick else ''}.json"
    if args.collect:
        try:
            rows = [run_row(folder) for folder in args.collect]
        except ValueError as error:
            parser.error(str(error))
    else:
        extra = (["--max-steps", "60"] if args.quick else []) + extra
        load_before, runs_commit = (
            os.getloadavg(),
            git_commit(),
        )  # the code the runs ran (the record's: at the end)
        rows = []
        for seed in args.seeds:
            rows.append(run_seed(seed, args.work_dir / f"seed{seed}", extra))
            print(json.dumps(rows[-1]), flush=True)
    payload = {
        "benchmark": "mainjob",
        "job": "accelerate " + " ".join(MAIN_JOB + extra),
        "rows": rows + [mean_row(rows)],
    }
    if not args.collect:
        payload.update(load_average_before=load_before, runs_commit=runs_commit)
    path = write_json(output, payload)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
