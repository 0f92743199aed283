"""Atomic file writes and checksums: a crash or a full disk mid-write leaves the old file or the new one, never a
truncated part, and a writer only ever replaces a regular file (a symlink is written through to its target).
``retrieval/embedded/index_store.py`` (shipped to the Hub as custom code, so self-contained) carries a generated copy of
this module's code (``python utils/fix_copies.py``)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "NotRegularFileError",
    "atomic_write",
    "regular_target",
    "output_folder",
    "sha256_file",
    "write_json",
    "write_results",
    "write_with",
]

KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


class NotRegularFileError(OSError):
    """An output path that names something other than a regular file (a device, a FIFO, a directory...)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def regular_target(path: Path) -> Path:
    """The file a write to ``path`` replaces: ``path``, or the end of its symlink chain (written through); a
    ``NotRegularFileError`` when that is anything but a regular file or a new name in an existing folder."""
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not target.parent.is_dir():
            raise FileNotFoundError(f"cannot write {path}: no folder {target.parent}") from None
        return target
    if not stat.S_ISREG(mode):
        kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
        via = f" (a symlink to {target})" if os.path.islink(path) else ""
        raise NotRegularFileError(f"refusing to replace {path}{via}: it is {kind}, not a regular file")
    return target


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a part."""
    _atomic_file(path, lambda tmp: tmp.write_bytes(data))


def _atomic_file(path: Path, write: Any) -> None:
    """``write(tmp)`` a new temporary sibling of ``path``'s regular target, fsync it, rename it over the target and
    fsync the folder; the temporary file is removed on any error."""
    target = regular_target(Path(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        os.close(
            os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        )  # new, with the umask's permissions
        try:
            write(tmp)
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as error:  # name the file the user asked for, not the temporary one
        if not error.strerror:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_with(path: str | os.PathLike, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` (e.g. ``lambda tmp: image.save(tmp, format="PNG")``), then put it at ``path`` atomically."""
    _atomic_file(Path(path), write)


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


def output_folder(path: str | os.PathLike) -> Path:
    """``path`` as an output folder: new, or an existing directory (a symlink to one included); anything else
    there (a file, a device such as /dev/null, a FIFO) is a ``NotRegularFileError`` naming what it is."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return Path(path)
    if not stat.S_ISDIR(mode):
        kind = KINDS.get(stat.S_IFMT(mode), "a regular file" if stat.S_ISREG(mode) else "not a folder")
        raise NotRegularFileError(f"{path} is {kind}, not a folder: name a new or an existing folder")
    return Path(path)
