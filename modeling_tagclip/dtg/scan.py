"""DTG's input: the images to caption (a scanned folder or a TAG-PEDES-style list), their ids, views and
attribute labels."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from PIL import Image

from modeling_tagclip.dtg.views import AERIAL, GROUND

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
VIEW_FOLDERS = {"aerial": AERIAL, "uav": AERIAL, "drone": AERIAL, "ground": GROUND, "cctv": GROUND}


@dataclass
class ImageItem:
    """One image to caption: ``file_path`` is relative to the image dir (POSIX separators)."""

    file_path: str
    id: int
    cam_id: int | None = None
    attributes: str = ""


_LEADING_INT = re.compile(r"^[A-Za-z]*(\d+)")


def read_json_file(path: str | os.PathLike) -> Any:
    """The JSON value in the file at ``path``; text that is not UTF-8 JSON is a ValueError naming the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
        ) from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None


def _leading_int(name: str) -> int | None:
    match = _LEADING_INT.match(name)
    return int(match.group(1)) if match else None


def parse_id(rel: PurePosixPath, id_from: str = "auto") -> int | None:
    """Person id from a relative image path by the ``--id-from`` rule (see the module docstring)."""
    from_file = _leading_int(rel.name) if id_from in ("auto", "file") else None
    if from_file is not None or id_from == "file":
        return from_file
    return _leading_int(rel.parent.name) if rel.parent.name else None


def view_from_path(rel: PurePosixPath) -> int | None:
    """0/1 from a folder named aerial/uav/drone or ground/cctv in the path, else None."""
    views = {VIEW_FOLDERS[p.lower()] for p in rel.parent.parts if p.lower() in VIEW_FOLDERS}
    return views.pop() if len(views) == 1 else None


def _abs(path: str | Path) -> Path:
    return Path(os.path.abspath(path))


def scan_images(
    image_dir: str | Path,
    id_from: str = "auto",
    cam_id: int | None = None,
    relative_to: str | Path | None = None,
) -> tuple[list[ImageItem], list[str]]:
    """Image files under ``image_dir`` (recursive, sorted) and the paths skipped for lack of an id.

    ``file_path`` is relative to ``relative_to`` (default ``image_dir``; it must contain ``image_dir``).
    """
    root = Path(image_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"--images: {root} is not a directory")
    base = Path(relative_to) if relative_to is not None else root
    if not _abs(root).is_relative_to(_abs(base)):
        raise ValueError(f"--image-dir {base} must contain --images {root}")
    items, skipped = [], []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        rel = PurePosixPath(_abs(path).relative_to(_abs(base)).as_posix())
        pid = parse_id(rel, id_from)
        if pid is None:
            skipped.append(str(rel))
            continue
        view = cam_id if cam_id is not None else view_from_path(rel)
        items.append(ImageItem(str(rel), pid, view))
    if not items:
        raise ValueError(f"no images with a parsable person id under {root} (id rule: --id-from {id_from})")
    return items, skipped


def _dataset_image_dir(dataset: Path, entries: list[dict[str, Any]]) -> Path:
    """Default image dir for ``--dataset``: ``images/`` next to the file if the first entry is there, else its folder."""
    first = next((e.get("file_path") for e in entries if isinstance(e, dict) and e.get("file_path")), None)
    for cand in (dataset.parent / "images", dataset.parent):
        if first is not None and (cand / first).is_file():
            return cand
    raise FileNotFoundError(f"cannot find the images of {dataset}: pass --image-dir")


def _dataset_item(entry: Any, index: int) -> ImageItem:
    if not isinstance(entry, dict) or not isinstance(entry.get("file_path"), str):
        raise ValueError(f"--dataset entry {index} has no 'file_path': {entry!r}")
    try:
        pid = int(entry["id"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"--dataset entry {index} has no integer 'id': {entry!r}") from err
    cam = entry.get("cam_id")
    view = cam if type(cam) is int and cam in (0, 1) else None
    return ImageItem(entry["file_path"], pid, view, format_attributes(entry.get("attributes")))


def load_dataset_items(
    dataset: str | Path, image_dir: str | Path | None = None
) -> tuple[list[ImageItem], Path]:
    """Items from a TAG-PEDES-style JSON list (``id``, ``file_path``, optional ``cam_id``/``attributes``)."""
    path = Path(dataset)
    entries = read_json_file(path)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of entries")
    root = Path(image_dir) if image_dir is not None else _dataset_image_dir(path, entries)
    items, seen = [], set()
    for index, entry in enumerate(entries):
        item = _dataset_item(entry, index)
        if item.file_path not in seen:
            seen.add(item.file_path)
            items.append(item)
    if len(items) < len(entries):
        logger.warning("%s: %d duplicate file_path entries ignored", path, len(entries) - len(items))
    return items, root


def _label_text(key: str, value: Any) -> str:
    if value is None or value is False or value == "" or value == 0 or value == []:
        return ""
    name = str(key).replace("_", " ")
    if value is True or value == 1:
        return name
    if isinstance(value, (list, tuple)):
        value = " ".join(str(v) for v in value)
    return f"{name}: {value}"


def format_attributes(labels: Any) -> str:
    """Attribute labels as prompt text: dict -> ``"gender: male, age: young, backpack"``, list -> joined."""
    if not labels:
        return ""
    if isinstance(labels, str):
        return labels.strip()
    if isinstance(labels, dict):
        parts = [_label_text(k, v) for k, v in labels.items()]
    elif isinstance(labels, (list, tuple)):
        parts = [str(v).strip() for v in labels if v not in (None, "")]
    else:
        raise ValueError(f"attribute labels must be a dict, list or string, got {labels!r}")
    return ", ".join(p for p in parts if p)


def load_attributes(path: str | Path) -> dict[str, Any]:
    """The ``--attributes`` JSON: a mapping image key -> labels (dict / list / string)."""
    data = read_json_file(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping image keys to attribute labels")
    return data


def _attribute_keys(item: ImageItem) -> Iterable[str]:
    rel = PurePosixPath(item.file_path)
    return (item.file_path, rel.name, rel.stem, str(item.id))


def attach_attributes(items: Sequence[ImageItem], mapping: dict[str, Any]) -> int:
    """Set ``item.attributes`` from ``mapping`` (see the module docstring); returns how many items got labels."""
    found = 0
    for item in items:
        key = next((k for k in _attribute_keys(item) if k in mapping), None)
        if key is not None:
            item.attributes = format_attributes(mapping[key])
            found += bool(item.attributes)
    return found


def open_image(path: Path) -> Image.Image | None:
    """The image at ``path`` as RGB, or None if it cannot be read."""
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError):
        return None
