"""DTG's resumable progress files: ``OUT.partial.jsonl`` (one JSON line per finished item, the first line
the run's settings) and the batching and progress bar of the resumable loops."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)

PROGRESS_VERSION = 1


def chunks(seq: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Consecutive slices of ``seq`` of at most ``size`` (at least 1) items."""
    for start in range(0, len(seq), max(1, size)):
        yield seq[start : start + max(1, size)]


def suffixed(out: Path, suffix: str) -> Path:
    """``OUT`` + ``suffix`` (``train.json`` -> ``train.json.partial.jsonl``)."""
    return out.with_name(out.name + suffix)


def settings_digest(value: Any) -> str:
    """Short stable digest of a JSON-able value (for the progress header)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines of a progress file; a torn (unparsable) line from an interruption is skipped."""
    if not path.exists():
        return []
    rows, torn = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    if torn:
        logger.warning("%s: skipped %d unreadable line(s) (interrupted write)", path, torn)
    return rows


def load_progress(path: Path, settings: dict[str, Any] | None, force: bool) -> list[dict[str, Any]]:
    """Finished rows of a progress file; its settings line must equal ``settings`` unless ``force``."""
    rows = _read_jsonl(path)
    header = next((r["settings"] for r in rows if "settings" in r), None)
    if header is not None and settings is not None and header != settings and not force:
        changed = sorted(k for k in set(header) | set(settings) if header.get(k) != settings.get(k))
        raise ValueError(
            f"{path} was written with other settings ({', '.join(changed)}); delete it to start over "
            "or pass --force-resume to continue anyway"
        )
    return [r for r in rows if "settings" not in r]


def _ends_torn(path: Path) -> bool:
    """Whether a non-empty file lacks a final newline."""
    if not path.exists() or not path.stat().st_size:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def open_progress(path: Path, settings: dict[str, Any] | None) -> Any:
    """Open a progress file for appending; a new file starts with the settings line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = _ends_torn(path)
    handle = open(path, "a", encoding="utf-8")  # closed by the caller's with-block
    if torn:  # end a line cut short by an interruption so the next record starts on its own line
        handle.write("\n")
    if settings is not None and handle.tell() == 0:
        append_rows(handle, [{"settings": settings}])
    return handle


def progress_bar(total: int, remaining: int, desc: str, unit: str, enabled: bool) -> tqdm:
    """A tqdm bar over ``total`` items that starts past the ``total - remaining`` already done."""
    return tqdm(total=total, initial=total - remaining, desc=desc, unit=unit, disable=not enabled)


def append_rows(handle: Any, rows: Iterable[dict[str, Any]]) -> None:
    """Append ``rows`` as JSON lines and flush, so that an interruption loses at most the line being written."""
    for row in rows:
        handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    handle.flush()


def run_in_chunks(
    path: Path,
    settings: dict[str, Any] | None,
    todo: Sequence[Any],
    size: int,
    work: Callable[[Sequence[Any]], list[dict[str, Any]]],
    bar: tuple[int, str, str, bool],
) -> list[dict[str, Any]]:
    """Run ``work`` on consecutive chunks of ``todo`` (``size`` each), appending each chunk's rows to the
    progress file ``path`` as soon as it is done; returns the new rows. ``bar``: (total, description, unit,
    enabled) of the progress bar, which starts past the ``total - len(todo)`` items already done."""
    rows: list[dict[str, Any]] = []
    total, desc, unit, enabled = bar
    try:
        with (
            open_progress(path, settings) as handle,
            progress_bar(total, len(todo), desc, unit, enabled) as shown,
        ):
            for chunk in chunks(todo, size):
                new = work(chunk)
                append_rows(handle, new)
                rows.extend(new)
                shown.update(len(chunk))
    except OSError as error:  # a write to the open file (full disk) names no file: name the progress file
        if error.filename is None and error.strerror:
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    return rows
