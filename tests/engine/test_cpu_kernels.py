"""The tests that assert learning or numeric agreement, re-run with torch's CPU kernels forced to AVX2 (as on
most laptops and CI runners), so the suite is not green only by the accident of this machine's CPU. On a
machine whose own kernels are AVX2 the suite's run of them is that run, and the re-run is skipped as a repeat.

Run them under another kernel set by hand with ``ATEN_CPU_CAPABILITY=default python -m pytest <the tests>``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# learning (a short training beats chance / lowers the loss) and tolerance-based agreement (gradient caching)
LEARNING_TESTS = (
    "tests/engine/test_train.py::test_short_cpu_run_lowers_loss_and_beats_chance",
    "tests/engine/test_train_reid.py::test_short_synthetic_run_beats_chance",
    "tests/models/test_modeling_tagclip.py::test_training_step_lowers_loss",
    "tests/engine/test_grad_cache.py",
)


def _x86_with_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: x86-64 machines of the last decade have AVX2


def _native_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@pytest.mark.slow
@pytest.mark.skipif(not _x86_with_avx2(), reason="ATEN_CPU_CAPABILITY=avx2 needs an x86-64 CPU with AVX2")
@pytest.mark.skipif(
    _native_capability() == "AVX2",
    reason="this machine's own kernels are AVX2: the suite's own run of the learning tests is the AVX2 run",
)
def test_learning_tests_hold_under_avx2_kernels():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(ROOT)}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    capability = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600
    )
    assert capability.stdout.strip() == "AVX2", capability.stdout + capability.stderr[-2000:]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LEARNING_TESTS]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
