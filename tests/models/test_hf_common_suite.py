"""Run transformers' ModelTesterMixin / ConfigTester suite on TAG-CLIP and ViSA (tests/hf_suite/); check the result.

The runner downloads the transformers sdist matching the installed version once (PyPI; cached in
`$HF_SUITE_DIR`, default `.cache/hf_suite`), then runs the upstream mixins offline. Takes about a minute.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "hf_suite" / "setup_suite.py"
MIN_PASSED = 390  # 403 passed with transformers 5.23.0 (TAG-CLIP 304, ViSA 99)
SUMMARY = re.compile(r"\d+ (?:passed|failed|skipped|errors?)\b.* in [\d.]+s")


def parse_summary(output: str) -> dict[str, int]:
    """Counts from pytest's final summary line, e.g. {"passed": 303, "skipped": 187, "subtests passed": 3324}."""
    lines = [line for line in output.splitlines() if SUMMARY.search(line)]
    if not lines:
        raise AssertionError("no pytest summary line in the output:\n" + output[-5000:])
    counts = {}
    for number, name in re.findall(
        r"(\d+) ((?:subtests )?(?:passed|failed|skipped|xfailed|xpassed|errors?|warnings?))", lines[-1]
    ):
        counts[name.replace("errors", "error").replace("warnings", "warning")] = int(number)
    return counts


def test_parse_summary():
    counts = parse_summary(
        "x\n=== 3 failed, 303 passed, 187 skipped, 2 xfailed, 3324 subtests passed in 40.29s ===\n"
    )
    assert counts == {"failed": 3, "passed": 303, "skipped": 187, "xfailed": 2, "subtests passed": 3324}
    assert parse_summary("1 error in 0.5s") == {"error": 1}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_transformers_common_model_suite():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, str(RUNNER), "-p", "no:warnings", "-rfE"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    output = proc.stdout + proc.stderr
    counts = parse_summary(proc.stdout)
    tail = output[-20000:]
    assert proc.returncode == 0, f"hf common suite exited {proc.returncode}: {counts}\n{tail}"
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0, f"{counts}\n{tail}"
    assert counts.get("subtests failed", 0) == 0 and counts.get("xpassed", 0) == 0, f"{counts}\n{tail}"
    assert counts.get("passed", 0) >= MIN_PASSED, (
        f"only {counts.get('passed', 0)} passed (< {MIN_PASSED}): {counts}"
    )
