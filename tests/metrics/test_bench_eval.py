"""benchmarks/bench_eval.py runs end to end with --quick: the old and new evaluators agree, memory is measured."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import bench_eval  # noqa: E402


@pytest.mark.slow  # measures peak memory in a fresh process
@pytest.mark.timeout(300)
def test_bench_eval_quick(tmp_path):
    out = tmp_path / "eval.json"
    bench_eval.main(["--quick", "--threads", "1", "--output", str(out)])
    rows = json.loads(out.read_text())["rows"]
    timing, memory = rows
    assert timing["max_abs_diff"] < 1e-9  # same numbers as the full-matrix argsort evaluator
    assert 0 < timing["R@1"] < 100
    assert memory["measure"] == "peak memory" and memory["peak_beyond_embeddings_mib"] > 0
