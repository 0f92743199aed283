"""On-disk layout of a gallery index: header, manifest of immutable segments, SQLite crop metadata.

An index directory holds

- ``index.json``: the header (format, model fingerprint, image root, storage dtype, ANN settings), small and
  rewritten only when the first build finishes;
- ``manifest.json``: the committed state, replaced atomically: the segment files in row order with their row
  counts and SHA-256 checksums (verified on load and on resume), and ``num_rows``;
- ``segments/seg_<start>.safetensors``: immutable rows ``global``, ``local`` (TSE) and ``view_probs``, plus
  ``seg_<start>.faiss`` with an approximate index when one was asked for (``seg_<start>.ivf<lists>.faiss``
  once ``--add`` has outgrown and retrained the quantizer, ``ann_trained[.ivf<lists>].faiss``);
- ``gallery.sqlite``: one row per crop keyed by its row id (= its faiss id): path relative to the image root,
  view, camera, timestamp (UTC seconds), free-form tags (JSON) and a ``removed`` flag (SQLite WAL mode);
- ``build/``: an unfinished build or ``--add`` (the pending path list, written once, and one checksummed
  shard per ``shard_size`` images), absent once committed.

A reader takes ``manifest.json`` and the crop rows with ``id < num_rows``: an add in progress (new segment
files, new SQLite rows, then the manifest) is invisible until its manifest replace, and an interrupted add
leaves the previous state usable.

Hub custom-code compatible: only the standard library, torch and safetensors are imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "GalleryIndexError",
    "SearchFilter",
    "open_db",
    "parse_time",
    "read_header",
    "read_manifest",
]

INDEX_FORMAT = "tagclip-gallery-index"
INDEX_VERSION = 2
VIEW_NAMES = ("aerial", "ground")
HEADER, MANIFEST, DATABASE = "index.json", "manifest.json", "gallery.sqlite"


class GalleryIndexError(ValueError):
    """A missing, incomplete, corrupt or mismatched gallery index."""


# ---------------------------------------------------------------------------------------------------------
# Atomic, checksummed files
# ---------------------------------------------------------------------------------------------------------


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Copied from modeling_tagclip.atomic_io.KINDS
KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


# Copied from modeling_tagclip.atomic_io.NotRegularFileError
class NotRegularFileError(OSError):
    """An output path that names something other than a regular file (a device, a FIFO, a directory...)."""


# Copied from modeling_tagclip.atomic_io.sha256_file
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# Copied from modeling_tagclip.atomic_io.regular_target
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


# Copied from modeling_tagclip.atomic_io.atomic_write
def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a part."""
    _atomic_file(path, lambda tmp: tmp.write_bytes(data))


