"""The camera file (``--cameras cameras.yaml``): which camera, view and start time each source has.

A YAML or JSON list of entries ``{source: GLOB, camera: ID, view: aerial|ground, start: ISO-8601 with a time
zone, name: optional}`` (or a mapping ``camera ID -> {source, view, start, name}``). ``source`` matches a
source's path, its name, or a stream's URL (shell wildcards). The first entry that matches wins.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

from .frames import Source, VideoError

__all__ = ["Camera", "CameraFileError", "camera_for", "read_cameras"]

VIEWS = ("aerial", "ground")
KEYS = {"source", "camera", "view", "start", "name"}


class CameraFileError(VideoError):
    """A camera file that cannot be used (the message names the file and the entry)."""


@dataclass(frozen=True)
class Camera:
    source: str  # the glob
    camera: str
    view: str | None
    start: float | None  # UTC seconds of the source's first frame
    name: str | None = None


def _start(value: Any, where: str) -> float | None:
    """UTC seconds of an ISO 8601 time that names its time zone."""
    if value is None:
        return None
    if isinstance(value, date) and not isinstance(value, datetime):
        raise CameraFileError(f"{where}: start {value!s} is a date without a time and time zone")
    if isinstance(value, datetime):
        moment = value
    else:
        try:
            moment = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
        except ValueError:
            raise CameraFileError(
                f"{where}: start {value!r} is not an ISO 8601 time (e.g. 2024-05-01T10:00:00+02:00)"
            ) from None
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise CameraFileError(
            f"{where}: start {value!s} has no time zone (add Z or an offset such as +02:00)"
        )
    return moment.timestamp()


def _entry(raw: Any, where: str) -> Camera:
    if not isinstance(raw, dict):
        raise CameraFileError(f"{where}: an entry must be a mapping with source and camera, got {raw!r}")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise CameraFileError(f"{where}: unknown keys {unknown} (allowed: {', '.join(sorted(KEYS))})")
    for key in ("source", "camera"):
        if raw.get(key) in (None, ""):
            raise CameraFileError(f"{where}: needs {key!r}")
    view = raw.get("view")
    view = None if view is None else str(view).strip().lower()
    if view not in (None, *VIEWS):
        raise CameraFileError(f"{where}: view must be 'aerial' or 'ground', got {raw.get('view')!r}")
    name = raw.get("name")
    return Camera(
        str(raw["source"]),
        str(raw["camera"]).strip(),
        view,
        _start(raw.get("start"), where),
        None if name is None else str(name),
    )


def read_cameras(path: str | Path) -> list[Camera]:
    """Entries of a camera file (YAML or JSON); ``CameraFileError`` names the file and the bad entry."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise CameraFileError(f"camera file {path}: cannot read it ({error})") from None
    try:
        if path.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except ValueError as error:
        raise CameraFileError(f"camera file {path}: not valid JSON ({error})") from None
    except Exception as error:  # yaml.YAMLError: a syntax error in the file
        raise CameraFileError(f"camera file {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if isinstance(raw, dict):
        raw = [{**(v if isinstance(v, dict) else {"source": v}), "camera": k} for k, v in raw.items()]
    if not isinstance(raw, list) or not raw:
        raise CameraFileError(f"camera file {path}: expected a list of camera entries")
    return [_entry(item, f"camera file {path}, entry {i + 1}") for i, item in enumerate(raw)]


def camera_for(source: Source, cameras: list[Camera], path: str | Path) -> Camera:
    """The first entry whose glob matches ``source`` (its path, its name or its URL); an error naming the
    source when none does."""
    names = {source.location, Path(source.location).name, Path(source.location).as_posix()}
    if source.kind != "stream":
        names.add(Path(source.location).resolve().as_posix())
    for camera in cameras:
        if any(fnmatch.fnmatchcase(name, camera.source) for name in names):
            return camera
    raise CameraFileError(
        f"{source.location}: no entry of camera file {path} matches this source (unknown camera)"
    )
