"""Time the test suite's tiers on this machine and write `benchmarks/results/suite_times.json`.

    python benchmarks/time_suite.py                # the fast tier (-m "not slow") and the full suite
    python benchmarks/time_suite.py --tiers fast

Each tier runs once in a subprocess from the repository root; its wall time, pytest's exit status and the
count of tests that ran are recorded with the machine record (cores and load average included: the
number is only meaningful on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIERS = {  # the README's commands: two pytest-xdist workers, each test file on one of them
    "fast": ["-m", "not slow", "-n", "2", "--dist", "loadfile"],
    "full": ["-n", "2", "--dist", "loadfile"],
}
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)")


def run_tier(name: str) -> dict[str, object]:
    args = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *TIERS[name]]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode:  # what failed, so a timing run is also a usable test run
        print("\n".join(done.stdout.splitlines()[-80:]), file=sys.stderr)
    counts = {kind: int(n) for n, kind in COUNTS.findall(done.stdout.splitlines()[-1] if done.stdout else "")}
    return {
        "tier": name,
        "command": " ".join(args).replace("not slow", '"not slow"'),
        "wall_s": round(wall, 1),
        "tests": sum(counts.values()),
        "counts": counts,
        "exit_status": done.returncode,
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiers", nargs="+", choices=list(TIERS), default=list(TIERS))
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "suite_times.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    rows = [run_tier(name) for name in args.tiers]
    for row in rows:
        print(
            f"{row['tier']}: {row['tests']} tests in {row['wall_s']:.0f} s (exit status {row['exit_status']})"
        )
    path = write_json(args.output, {"benchmark": "suite_times", "rows": rows})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