# Copied from modeling_tagclip.atomic_io._atomic_file
def _atomic_file(path: Path, write: Any) -> None:
    """``write(tmp)`` a new temporary sibling of ``path``'s regular target, fsync it, rename it over the target and
    fsync the folder; the temporary file is removed on any error."""
    target = regular_target(Path(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # new, with the umask's permissions
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# Copied from modeling_tagclip.atomic_io.write_json
def write_json(path: Path, obj: Any, indent: int = 1, default: Any = None, allow_nan: bool = False) -> None:
    """``obj`` as JSON at ``path``, atomically (``default``, ``allow_nan``: as ``json.dumps``)."""
    atomic_write(Path(path), json.dumps(obj, indent=indent, default=default, allow_nan=allow_nan).encode())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Atomically save ``tensors`` (safetensors, streamed to the file: no in-memory copy); returns
    ``{"rows", "sha256"}`` for a manifest entry."""
    _atomic_file(
        path, lambda tmp: save_file({key: value.contiguous() for key, value in tensors.items()}, tmp)
    )
    return {"rows": int(next(iter(tensors.values())).shape[0]), "sha256": sha256_file(path)}


def read_tensors(path: Path, sha256: str, rows: int) -> dict[str, torch.Tensor]:
    """Load a safetensors file checked against its manifest entry (checksum, row count), reading it once into
    its tensors while hashing it: the file's bytes are never held beside the tensors (1x the store in memory,
    not 2x) and no check-then-load window exists."""
    try:
        tensors = _read_hashed(path, sha256)
    except OSError as error:
        raise GalleryIndexError(f"gallery index file {path} is missing or unreadable: {error}") from error
    if any(value.shape[0] != rows for value in tensors.values()):
        raise GalleryIndexError(f"gallery index file {path} does not hold the {rows} rows its manifest says")
    return tensors


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def _read_hashed(path: Path, sha256: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, each read straight into its own buffer; GalleryIndexError when the
    header is malformed or the SHA-256 of the whole file differs from ``sha256``."""
    corrupt = GalleryIndexError(f"gallery index file {path} is corrupt (checksum mismatch)")
    digest, tensors = hashlib.sha256(), {}
    with open(path, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        try:
            head = handle.read(8)
            header_bytes = handle.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
            header = json.loads(header_bytes)
            header.pop("__metadata__", None)
            entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, MemoryError, OverflowError):
            raise corrupt from None
        digest.update(head + header_bytes)
        data_start = 8 + len(header_bytes)
        for name, info in entries:
            tensor = _read_entry(handle, info, data_start, file_size, corrupt)
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
            tensors[name] = tensor
        for block in iter(lambda: handle.read(1 << 22), b""):  # trailing bytes count in the checksum too
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise corrupt
    return tensors


def _read_entry(handle: Any, info: Any, data_start: int, file_size: int, corrupt: Exception) -> torch.Tensor:
    """One tensor of a safetensors header entry, read in place (its extent checked before allocating)."""
    try:
        dtype, shape, (begin, end) = (
            _SAFETENSORS_DTYPES[info["dtype"]],
            [int(n) for n in info["shape"]],
            info["data_offsets"],
        )
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    except (KeyError, TypeError, ValueError):
        raise corrupt from None
    if (
        min(shape, default=0) < 0
        or end - begin != nbytes
        or handle.tell() != data_start + begin
        or data_start + end > file_size
    ):
        raise corrupt
    tensor = torch.empty(shape, dtype=dtype)
    if nbytes and handle.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != nbytes:
        raise corrupt
    return tensor


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GalleryIndexError(f"corrupt gallery index {what} {path}: {error}") from error
    if not isinstance(value, dict):
        raise GalleryIndexError(f"corrupt gallery index {what} {path}: not a JSON object")
    return value


def read_header(path: str | os.PathLike) -> dict:
    """``index.json`` of an index directory, with clear errors for a missing, corrupt or foreign file."""
    path = Path(path)
    if not (path / HEADER).is_file():
        raise GalleryIndexError(
            f"no gallery index at {path} (index.json not found); build one with "
            f"`tagclip index --model MODEL --images DIR --out {path}`"
        )
    header = _read_json(path / HEADER, "header")
    if header.get("format") != INDEX_FORMAT or header.get("version") != INDEX_VERSION:
        raise GalleryIndexError(
            f"{path / HEADER} is not a {INDEX_FORMAT} v{INDEX_VERSION} file (format {header.get('format')!r}, "
            f"version {header.get('version')!r}); rebuild it with `tagclip index ... --overwrite`"
        )
    return header


def read_manifest(path: Path) -> dict | None:
    """The committed manifest, or None before the first build finished."""
    if not (path / MANIFEST).is_file():
        return None
    manifest = _read_json(path / MANIFEST, "manifest")
    segments, start = manifest.get("segments"), 0
    if not isinstance(segments, list):
        raise GalleryIndexError(f"corrupt gallery index manifest {path / MANIFEST}: no segment list")
    for segment in segments:
        if segment.get("start") != start or not isinstance(segment.get("rows"), int):
            raise GalleryIndexError(
                f"corrupt gallery index manifest {path / MANIFEST}: segments are not contiguous at row {start}"
            )
        start += segment["rows"]
    if manifest.get("num_rows") != start:
        raise GalleryIndexError(f"corrupt gallery index manifest {path / MANIFEST}: row count mismatch")
    return manifest


def safe_relative(rel: str, where: str) -> str:
    """``rel`` if it is a relative POSIX path that stays inside its root, else ``GalleryIndexError``."""
    pure = PurePosixPath(rel)
    if not rel or pure.is_absolute() or ".." in pure.parts or "\n" in rel or "\\" in rel:
        raise GalleryIndexError(f"{where}: image path {rel!r} leaves the image root (absolute or '..')")
    return rel


# ---------------------------------------------------------------------------------------------------------
# Crop metadata (SQLite)
# ---------------------------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS crops (
    id INTEGER PRIMARY KEY,            -- row of the embeddings = faiss id
    path TEXT NOT NULL UNIQUE,         -- relative to the image root
    view TEXT,                         -- 'aerial' / 'ground': the sidecar's, else the router's prediction
    camera TEXT,
    timestamp REAL,                    -- UTC seconds since the epoch
    tags TEXT,                         -- JSON list of strings
    removed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS crops_camera ON crops(camera);
CREATE INDEX IF NOT EXISTS crops_timestamp ON crops(timestamp);
CREATE INDEX IF NOT EXISTS crops_removed ON crops(removed);
"""


def open_db(path: Path | str) -> sqlite3.Connection:
    """Open (creating if needed) a crop database; WAL journal so readers never block on a writer."""
    db = sqlite3.connect(str(path), timeout=60, check_same_thread=False, isolation_level=None)
    if str(path) != ":memory:":
        db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(_SCHEMA)
    return db


def parse_time(value: Any, where: str = "timestamp") -> float | None:
    """UTC seconds from epoch seconds or an ISO 8601 string (naive = UTC); None for empty."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
            except ValueError as error:
                raise ValueError(
                    f"{where}: {value!r} is neither epoch seconds nor an ISO 8601 time"
                ) from error
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            seconds = moment.timestamp()
    if not math.isfinite(seconds):
        raise ValueError(f"{where}: {value!r} is not a finite time")
    return seconds


def _tags(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = [t.strip() for t in value.replace("|", ";").split(";") if t.strip()]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{where}: tags must be a list of strings or 'a;b;c', got {value!r}")
    return json.dumps(value)


def metadata_row(rel: str, record: dict | None, predicted_view: str | None) -> tuple:
    """(path, view, camera, timestamp, tags) of one crop from its sidecar record (validated)."""
    record = record or {}
    where = f"metadata of {rel}"
    view = record.get("view") or predicted_view
    if isinstance(view, str):
        view = view.strip().lower()
    if view not in (None, *VIEW_NAMES):
        raise ValueError(f"{where}: view must be 'aerial' or 'ground', got {record.get('view')!r}")
    camera = record.get("camera")
    camera = None if camera in (None, "") else str(camera).strip()
    return rel, view, camera, parse_time(record.get("timestamp"), where), _tags(record.get("tags"), where)


def insert_crops(db: sqlite3.Connection, start: int, rows: Sequence[tuple]) -> None:
    """Insert crops with ids ``start..``; rows a crashed earlier attempt left at ids >= start are replaced."""
    with _transaction(db):
        db.execute("DELETE FROM crops WHERE id >= ?", (start,))
        db.executemany(
            "INSERT INTO crops(id, path, view, camera, timestamp, tags) VALUES (?, ?, ?, ?, ?, ?)",
            ((start + i, *row) for i, row in enumerate(rows)),
        )


class _transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, *_):
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def mark_removed(db: sqlite3.Connection, paths: Iterable[str] = (), ids: Iterable[int] = ()) -> int:
    """Flag crops (by relative path or id) as removed; returns how many were newly removed."""
    with _transaction(db):
        before = db.total_changes
        db.executemany("UPDATE crops SET removed = 1 WHERE path = ? AND removed = 0", ((p,) for p in paths))
        db.executemany("UPDATE crops SET removed = 1 WHERE id = ? AND removed = 0", ((int(i),) for i in ids))
        return db.total_changes - before


@dataclass(frozen=True)
class SearchFilter:
    """Which crops a search may return: view, camera(s), time window [after, before), tag."""

    view: str | None = None
    camera: str | Sequence[str] | None = None
    after: float | str | None = None
    before: float | str | None = None
    tag: str | None = None

    def __post_init__(self):
        _check_filter_types(self)
        if self.view is not None and self.view not in VIEW_NAMES:
            raise ValueError(f"view filter must be 'aerial' or 'ground', got {self.view!r}")
        after, before = parse_time(self.after, "after"), parse_time(self.before, "before")
        if after is not None and before is not None and after >= before:
            raise ValueError(f"empty time window: after {self.after!r} is not before {self.before!r}")

    @classmethod
    def of(cls, value: SearchFilter | dict | None) -> SearchFilter | None:
        if value is None or isinstance(value, SearchFilter):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"filters must be a dict or SearchFilter, got {type(value).__name__}")
        unknown = set(value) - {"view", "camera", "after", "before", "tag"}
        if unknown:
            raise ValueError(
                f"unknown search filter(s) {sorted(unknown)}: use view, camera, after, before, tag"
            )
        return cls(**value)

    def where(self) -> tuple[str, list]:
        """SQL condition and its parameters."""
        terms, params = [], []
        if self.view is not None:
            terms.append("view = ?")
            params.append(self.view)
        if self.camera is not None:
            cams = [self.camera] if isinstance(self.camera, (str, int)) else list(self.camera)
            terms.append(f"camera IN ({', '.join('?' * len(cams))})")
            params.extend(str(c) for c in cams)
        if self.after is not None:
            terms.append("timestamp >= ?")
            params.append(parse_time(self.after))
        if self.before is not None:
            terms.append("timestamp < ?")
            params.append(parse_time(self.before))
        if self.tag is not None:
            terms.append("EXISTS (SELECT 1 FROM json_each(crops.tags) WHERE json_each.value = ?)")
            params.append(self.tag)
        return " AND ".join(terms) or "1", params


