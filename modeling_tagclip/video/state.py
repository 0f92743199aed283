"""What ``tagclip ingest`` has committed: ``ingest_state.json`` in the crops folder, rewritten atomically.

``{"format": "tagclip-ingest-state", "version": 1, "sources": {LOCATION: {...}}}`` where each source has its
``fingerprint`` (files: size, mtime_ns and a SHA-256 of the first and last 64 KiB), ``status`` ("done" once its
crops are in the gallery), ``folder`` (its crops, relative to the crops folder), ``tracks``, ``crops``,
``next_track`` (the next track number: a stream's tracks keep counting across runs) and ``gaps`` (a stream's
outages, ``[from, to]`` UTC seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from modeling_tagclip.atomic_io import write_json

from .frames import Source

__all__ = ["KILL_ENV", "KILL_STAGES", "STATE_FILE", "IngestState", "checkpoint", "fingerprint"]

STATE_FILE = "ingest_state.json"
KILL_ENV = "TAGCLIP_INGEST_KILL_AT"  # a test hook: SIGKILL at the stage it names
KILL_STAGES = ("frames", "crops", "move", "manifest", "index", "state")
FORMAT = "tagclip-ingest-state"
EDGE_BYTES = 64 * 1024


def checkpoint(stage: str) -> None:
    """The test hook: SIGKILL this process when ``TAGCLIP_INGEST_KILL_AT`` names ``stage``."""
    if os.environ.get(KILL_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def fingerprint(source: Source) -> dict[str, Any]:
    """Identity of a source's content: size, mtime and the hash of its head and tail bytes (a frame folder:
    its file names and sizes; a stream: its URL)."""
    if source.kind == "stream":
        return {"url": source.location}
    path = Path(source.location)
    if source.kind == "frames":
        digest = hashlib.sha256()
        for file in sorted(path.iterdir()):
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        return {"frames": digest.hexdigest()}
    stat = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        if stat.st_size > EDGE_BYTES:
            handle.seek(max(EDGE_BYTES, stat.st_size - EDGE_BYTES))
            digest.update(handle.read(EDGE_BYTES))
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "edges": digest.hexdigest()}


class IngestState:
    """The state file of one crops folder."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / STATE_FILE
        self.sources: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as error:
                raise ValueError(f"ingest state {self.path}: unreadable ({error})") from None
            if (
                not isinstance(data, dict)
                or data.get("format") != FORMAT
                or not isinstance(data.get("sources"), dict)
            ):
                raise ValueError(f"ingest state {self.path}: not a tagclip ingest state file")
            self.sources = data["sources"]

    def get(self, location: str) -> dict[str, Any]:
        return self.sources.get(location, {})

    def folder_owner(self, folder: str) -> str | None:
        """The source whose crops live in ``folder`` (None: no source yet)."""
        return next((loc for loc, entry in self.sources.items() if entry.get("folder") == folder), None)

    def update(self, location: str, **fields: Any) -> None:
        """Set fields of one source's entry and rewrite the file atomically."""
        self.sources[location] = {**self.get(location), **fields}
        os.makedirs(self.path.parent, exist_ok=True)
        write_json(self.path, {"format": FORMAT, "version": 1, "sources": self.sources})
