"""A published figure names the code and the machine state it measured: no results file of a changed tree in
benchmarks/results/ unless asked for, and the rendered line says when it was (or when the machine was busy)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import common, render
from benchmarks.common import ALLOW_DIRTY, RESULTS_DIR, add_run_args, check_publishable, write_json


@pytest.fixture(autouse=True)
def no_allow_dirty(monkeypatch):
    monkeypatch.setenv(ALLOW_DIRTY, "0")  # recorded, so what --allow-dirty sets is undone after the test


def test_a_changed_tree_is_not_published(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "git_commit", lambda: "a" * 40 + "+dirty")
    target = RESULTS_DIR / "never_written.json"
    with pytest.raises(SystemExit, match="uncommitted changes.*--allow-dirty"):
        write_json(target, {"rows": [1]})
    assert not target.exists()
    assert write_json(tmp_path / "scratch.json", {"rows": [1]}).is_file()  # a scratch path is fine


def test_a_committed_tree_is_published(monkeypatch):
    check_publishable(RESULTS_DIR / "x.json", commit="b" * 40)  # no exception


def test_allow_dirty_flag_publishes_a_changed_tree(monkeypatch):
    parser = __import__("argparse").ArgumentParser()
    add_run_args(parser)
    assert parser.parse_args([]).allow_dirty is False and os.environ[ALLOW_DIRTY] == "0"
    assert parser.parse_args(["--allow-dirty"]).allow_dirty is True
    check_publishable(RESULTS_DIR / "x.json", commit="c" * 40 + "+dirty")  # allowed now


def record(commit: str, load: float) -> dict:
    return {
        "command": "python benchmarks/x.py",
        "commit": commit,
        "date": "2026-11-28T00:00:00+00:00",
        "cpu": {"model": "CPU", "flags": ["avx2"], "logical_cpus": 2},
        "torch_threads": 1,
        "load_average": [load, load, load],
    }


def test_the_figure_line_marks_a_changed_tree_and_a_busy_machine():
    clean = render.record_line(record("d" * 40, 0.5))
    assert "at commit dddddddddddd on" in clean and "busy" not in clean
    dirty = render.record_line(record("e" * 40 + "+dirty", 7.5))
    assert "eeeeeeeeeeee with uncommitted changes" in dirty
    assert "load average 7.50 (a busy machine: timings are pessimistic)" in dirty
