"""The latency and memory picture (benchmarks/scaling_plot.py): points at known log-axis coordinates from fixture
results files, missing series named "Not measured", identical bytes on every drawing; and the faiss baselines
script (benchmarks/bench_baselines.py) end to end at a tiny size."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import memory_model as mm
from benchmarks import scaling_plot as sp
from benchmarks.common import machine_record
from benchmarks.render import Picture, stale_pages

SEARCH = [("search.json", "make search")]
MILVUS = [("milvus.json", "make milvus")]
SERVING = [("serving.json", "make serving")]


def _write(root: Path, relative: str, rows: list[dict], record: bool = True) -> None:
    machine = {**machine_record(), "command": f"python make {relative}", "commit": "0123456789abcdef"}
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, **({"machine": machine} if record else {})}))


def _baseline(size, name, ms, mib):
    return {"size": size, "index": name, "ms_per_query_b1": ms, "added_rss_mib": mib, "recall": 0.96}


@pytest.fixture
def root(tmp_path):
    """Search (1 ms at 10k, 10 ms at 100k), faiss (10 and 100 ms; 100 and 1000 MiB), Milvus FLAT (1000 ms at
    100k); no serving files."""
    preset = {"method": "ann_combined", "params": "preset"}
    _write(
        tmp_path,
        "search.json",
        [
            {"size": 10_000, "method": "exact", "ms_per_query_b1": 500.0},
            {"size": 10_000, **preset, "ms_per_query_b1": 1.0},
            {"size": 100_000, **preset, "ms_per_query_b1": 10.0},
            {"size": 100_000, **preset, "params": "tuned", "ms_per_query_b1": 3.0},
        ],
    )
    _write(
        tmp_path,
        sp.BASELINES[0],
        [
            _baseline(10_000, "faiss IVF-Flat", 10.0, 100.0),
            _baseline(100_000, "faiss IVF-Flat", 100.0, 1000.0),
        ]
        + [_baseline(100_000, "faiss HNSW32", 5.0, 1000.0)],
    )
    _write(
        tmp_path,
        "milvus.json",
        [
            {"size": 100_000, "backend": "embedded", "index": "ivf", "ms_per_query_b1": 4.0},
            {"size": 100_000, "backend": "milvus-lite", "index": "flat", "ms_per_query_b1": 1000.0},
        ],
    )
    return tmp_path


def _draw(root: Path) -> tuple[str, str]:
    found = sp.collect(SEARCH, MILVUS, SERVING, root)
    return sp.svg(found), sp.markdown(found, "images/scaling.svg")


def _circle(x: float, y: float, color: str) -> str:
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{color}"/>'


def test_points_sit_at_their_log_coordinates(root):
    svg, _ = _draw(root)
    # N axis: decades 10^4 .. 10^7 (the model runs to 10M) over 380 px; left panel from x=90, right from 600
    x_left = lambda n: 90 + {10_000: 0, 100_000: 1}[n] * 380 / 3  # noqa: E731
    # latency: 1 .. 1000 ms = 3 decades over 300 px, from y=350 up; memory: 1 .. 10^5 MiB (32 GiB inside)
    y_ms = lambda ms: 350 - {1.0: 0, 10.0: 1, 100.0: 2, 1000.0: 3}[ms] * 100  # noqa: E731
    assert _circle(x_left(10_000), y_ms(1.0), sp.COLORS["fp16 read"]) in svg
    assert _circle(x_left(100_000), y_ms(10.0), sp.COLORS["fp16 read"]) in svg  # the preset, not "tuned"
    assert _circle(x_left(100_000), y_ms(100.0), sp.COLORS["faiss IVF-Flat"]) in svg
    assert _circle(x_left(100_000), y_ms(1000.0), sp.COLORS["flat"]) in svg  # Milvus Lite FLAT
    assert _circle(600 + 380 / 3, 350 - 3 * 60, sp.COLORS["faiss IVF-Flat"]) in svg  # 1000 MiB at 100k
    assert (
        svg.count("<circle") == 6 + 3 + 6
    )  # latency points, memory points, a marker per measured legend entry
    assert "Milvus Lite FLAT" in svg and "Milvus Lite IVF" not in svg  # one series each
    model = mm.predict(10_000_000, "int8", False)["total"] / 2**20
    y_model = 350 - math.log10(model) / 5 * 300
    assert f"{600 + 380:.1f},{y_model:.1f}" in svg  # the int8 model's line ends at 10M


def test_missing_series_are_named_not_measured(root):
    svg, text = _draw(root)
    assert "Not measured: `make serving` writes `serving.json`." in text
    assert f"Not measured: `{sp.STORE_MODES[1]}` writes `{sp.STORE_MODES[0]}`." in text
    assert "Milvus Lite memory: not measured" in text and "measured, " not in svg  # no project measurement
    assert "project fp16 mapped, model" in svg and "project int8, model" in svg
    (root / sp.BASELINES[0]).unlink()
    _write(root, "milvus.json", [], record=False)
    svg, text = _draw(root)
    assert f"Not measured: `{sp.BASELINES[1]}` writes `{sp.BASELINES[0]}`." in text
    assert "`make milvus` writes `milvus.json`. (The file there has no machine record.)" in text
    assert "faiss" not in svg and "Milvus" not in svg and "project ivf preset" in svg
    assert text.count("Measured by `python make search.json` at commit 0123456789ab") == 1


def test_the_picture_is_a_fixed_point_of_the_renderer(root):
    (root / "docs").mkdir()
    (root / "README.md").write_text("x\n<!-- figure: scaling -->\nold\n<!-- /figure -->\n")
    figures = {"scaling": Picture("scaling", "docs/images/scaling.svg", _draw)}
    assert stale_pages(figures, root) == [root / "README.md", root / "docs/images/scaling.svg"]
    stale_pages(figures, root, write=True)
    assert (root / "docs/images/scaling.svg").read_text() == _draw(root)[0]
    assert "![Query latency and serving memory" in (root / "README.md").read_text()
    assert stale_pages(figures, root) == []  # drawing again gives the same bytes
    _write(root, "search.json", [{"size": 10_000, "method": "ann_combined", "ms_per_query_b1": 2.0}])
    assert stale_pages(figures, root) == [root / "docs/images/scaling.svg"]  # a new number: a stale picture


@pytest.mark.slow
def test_bench_baselines_quick_reaches_the_target_and_measures_memory(tmp_path):
    from benchmarks import bench_baselines

    assert bench_baselines.faiss is not None, (
        "faiss-cpu is missing: the README's test command installs it (search)"
    )
    out = tmp_path / "baselines.json"
    payload = bench_baselines.main(["--quick", "--output", str(out)])
    rows = {row["index"]: row for row in payload["rows"]}
    assert (
        set(rows) == {"faiss IVF-Flat", "faiss HNSW32"} and json.loads(out.read_text())["machine"]["commit"]
    )
    vector_mib = 4096 * 1536 * 4 / 2**20  # both store the float32 vectors
    for row in rows.values():
        assert row["reached_target"] and row["recall_held_out"] >= 0.95 and row["recall"] > 0.9
        assert row["ms_per_query_b1"] > 0 and vector_mib < row["index_mib"] < 1.3 * vector_mib
        assert 0.8 * row["index_mib"] < row["added_anon_mib"] < 1.3 * row["index_mib"]
