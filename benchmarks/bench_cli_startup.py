"""How quickly the command line answers: CPU and wall time of ``tagclip --help``, ``tagclip VERB --help`` for
every verb and an argument error per verb, each a fresh process (``python -m modeling_tagclip.cli``, what the
``tagclip`` script runs), and whether it imported torch or transformers (``python -X importtime``).

``import torch`` in a fresh interpreter is measured alongside, for scale. Times are medians of ``--repeats``.

    python benchmarks/bench_cli_startup.py
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from modeling_tagclip.cli import VERBS  # noqa: E402

HEAVY = ("torch", "transformers")
BAD_FLAG = "--no-such-flag"


def commands() -> list[tuple[str, list[str]]]:
    """(what is measured, the arguments of ``python``): the top-level help, each verb's help and a bad flag."""
    cli = ["-m", "modeling_tagclip.cli"]
    rows = [("tagclip --help", [*cli, "--help"])]
    rows += [(f"tagclip {verb} --help", [*cli, verb, "--help"]) for verb in VERBS]
    rows += [(f"tagclip {verb} {BAD_FLAG}", [*cli, verb, BAD_FLAG]) for verb in VERBS]
    return rows


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_once(args: list[str]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, exit status) of one fresh ``python ARGS`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=_env(), capture_output=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.returncode


def heavy_imports(args: list[str]) -> list[str]:
    """The heavy packages (torch, transformers) a ``python ARGS`` process imports."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], env=_env(), capture_output=True, text=True, cwd=ROOT
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    return [name for name in HEAVY if name in imported]


def measure(name: str, args: list[str], repeats: int) -> dict[str, Any]:
    """One table row: median CPU and wall time, the exit status, the heavy imports."""
    runs = [run_once(args) for _ in range(repeats)]
    return {
        "command": name,
        "cpu_s": round(statistics.median(cpu for cpu, _, _ in runs), 3),
        "wall_s": round(statistics.median(wall for _, wall, _ in runs), 3),
        "exit_status": runs[0][2],
        "heavy_imports": ", ".join(heavy_imports(args)) or "none",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.common import RESULTS_DIR, print_table, write_json

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "cli_startup.json")
    args = parser.parse_args(argv)
    rows = [measure(name, command, args.repeats) for name, command in commands()]
    rows.append(measure("python -c 'import torch' (for scale)", ["-c", "import torch"], args.repeats))
    print_table(rows, ["command", "cpu_s", "wall_s", "exit_status", "heavy_imports"])
    payload = {"benchmark": "cli_startup", "repeats": args.repeats, "rows": rows}
    write_json(args.output, payload)
    print(f"wrote {args.output}")
    return payload


if __name__ == "__main__":
    main()
