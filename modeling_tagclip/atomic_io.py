"""Atomic file writes: a crash or a full disk mid-write leaves the old file or the new one, never a truncated
part. ``retrieval/index_store.py`` (shipped to the Hub as custom code, so self-contained) carries a generated
copy of this module's code (``python utils/fix_copies.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "write_json", "write_results"]


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a part."""
    _atomic_file(path, lambda tmp: tmp.write_bytes(data))


def _atomic_file(path: Path, write: Any) -> None:
    """``write(tmp)`` a temporary sibling, fsync it, rename it over ``path`` and fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_json(path: Path, obj: Any, indent: int = 1, default: Any = None, allow_nan: bool = False) -> None:
    """``obj`` as JSON at ``path``, atomically (``default``, ``allow_nan``: as ``json.dumps``)."""
    atomic_write(Path(path), json.dumps(obj, indent=indent, default=default, allow_nan=allow_nan).encode())


def write_results(path: str | os.PathLike, obj: Any) -> None:
    """An evaluator's ``--output``: ``obj`` as indented JSON (NaN allowed), its folder created; an OSError says
    that the metrics were printed before (callers print them first, so a bad path loses nothing)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(path), obj, indent=2, allow_nan=True)
    except OSError as error:
        raise OSError(f"cannot write --output {path} ({error}); the metrics are printed above") from error
