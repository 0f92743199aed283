"""The two test tiers (conftest.py): `-m "not slow"` for the edit loop, everything in CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import is_slow, spawning_functions, starts_training

REPO_ROOT = Path(__file__).resolve().parents[2]
pytest_plugins = ["pytester"]

SOURCE = """
import subprocess, sys
from fixtures import run_python

def _cli(*args):
    return subprocess.run([sys.executable, *args])

def _wrapper():
    return _cli("x")

@pytest.fixture
def launched():
    return _wrapper()

def test_unit():
    assert 1 + 1 == 2

def test_via_helper():
    _wrapper()

def test_fresh_process(tmp_path):
    run_python("print(1)", [], tmp_path, {})

def test_uses_fixture(launched):
    pass
"""


def test_spawning_functions_follow_helpers_transitively():
    assert spawning_functions(SOURCE) == {
        "_cli",
        "_wrapper",
        "launched",
        "test_via_helper",
        "test_fresh_process",
    }


def test_is_slow_by_process_fixture_module_and_name():
    spawning = spawning_functions(SOURCE)
    assert not is_slow("test_x", "test_unit", {"tmp_path"}, spawning)
    assert is_slow("test_x", "test_via_helper", set(), spawning)
    assert is_slow("test_x", "test_uses_fixture", {"launched", "tmp_path"}, spawning)
    assert is_slow("test_compile", "test_unit", set(), set())
    assert is_slow("test_train_reid", "test_anything", {"run"}, set())
    assert not is_slow("test_other", "test_anything", {"run"}, set())
    assert is_slow("test_evaluate", "test_cli_writes_json_grid_and_is_deterministic", set(), set())


def test_helpers_imported_from_the_shared_fixtures_are_followed():
    source = (
        "from fixtures import run_train, records\n\n"
        "def test_trains(tmp_path):\n    run_train(tmp_path, 'a', {})\n\n"
        "def test_reads(tmp_path):\n    records(tmp_path)\n"
    )
    assert spawning_functions(source) == {"test_trains"}


def test_no_test_module_imports_another():
    """Shared helpers live in fixtures.py (or, as fixtures, conftest.py), never in a test module."""
    import ast

    modules = {path.stem for path in (REPO_ROOT / "tests").rglob("test_*.py")}
    found = []
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [
                f"{path.relative_to(REPO_ROOT)} imports {n}" for n in names if n.split(".")[-1] in modules
            ]
    assert found == []


UNMARKED = """
import subprocess, sys

import pytest


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_starts_a_marked_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unit():
    assert True
"""


@pytest.mark.slow
def test_an_unmarked_process_starting_test_fails_and_is_not_marked(pytester):
    """The check fails the test that lacks its mark (the fast tier runs it and fails), and adds no mark."""
    pytester.makeconftest((REPO_ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(fixtures=(REPO_ROOT / "tests" / "fixtures.py").read_text(), test_spawns=UNMARKED)
    fast = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "not slow")
    fast.assert_outcomes(passed=1, errors=1)  # failed in its setup: nothing of it runs
    assert "test_starts_a_process starts a process" in fast.stdout.str()
    assert "is not marked @pytest.mark.slow" in fast.stdout.str()
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "slow").assert_outcomes(passed=1)


def test_fast_tier_guard_recognises_trainings_and_launchers():
    python = "/venv/bin/python3"
    assert starts_training([python, str(REPO_ROOT / "training" / "train.py"), "--help"])
    assert starts_training([python, "-m", "training.train_reid"]) and starts_training(
        ["/venv/bin/accelerate"]
    )
    assert starts_training("torchrun") and not starts_training([python, "-c", "print(1)"])
    assert not starts_training(["git", "status"])


FILES = [
    "models/test_hf_common_suite.py",
    "models/test_save_load.py",
    "hub/test_hub.py",
    "engine/test_tiers.py",
    "e2e/test_imports.py",
]


def _collected(marker: str) -> set[str]:
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker, *(f"tests/{f}" for f in FILES)]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,  # collection imports torch and transformers: minutes on a loaded 2-core machine
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {line for line in result.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_tiers_split_the_suite():
    """Collected by the real command line: fresh-process and end-to-end tests are slow, unit tests fast."""
    slow, fast = _collected("slow"), _collected("not slow")
    assert not slow & fast and len(fast) > 20
    for test in (
        "tests/models/test_hf_common_suite.py::test_transformers_common_model_suite",
        "tests/models/test_save_load.py::test_fresh_process_trust_remote_code_without_package",
        "tests/hub/test_hub.py::test_push_then_pull_round_trip_on_a_fake_hub",
        "tests/engine/test_tiers.py::test_tiers_split_the_suite",
    ):
        assert test in slow, test
    for test in (
        "tests/engine/test_tiers.py::test_spawning_functions_follow_helpers_transitively",
        "tests/models/test_hf_common_suite.py::test_parse_summary",
        "tests/e2e/test_imports.py::test_no_import_cycles",
    ):
        assert test in fast, test
