"""Render every published figure from its results file into the pages that show it.

A page shows a figure between two markers::

    <!-- figure: export -->
    ...generated table...
    <!-- /figure -->

`FIGURES` (in `benchmarks/figures.py`) says which results file feeds which figure, its columns and formats.
`python -m benchmarks.render` rewrites the regions of README.md and docs/**/*.md; `--check` changes nothing
and exits 1 naming each page whose regions differ from what their files render. A figure whose results file
is missing, or lacks the machine record (`benchmarks.common.machine_record`), renders as "not measured"
with the command that measures it: a number is never kept without its record. A `Picture` is a figure drawn as
an image file (an SVG written by its own code): the page region gets its markdown, and the image file is
rewritten (or, with `--check`, named stale) like a page.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REGION = re.compile(r"(<!-- figure: ([\w-]+) -->\n)(.*?)(<!-- /figure -->)", re.DOTALL)


@dataclass(frozen=True)
class Column:
    """One table column: `header`, the row `key` and a `str.format` spec (`"{:.2f}"`)."""

    header: str
    key: str
    fmt: str = "{}"
    align: str = "---:"


@dataclass(frozen=True)
class Figure:
    """A table rendered from one results file (`path`, relative to the repository root).

    `rows(data)` gives the table rows (default: `data["rows"]`), `keep(row)` filters them, `note` is printed
    under the table (a callable `note(data)`: made from the results file), `command` measures the file.
    `record=False` for result files whose provenance is their own settings (the ablation studies): the line
    under the table then shows `provenance(data)`. `more` lists further (results file, command) pairs whose
    rows follow in the same table, each with its own record line; `order(row)`, when given, sorts the rows of
    all the files together (a size measured in a later file then takes its place in the table).
    """

    name: str
    path: str
    columns: Sequence[Column]
    command: str
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]] = lambda data: data["rows"]
    keep: Callable[[dict[str, Any]], bool] = lambda row: True
    note: str | Callable[[dict[str, Any]], str] = ""
    record: bool = True
    provenance: Callable[[dict[str, Any]], str] = field(default=lambda data: "")
    more: Sequence[tuple[str, str]] = ()
    order: Callable[[dict[str, Any]], Any] | None = None


@dataclass(frozen=True)
class Picture:
    """A figure drawn as an image: ``draw(root)`` gives (the image file's text, the markdown of its page region)
    from the results files under ``root``; the image is written to ``path`` (relative to the root)."""

    name: str
    path: str
    draw: Callable[[Path], tuple[str, str]]


def is_picture(figure: Figure | Picture) -> bool:
    """Whether a figure is drawn (by its class's shape: ``python -m benchmarks.render`` runs this module as
    ``__main__``, so the figures' ``Picture`` is another class object than this module's)."""
    return hasattr(figure, "draw")


class RenderError(ValueError):
    """A page names an unknown figure, or a results file cannot be read."""


def has_record(data: dict[str, Any]) -> bool:
    """Whether a results file carries the full machine record (commit, date, CPU flags, load average)."""
    machine = data.get("machine")
    return (
        isinstance(machine, dict)
        and isinstance(machine.get("cpu"), dict)
        and all(machine.get(key) for key in ("commit", "date", "command"))
    )


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table(figure: Figure, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| " + " | ".join(c.header for c in figure.columns) + " |",
        "| " + " | ".join(c.align for c in figure.columns) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(c.key), c.fmt) for c in figure.columns) + " |")
    return lines


def record_line(machine: dict[str, Any]) -> str:
    """One line naming how and where a results file was measured."""
    cpu = machine["cpu"]
    flags = ", ".join(cpu.get("flags") or []) or "no flags recorded"
    load = machine.get("load_average")
    busy = load and cpu.get("logical_cpus") and load[0] > cpu["logical_cpus"]
    load_text = f", load average {load[0]:.2f}" if load else ""
    load_text += " (a busy machine: timings are pessimistic)" if busy else ""
    gpu = f"; GPU {machine['gpu']}" if machine.get("gpu") else "; no GPU"
    commit = machine["commit"][:12] + (
        " with uncommitted changes" if machine["commit"].endswith("+dirty") else ""
    )
    return (
        f"Measured by `{machine['command']}` at commit {commit} on {machine['date'][:10]}: "
        f"{cpu.get('model')} ({flags}; {cpu.get('logical_cpus')} logical CPUs), "
        f"{machine.get('torch_threads')} torch thread(s){load_text}{gpu}."
    )


def read_results(figure: Figure, relative: str, command: str, root: Path) -> dict[str, Any] | str:
    """A figure's results file, or the "not measured" line when it is missing or has no machine record."""
    path = root / relative
    missing = f"Not measured: `{command}` writes `{relative}`."
    if not path.is_file():
        return missing
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RenderError(f"figure {figure.name}: cannot read {relative} ({error})") from error
    if figure.record and not has_record(data):
        return missing + " (The file there has no machine record.)"
    return data


def sorted_rows(figure: Figure, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` sorted by the figure's `order` key (a stable sort: equal keys keep their file order)."""
    try:
        return sorted(rows, key=figure.order)
    except (KeyError, TypeError) as error:
        raise RenderError(f"figure {figure.name}: cannot order its rows ({error!r})") from error


def render(figure: Figure, root: Path = ROOT) -> str:
    """The markdown between a figure's markers (ending in a newline)."""
    sources = [(figure.path, figure.command), *figure.more]
    files = {relative: read_results(figure, relative, command, root) for relative, command in sources}
    for result in files.values():
        if isinstance(result, str):
            return result + "\n"
    rows = []
    for relative, data in files.items():
        try:
            rows += [row for row in figure.rows(data) if figure.keep(row)]
        except (KeyError, TypeError, IndexError) as error:
            raise RenderError(f"figure {figure.name}: {relative} lacks the expected field {error}") from error
    if figure.order is not None:
        rows = sorted_rows(figure, rows)
    lines = table(figure, rows) + [""]
    try:
        note = figure.note(files[figure.path]) if callable(figure.note) else figure.note
    except (KeyError, TypeError) as error:
        raise RenderError(
            f"figure {figure.name}: {figure.path} lacks the field its note needs {error}"
        ) from error
    if note:
        lines += [note, ""]
    records = [
        record_line(data["machine"]) if figure.record else figure.provenance(data) for data in files.values()
    ]
    lines.append("\n\n".join(records))
    return "\n".join(lines) + "\n"


def render_page(text: str, figures: dict[str, Figure | Picture], root: Path = ROOT) -> str:
    """`text` with every figure region replaced by its rendering; an unknown name is a RenderError."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in figures:
            raise RenderError(f"unknown figure {name!r} (known: {', '.join(sorted(figures))})")
        figure = figures[name]
        body = figure.draw(root)[1] if is_picture(figure) else render(figure, root)
        return match.group(1) + "\n" + body + "\n" + match.group(4)

    return REGION.sub(replace, text)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def stale_pictures(
    figures: dict[str, Figure | Picture], root: Path = ROOT, write: bool = False
) -> list[Path]:
    """Picture files that differ from their drawing (rewritten when `write`)."""
    from modeling_tagclip.atomic_io import atomic_write

    stale = []
    for picture in (figure for figure in figures.values() if is_picture(figure)):
        target, text = root / picture.path, picture.draw(root)[0]
        if not target.is_file() or target.read_text() != text:
            stale.append(target)
            if write:
                target.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(target, text.encode())
    return stale


def stale_pages(figures: dict[str, Figure | Picture], root: Path = ROOT, write: bool = False) -> list[Path]:
    """Pages whose figure regions differ from their rendering, then picture files that differ from their
    drawing (each rewritten in place when `write`)."""
    from modeling_tagclip.atomic_io import atomic_write

    stale = []
    for page in pages(root):
        text = page.read_text()
        try:
            new = render_page(text, figures, root)
        except RenderError as error:
            raise RenderError(f"{page.relative_to(root)}: {error}") from error
        if new != text:
            stale.append(page)
            if write:
                atomic_write(page, new.encode())
    return stale + stale_pictures(figures, root, write)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the stale pages")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.figures import FIGURES

    try:
        stale = stale_pages(FIGURES, write=not args.check)
    except RenderError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for page in stale:
        verb = "stale (run `python -m benchmarks.render`)" if args.check else "rendered"
        print(f"{page.relative_to(ROOT)}: {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
