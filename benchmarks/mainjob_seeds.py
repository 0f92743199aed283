"""The main job over seeds: `accelerate launch training/train.py --seed S` for each seed, one after another,
then test R@1 / R@5 / R@10 / mAP / mINP per seed, their mean ± 95% CI (Student t) and the time each run took.

    python benchmarks/mainjob_seeds.py                         # seeds 0 1 2, the default recipe, every core
    python benchmarks/mainjob_seeds.py --seeds 0 --quick       # a 60-step smoke run of the harness
    python benchmarks/mainjob_seeds.py -- --num_threads 1      # flags after -- go to train.py

Writes benchmarks/results/mainjob_seeds.json with the command, commit, date and machine (CPU model and flags,
load average before and after, the torch thread count each run used). Each run's wall time and CPU time
(its processes' user + system) are recorded; on a shared machine wall time is inflated, so the JSON also holds
``idle_wall_estimate_s`` = CPU time / threads, labelled as an estimate (it assumes perfect thread scaling, so it
is a lower bound of the wall time on an idle machine of the same kind).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from modeling_tagclip.ablation import mean_ci  # noqa: E402

METRICS = ("R@1", "R@5", "R@10", "mAP", "mINP")


def cpu_flags() -> list[str]:
    """The SIMD flags of the CPU (/proc/cpuinfo), which decide the kernels torch runs."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(
                    f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "sse4", "fma", "amx"))
                )
    except OSError:
        pass
    return []


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_seed(seed: int, out: Path, extra: list[str]) -> dict:
    """One main-job run; its test metrics, thread count, wall and CPU seconds."""
    shutil.rmtree(out, ignore_errors=True)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    command = [
        accelerate,
        "launch",
        "training/train.py",
        "--seed",
        str(seed),
        "--output_dir",
        str(out),
        *extra,
    ]
    cpu, wall = children_cpu_s(), time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - wall, children_cpu_s() - cpu
    if proc.returncode:
        raise SystemExit(f"seed {seed} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    result = json.loads((out / "eval_results.json").read_text())
    threads = result["torch_threads"] * result["num_processes"]
    return {
        "seed": seed,
        **{k: result[k] for k in METRICS},
        "chance_R@1": result["chance_R@1"],
        "best_step": result["best_step"],
        "torch_threads": result["torch_threads"],
        "train_time_s": result["train_time_s"],
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "idle_wall_estimate_s": round(cpu / threads, 1),
        "test_images": result["test_images"],
        "train_identities": result["train_identities"],
        "validation_images": result["validation_images"],
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="60 steps per seed (checks the harness only)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "outputs" / "mainjob")
    parser.add_argument(
        "--output", type=Path, default=None, help="default: results/mainjob_seeds[_quick].json"
    )
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    extra = (["--max_steps", "60"] if args.quick else []) + extra
    output = args.output or RESULTS_DIR / f"mainjob_seeds{'_quick' if args.quick else ''}.json"
    load_before = os.getloadavg()
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, args.work_dir / f"seed{seed}", extra))
        print(json.dumps(runs[-1]), flush=True)
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    payload = {
        "command": "python benchmarks/mainjob_seeds.py " + " ".join(argv),
        "runs_command": "accelerate launch training/train.py --seed S " + " ".join(extra),
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **machine_info(torch.device("cpu")),
            "cpu_flags": cpu_flags(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "runs": runs,
        "summary": {k: mean_ci([r[k] for r in runs]) for k in (*METRICS, "wall_s", "idle_wall_estimate_s")},
    }
    write_json(output, payload)
    print(f"wrote {output}")
    return payload


if __name__ == "__main__":
    main()