def _check_filter_types(f: SearchFilter) -> None:
    """Filter values of the wrong type are errors (never a silently empty result or an SQL error)."""
    for name in ("view", "tag"):
        value = getattr(f, name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} filter must be a string, got {type(value).__name__} {value!r:.60}")
    cams = [f.camera] if isinstance(f.camera, (str, int)) else f.camera
    if cams is not None and (
        not isinstance(cams, (list, tuple))
        or not cams
        or any(isinstance(c, bool) or not isinstance(c, (str, int)) for c in cams)
    ):
        raise ValueError(f"camera filter must be a camera id or a non-empty list of them, got {f.camera!r:.60}")


def allowed_mask(
    db: sqlite3.Connection, size: int, search_filter: SearchFilter | None
) -> torch.Tensor | None:
    """Bool [size] of searchable rows (not removed, matching the filter); None when every row is."""
    if search_filter is None:
        removed = [r for (r,) in db.execute("SELECT id FROM crops WHERE removed = 1 AND id < ?", (size,))]
        if not removed:
            return None
        mask = torch.ones(size, dtype=torch.bool)
        mask[torch.tensor(removed, dtype=torch.long)] = False
        return mask
    where, params = search_filter.where()
    sql = f"SELECT id FROM crops WHERE removed = 0 AND id < ? AND {where}"
    ids = [r for (r,) in db.execute(sql, [size, *params])]
    mask = torch.zeros(size, dtype=torch.bool)
    if ids:
        mask[torch.tensor(ids, dtype=torch.long)] = True
    return mask
