"""One number per measurement across the docs: a query latency of one backend, index and gallery size (and
filter) appears in one figure only, or with the same value wherever it appears; no latency is typed outside a
figure."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGION = re.compile(r"<!-- figure: ([\w-]+) -->\n(.*?)<!-- /figure -->", re.DOTALL)
LATENCY = re.compile(r"\bms\b.*/\s*query|ms / query")
IDENTITY = ("filter", "kept", "batch", "threads", "store", "calibrated")  # columns of another measurement
TYPED = re.compile(r"\b\d[\d.,]*\s?(ms|µs)\b")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def canonical(cells: dict[str, str]) -> str | None:
    """The measured thing of a table row: the embedded index (exact or the `ivf` preset) or a Milvus index."""
    method, backend, index = cells.get("method"), cells.get("backend"), cells.get("index")
    if method == "exact":
        return "embedded exact"
    if method in ("ann_combined", "ivf"):
        return "embedded ivf"
    if method and method.startswith("ann_"):
        return f"embedded {method}"
    if backend and index:
        return f"{backend} {index}"
    return None


def rows(body: str) -> list[dict[str, str]]:
    """The rows of the markdown table(s) in a figure region, as {header: cell}."""
    lines = [line for line in body.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        return []
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=False)) for line in lines[2:]
    ]


def latencies(text: str, where: str) -> list[tuple[tuple, str, str]]:
    """(measurement key, value, where) of every latency cell in the figure regions of a page."""
    out = []
    for name, body in REGION.findall(text):
        for cells in rows(body):
            thing = canonical(cells)
            size = next((v for h, v in cells.items() if "crops" in h or h == "images"), None)
            if thing is None or size is None:
                continue
            extra = tuple((h, v) for h, v in cells.items() if any(word in h for word in IDENTITY))
            for header, value in cells.items():
                if LATENCY.search(header) and value not in ("", "-"):
                    out.append(((thing, size, extra), value, f"{where} (figure {name}, column {header!r})"))
    return out


def conflicts(found: list[tuple[tuple, str, str]]) -> list[str]:
    """One line per measurement given two different numbers."""
    seen: dict[tuple, tuple[str, str]] = {}
    lines = []
    for key, value, where in found:
        if key in seen and seen[key][0] != value:
            lines.append(
                f"{key[0]} at {key[1]} crops {dict(key[2])}: {seen[key][0]} in {seen[key][1]}, "
                f"{value} in {where}"
            )
        seen.setdefault(key, (value, where))
    return lines


def test_the_checker_catches_two_numbers_for_one_measurement():
    search = (
        "<!-- figure: search -->\n| gallery crops | method | ms / query |\n| ---: | --- | ---: |\n"
        "| 100,000 | ann_combined | 6.94 |\n<!-- /figure -->\n"
    )
    milvus = (
        "<!-- figure: milvus -->\n| gallery crops | backend | index | CPU ms / query |\n| --- | --- | --- | --- |\n"
        "| 100,000 | embedded | ivf | 3.9 |\n| 100,000 | milvus-lite | flat | 585.3 |\n<!-- /figure -->\n"
    )
    found = latencies(search, "search.md") + latencies(milvus, "milvus.md")
    assert len(found) == 3
    (line,) = conflicts(found)
    assert "embedded ivf at 100,000 crops" in line and "6.94" in line and "3.9" in line
    assert not conflicts(
        latencies(search, "search.md") + latencies(search, "performance.md")
    )  # same figure twice


def test_every_latency_in_the_docs_has_one_number():
    found = [
        item for page in pages() for item in latencies(page.read_text(), page.relative_to(ROOT).as_posix())
    ]
    assert found  # the search and Milvus figures are read
    assert not conflicts(found), "\n".join(conflicts(found))


def test_no_latency_is_typed_outside_a_figure():
    typed = [
        f"{page.relative_to(ROOT)}: {m.group(0)}"
        for page in pages()
        for m in TYPED.finditer(REGION.sub("", page.read_text()))
    ]
    assert not typed, typed
