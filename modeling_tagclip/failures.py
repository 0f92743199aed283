"""Storage failures as one line: a full disk, a read-only or unwritable destination, a database or safetensors
write error is reported as ``PROG: error: <path>: <cause>`` with a non-zero exit status, never a traceback."""

from __future__ import annotations

__all__ = ["describe", "storage_errors"]


def storage_errors() -> tuple[type[BaseException], ...]:
    """The exception types of a failed read or write of a file, a SQLite database or a safetensors file."""
    import sqlite3

    from safetensors import SafetensorError

    return (OSError, sqlite3.Error, SafetensorError)


def describe(error: BaseException) -> str:
    """One line naming the path and the cause: ``/out/x.json: No space left on device``."""
    if isinstance(error, OSError) and error.strerror:
        paths = [str(p) for p in (error.filename, error.filename2) if p is not None]
        return f"{' -> '.join(paths)}: {error.strerror}" if paths else error.strerror
    return " ".join(str(error).split()) or type(error).__name__
