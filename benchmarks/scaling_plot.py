"""Latency and memory against gallery size, log-log, in one SVG (written by hand: no plotting library, so the
same results files always give the same bytes).

Left panel: ms per query (one thread, batch 1) of the project's ``ivf`` preset (the search figure's files),
plain faiss IVF-Flat and HNSW32 (``bench_baselines.py``) and Milvus Lite (``bench_milvus.py``). Right panel:
the resident memory serving adds (``bench_serving.py`` for the project: fp16 read, fp16 mapped and int8;
``bench_baselines.py`` for faiss), and the memory model (``memory_model.py``) extrapolated to 10M crops for the
fp16 store read, mapped (its anonymous memory: the store's pages are file-backed) and int8. A series whose file
is missing, or has no machine record, is left out and named "Not measured" under the picture.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import memory_model as mm
from benchmarks.render import has_record, record_line

Source = tuple[str, str]  # (results file relative to the repository root, the command that writes it)
BASELINES: Source = (
    "benchmarks/results/baselines_cpu.json",
    "python benchmarks/bench_baselines.py --sizes 10000 30000 100000",
)
STORE_MODES: Source = (
    f"benchmarks/results/{mm.MODES_FILE}",
    "python benchmarks/bench_serving.py --generate 100000:fp16 100000:int8 300000:fp16 300000:int8 "
    f"--load mapped read --output benchmarks/results/{mm.MODES_FILE}",
)
MODEL_SIZES = tuple(10 ** (4 + i / 4) for i in range(13))  # 10k .. 10M, four points a decade
MODEL_MODES = (("fp16", False), ("fp16", True), ("int8", False))
TARGET_GIB = 32
COLORS = {
    "fp16 read": "#1f77b4",
    "fp16 mapped": "#17becf",
    "int8": "#9467bd",
    "faiss IVF-Flat": "#ff7f0e",
    "faiss HNSW32": "#2ca02c",
    "flat": "#d62728",
    "hnsw": "#8c564b",
    "ivf_sq8": "#e377c2",
    "ivf_flat": "#7f7f7f",
}
WIDTH, LEFT, PANEL_W, GAP, TOP, PANEL_H, ROW_H = 1020, 90, 380, 130, 50, 300, 20


@dataclass(frozen=True)
class Series:
    """One line of a panel: (N, value) points drawn with markers, or a dashed line without (``model``)."""

    label: str
    color: str
    points: tuple[tuple[float, float], ...]
    model: bool = False


@dataclass
class Collected:
    """The series of both panels, the "Not measured" lines and the machine records of the files drawn."""

    latency: list[Series] = field(default_factory=list)
    memory: list[Series] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Axis:
    """A log10 axis: decades ``lo``..``hi`` onto pixels ``start``..``end``."""

    lo: int
    hi: int
    start: float
    end: float

    def at(self, value: float) -> float:
        return self.start + (math.log10(value) - self.lo) / (self.hi - self.lo) * (self.end - self.start)


def decades(values: Sequence[float]) -> tuple[int, int]:
    """The whole decades that hold ``values`` (at least one decade)."""
    lo = math.floor(math.log10(min(values)))
    return lo, max(lo + 1, math.ceil(math.log10(max(values))))


def read(source: Source, root: Path, found: Collected) -> dict[str, Any] | None:
    """A results file with its machine record (its record line noted), else None (its "Not measured" noted)."""
    relative, command = source
    path = root / relative
    data = json.loads(path.read_text()) if path.is_file() else None
    if data is None or not has_record(data):
        why = "" if data is None else " (The file there has no machine record.)"
        found.missing.append(f"Not measured: `{command}` writes `{relative}`.{why}")
        return None
    line = record_line(data["machine"])
    if line not in found.records:
        found.records.append(line)
    return data


def rows_of(sources: Sequence[Source], root: Path, found: Collected) -> list[dict[str, Any]]:
    return [row for source in sources if (data := read(source, root, found)) for row in data["rows"]]


def is_first_run(row: dict[str, Any]) -> bool:
    """A row of the default generator's seed 0 with an fp16 store: the one run per size the search figure shows
    (a seeds file also holds other seeds and generators, a 1M file an int8 store)."""
    first = row.get("generator", "default") == "default" and row.get("seed", 0) == 0
    return first and row.get("store_dtype", "fp16") == "fp16"


def points(rows: list[dict[str, Any]], key: str) -> tuple[tuple[float, float], ...]:
    """(size, value) sorted by size; the last row of a size wins (a later file re-measures it)."""
    return tuple(sorted({row["size"]: row[key] for row in rows if row.get(key) is not None}.items()))


def add(panel: list[Series], label: str, color: str, pts: tuple[tuple[float, float], ...], **kw) -> None:
    if pts:
        panel.append(Series(label, color, pts, **kw))


def collect(search: Sequence[Source], milvus: Sequence[Source], serving: Sequence[Source], root: Path):
    """Every series of the picture from the results files (paths relative to ``root``)."""
    found = Collected()
    preset = [r for r in rows_of(search, root, found) if r.get("method") == "ann_combined"]
    preset = [r for r in preset if r.get("params", "preset") == "preset" and is_first_run(r)]
    add(found.latency, "project ivf preset", COLORS["fp16 read"], points(preset, "ms_per_query_b1"))
    baselines = rows_of([BASELINES], root, found)
    lite = [r for r in rows_of(milvus, root, found) if r.get("backend") == "milvus-lite"]
    served = rows_of([*serving, STORE_MODES], root, found)
    for name in ("faiss IVF-Flat", "faiss HNSW32"):
        mine = [r for r in baselines if r["index"] == name]
        add(found.latency, name, COLORS[name], points(mine, "ms_per_query_b1"))
        add(found.memory, f"{name}, added RSS", COLORS[name], points(mine, "added_rss_mib"))
    for kind in sorted({r["index"] for r in lite}):
        mine = [r for r in lite if r["index"] == kind]
        add(
            found.latency,
            f"Milvus Lite {kind.upper()}",
            COLORS.get(kind, "#000000"),
            points(mine, "ms_per_query_b1"),
        )
    if lite and not any("added_rss_mib" in r for r in lite):
        found.missing.append("Milvus Lite memory: not measured (`bench_milvus.py` records no memory).")
    for dtype, mapped in MODEL_MODES:
        mode = f"{dtype}{' mapped' if mapped else ' read' if dtype == 'fp16' else ''}"
        mine = [
            {**r, "anon": mm.measured_anon({"mapped": False, **r})}
            for r in served
            if r.get("store_dtype", "fp16") == dtype and r.get("mapped", False) == mapped
        ]
        add(found.memory, f"project {mode}, measured", COLORS[mode], points(mine, "anon"))
        model = tuple((n, mm.predict(round(n), dtype, mapped)["total"] / 2**20) for n in MODEL_SIZES)
        add(found.memory, f"project {mode}, model", COLORS[mode], model, model=True)
    return found


def _num(value: float) -> str:
    return f"{value:.1f}"


def _size_label(n: float) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k" if n >= 1e3 else f"{n:g}"


def panel_svg(
    title: str, unit: str, series: list[Series], x: Axis, left: float, ref: tuple | None
) -> list[str]:
    """One panel: frame, decade grid and labels, the series, and a horizontal reference line (value, label)."""
    if not series:
        return [
            f'<text x="{_num(left + PANEL_W / 2)}" y="{TOP + PANEL_H / 2}" text-anchor="middle">{title}: not measured</text>'
        ]
    values = [v for s in series for _, v in s.points] + ([ref[0]] if ref else [])
    y = Axis(*decades(values), TOP + PANEL_H, TOP)
    out = [
        f'<text x="{_num(left + PANEL_W / 2)}" y="{TOP - 15}" text-anchor="middle" font-weight="bold">{title}</text>'
    ]
    out.append(f'<rect x="{left}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#000"/>')
    for e in range(x.lo, x.hi + 1):
        px = _num(x.at(10**e))
        out.append(f'<line x1="{px}" y1="{TOP}" x2="{px}" y2="{TOP + PANEL_H}" stroke="#ddd"/>')
        out.append(
            f'<text x="{px}" y="{TOP + PANEL_H + 16}" text-anchor="middle">{_size_label(10**e)}</text>'
        )
    for e in range(y.lo, y.hi + 1):
        py = _num(y.at(10**e))
        out.append(f'<line x1="{left}" y1="{py}" x2="{left + PANEL_W}" y2="{py}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py}" text-anchor="end" dy="4">{10**e:,g} {unit}</text>')
    if ref:
        py = _num(y.at(ref[0]))
        out.append(
            f'<line x1="{left}" y1="{py}" x2="{left + PANEL_W}" y2="{py}" stroke="#000" stroke-dasharray="2,3"/>'
        )
        out.append(f'<text x="{left + 4}" y="{py}" dy="-4">{ref[1]}</text>')
    label = f'<text x="{_num(left + PANEL_W / 2)}" y="{TOP + PANEL_H + 36}" text-anchor="middle">gallery crops (N)</text>'
    out.append(label)
    for s in series:
        xy = [(x.at(n), y.at(v)) for n, v in s.points]
        path = " ".join(f"{_num(a)},{_num(b)}" for a, b in xy)
        dash = ' stroke-dasharray="6,4"' if s.model else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="1.5"{dash}/>')
        if not s.model:
            out += [f'<circle cx="{_num(a)}" cy="{_num(b)}" r="3.5" fill="{s.color}"/>' for a, b in xy]
    return out


def legend_svg(series: list[Series], top: float) -> list[str]:
    """Each series once (by label), three to a row."""
    out, seen = [], []
    for s in series:
        if s.label not in [t.label for t in seen]:
            seen.append(s)
    for i, s in enumerate(seen):
        lx, ly = LEFT + (i % 3) * 300, top + (i // 3) * ROW_H
        dash = ' stroke-dasharray="6,4"' if s.model else ""
        out.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 24}" y2="{ly}" stroke="{s.color}" stroke-width="1.5"{dash}/>'
        )
        if not s.model:
            out.append(f'<circle cx="{lx + 12}" cy="{ly}" r="3.5" fill="{s.color}"/>')
        out.append(f'<text x="{lx + 30}" y="{ly}" dy="4">{s.label}</text>')
    return out


def svg(found: Collected) -> str:
    """The picture: latency (left) and memory (right) against N, log-log, sharing one N axis up to 10M."""
    sizes = [n for s in found.latency + found.memory for n, _ in s.points] + [MODEL_SIZES[-1]]
    x_lo, x_hi = decades(sizes)
    left_x = Axis(x_lo, x_hi, LEFT, LEFT + PANEL_W)
    right = LEFT + PANEL_W + GAP
    right_x = Axis(x_lo, x_hi, right, right + PANEL_W)
    legend_top = TOP + PANEL_H + 70
    rows = math.ceil(len({s.label for s in found.latency + found.memory}) / 3)
    height = legend_top + rows * ROW_H + 10
    body = panel_svg("ms / query (1 thread, batch 1)", "ms", found.latency, left_x, LEFT, None)
    target = (TARGET_GIB * 1024, f"{TARGET_GIB} GiB")
    body += panel_svg("resident MiB added by serving", "MiB", found.memory, right_x, right, target)
    body += legend_svg(found.latency + found.memory, legend_top)
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">'
    )
    return "\n".join([head, f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>', *body, "</svg>"]) + "\n"


def markdown(found: Collected, image: str) -> str:
    """The page region: the picture, what it shows, the series not measured and the records of its files."""
    lines = [
        f"![Query latency and serving memory against gallery size, log-log]({image})",
        "",
        "Left: CPU ms per query at batch 1 on one thread; each method at its own operating point (the `ivf` "
        "preset's calibrated settings; faiss IVF-Flat and HNSW32 at the smallest nprobe / efSearch reaching "
        "recall@10 0.95 on held-out queries; Milvus Lite's defaults), the recall of each in its results file. "
        "Right: resident memory a fresh serving process adds (for the project, its anonymous part where "
        "recorded: a mapped store's pages are file-backed and the kernel can drop them), and the memory model "
        f"(`benchmarks/memory_model.py`, dashed) to 10M crops, against {TARGET_GIB} GiB.",
    ]
    if found.missing:
        lines += ["", "\n\n".join(found.missing)]
    lines += ["", "\n\n".join(found.records)] if found.records else []
    return "\n".join(lines) + "\n"
