"""The tree is ruff-clean: `ruff check` and `ruff format --check` pass (configuration in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    return subprocess.run([ruff, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_ruff_check_passes():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_ruff_format_check_passes():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
