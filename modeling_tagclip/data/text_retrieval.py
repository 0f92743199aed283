"""Loaders for TAG-PEDES and the text-based person-search datasets as ``datasets.Dataset`` objects.

Every loader returns one row per image with a fixed schema (``IMAGE_FEATURES``):
``image_path`` (absolute), ``person_id`` (raw id from the annotation file), ``captions``, ``view``
(ClassLabel: 0 = aerial, 1 = ground) and ``split``. Formats: docs/tagclip-reference.md §7:

- TAG-PEDES / TBPS-style ``{split}_reid.json``: list of ``{id, file_path, captions, cam_id?}``;
- CUHK-PEDES ``reid_raw.json`` and ICFG-PEDES ``ICFG-PEDES.json``: list of
  ``{split, captions, file_path, processed_tokens, id}``, images under ``imgs/``;
- RSTPReid ``data_captions.json``: list of ``{id, img_path, captions, split}``, images under ``imgs/``.

``cam_id`` 0/1 or the view names "aerial"/"ground" (any case) give the view; a missing or unknown one means
ground (1), as in the reference. ``id`` must be an integer (or a string of digits): 3.7 is an error, never 3.
Image paths must stay inside the image folder (no absolute paths, no ``..`` or symlink escaping it) unless
``allow_outside_root=True``. Malformed JSON is an error naming the file, line and column.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, List, Value

from modeling_tagclip.atomic_io import KINDS
from modeling_tagclip.models.tagclip.configuration_tagclip import GROUND
from modeling_tagclip.models.tagclip.configuration_tagclip import VIEW_NAMES as _VIEW_NAMES

__all__ = [
    "IMAGE_FEATURES",
    "PAIR_FEATURES",
    "VIEW_NAMES",
    "load_tagpedes",
    "load_cuhk_pedes",
    "load_icfg_pedes",
    "load_rstpreid",
    "load_dataset_split",
    "pairs_view",
    "remap_ids",
    "split_validation",
]

logger = logging.getLogger(__name__)

VIEW_NAMES = list(_VIEW_NAMES)  # datasets' ClassLabel wants a list
IMAGE_FEATURES = Features(
    {
        "image_path": Value("string"),
        "person_id": Value("int64"),
        "captions": List(Value("string")),
        "view": ClassLabel(names=VIEW_NAMES),
        "split": Value("string"),
    }
)
PAIR_FEATURES = Features(
    {
        "caption": Value("string"),
        "image_path": Value("string"),
        "person_id": Value("int64"),
        "view": ClassLabel(names=VIEW_NAMES),
        "image_index": Value("int64"),
    }
)
MAX_LISTED = 5

# name -> (directory under the data root, annotation file, path key); the TAG-PEDES layout is separate.
RAW_FORMATS = {
    "cuhk-pedes": ("CUHK-PEDES", "reid_raw.json", "file_path"),
    "icfg-pedes": ("ICFG-PEDES", "ICFG-PEDES.json", "file_path"),
    "rstpreid": ("RSTPReid", "data_captions.json", "img_path"),
}
TAGPEDES_NAMES = ("tag-pedes", "tagpedes")


# ----------------------------------------------------------------------------- helpers


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    _require_regular_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from error
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of entries, got {type(data).__name__}")
    return data


def _require_regular_file(path: Path) -> None:
    """A ``ValueError`` naming what ``path`` is when it is no regular file (a link to /dev/urandom, a FIFO), so
    that it is neither read forever nor reported as missing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"annotation file {path} does not exist") from None
    if not stat.S_ISREG(mode):
        kind = KINDS.get(stat.S_IFMT(mode), "not a regular file")
        via = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise ValueError(f"{path}{via} is {kind}, not an annotation file")


def _view_of(entry: dict[str, Any]) -> int | None:
    """0/1 from ``cam_id`` (0/1 or "aerial"/"ground", as the processor's view names), or None when missing or
    unknown."""
    cam = entry.get("cam_id")
    if isinstance(cam, str) and cam.strip().lower() in VIEW_NAMES:
        return VIEW_NAMES.index(cam.strip().lower())
    return cam if type(cam) is int and cam in (0, 1) else None


def _person_id(value: Any) -> int | None:
    """An integer ``id`` (int, or a string of digits with an optional sign); None for anything else."""
    if type(value) is int:
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return None


def _inside(image_dir: Path, relative: str, allow_outside_root: bool) -> str | None:
    """The absolute image path, or None if ``relative`` leaves ``image_dir`` (absolute, ``..`` or a symlink that
    points outside it) unallowed."""
    root = os.path.abspath(image_dir)
    path = os.path.normpath(os.path.join(root, relative))
    if allow_outside_root:
        return path
    real_root = os.path.realpath(root)
    if path.startswith(root + os.sep) and os.path.realpath(path).startswith(real_root + os.sep):
        return path
    return None


def _entry_problem(entry: Any, path_key: str) -> str | None:
    """Why an entry is unusable (missing id / path, empty or non-string captions), or None."""
    if not isinstance(entry, dict):
        return f"is not an object: {entry!r}"
    if not isinstance(entry.get(path_key), str) or not entry[path_key]:
        return f"has no {path_key!r}"
    if _person_id(entry.get("id")) is None:
        return f"has no integer 'id' (got {entry.get('id')!r})"
    captions = entry.get("captions")
    if (
        not isinstance(captions, list)
        or not captions
        or not all(isinstance(c, str) and c.strip() for c in captions)
    ):
        return f"has empty or invalid captions {captions!r}"
    return None


def _entry_desc(index: int, entry: Any, path_key: str) -> str:
    if not isinstance(entry, dict):
        return f"entry {index}"
    return f"entry {index} (id={entry.get('id')!r}, {path_key}={entry.get(path_key)!r})"


def _check_duplicates(rows: list[dict[str, Any]], source: Path, split: str) -> None:
    """An image listed under two person ids is an error; an entry repeating an earlier one's image and id is
    kept with a warning (it counts twice)."""
    ids: dict[str, int] = {}
    repeated = 0
    for row in rows:
        first = ids.setdefault(row["image_path"], row["person_id"])
        if first != row["person_id"]:
            raise ValueError(
                f"{source} [{split}]: image {row['image_path']} is listed under two person ids ({first} and "
                f"{row['person_id']}); an image shows one person: fix the annotations"
            )
        repeated += 1
    repeated -= len(ids)
    if repeated:
        logger.warning(
            "%s [%s]: %d entries repeat an earlier entry's image and id; each counts", source, split, repeated
        )


def _build_rows(
    entries: Iterable[tuple[int, dict[str, Any]]],
    source: Path,
    image_dir: Path,
    split: str,
    path_key: str,
    skip_bad: bool,
    allow_outside_root: bool = False,
) -> list[dict[str, Any]]:
    """Turn (index, entry) pairs into schema rows; handles bad captions and missing views."""
    rows, skipped, unknown_view = [], 0, 0
    for index, entry in entries:
        problem = _entry_problem(entry, path_key)
        image_path = _inside(image_dir, entry[path_key], allow_outside_root) if problem is None else None
        if problem is None and image_path is None:
            problem = (
                f"points outside the image folder {image_dir} (pass allow_outside_root=True to allow it)"
            )
        if problem is not None:
            if not skip_bad:
                raise ValueError(
                    f"{source}: {_entry_desc(index, entry, path_key)} {problem} "
                    "(pass skip_bad=True to skip such entries)"
                )
            skipped += 1
            continue
        view = _view_of(entry)
        unknown_view += view is None
        rows.append(
            {
                "image_path": image_path,
                "person_id": _person_id(entry["id"]),
                "captions": list(entry["captions"]),
                "view": GROUND if view is None else view,
                "split": split,
            }
        )
    if skipped:
        logger.warning(
            "%s [%s]: skipped %d bad entries (empty captions, no id or path)", source, split, skipped
        )
    _check_duplicates(rows, source, split)
    if unknown_view:
        logger.warning(
            "%s [%s]: %d of %d entries have no valid cam_id (0/1); assigned view=ground (1) as the reference does",
            source,
            split,
            unknown_view,
            len(rows),
        )
    return rows


def _check_files(rows: list[dict[str, Any]], source: Path) -> None:
    missing = [r["image_path"] for r in rows if not os.path.isfile(r["image_path"])]
    if missing:
        shown = "\n  ".join(missing[:MAX_LISTED])
        more = f"\n  ... and {len(missing) - MAX_LISTED} more" if len(missing) > MAX_LISTED else ""
        raise FileNotFoundError(
            f"{len(missing)} of {len(rows)} images listed in {source} are missing, e.g.:\n  {shown}{more}"
        )


def _to_dataset(rows: list[dict[str, Any]], source: Path, check_files: bool) -> Dataset:
    if not rows:
        raise ValueError(f"{source}: no entries to load (an empty list, or every entry skipped as bad)")
    if check_files:
        _check_files(rows, source)
    return Dataset.from_list(rows, features=IMAGE_FEATURES)


def _unknown_split(split: str, available: Iterable[str], source: Path) -> ValueError:
    return ValueError(f"unknown split {split!r} for {source}; available splits: {sorted(set(available))}")


# ----------------------------------------------------------------------------- loaders


def _tagpedes_file(anno: Path, split: str) -> Path:
    if anno.is_file():
        return anno
    available = sorted(p.name[: -len("_reid.json")] for p in anno.glob("*_reid.json"))
    if split not in available:
        raise _unknown_split(split, available, anno)
    return anno / f"{split}_reid.json"


def load_tagpedes(
    anno_dir_or_file: str | os.PathLike,
    image_dir: str | os.PathLike,
    split: str,
    *,
    check_files: bool = True,
    skip_bad: bool = False,
    allow_outside_root: bool = False,
) -> Dataset:
    """TAG-PEDES / TBPS-style ``{split}_reid.json`` (``id``, ``file_path``, ``captions``, optional ``cam_id``).

    ``anno_dir_or_file`` is the annotation directory (``split`` picks ``{split}_reid.json``) or one JSON file
    (``split`` is then only the label stored in the rows). ``file_path`` is relative to ``image_dir``.
    """
    source = _tagpedes_file(Path(anno_dir_or_file), split)
    entries = enumerate(_read_json_list(source))
    rows = _build_rows(entries, source, Path(image_dir), split, "file_path", skip_bad, allow_outside_root)
    return _to_dataset(rows, source, check_files)


def _load_raw(
    root: str | os.PathLike,
    fmt: str,
    split: str | None,
    check_files: bool,
    skip_bad: bool,
    allow_outside_root: bool = False,
) -> Dataset | DatasetDict:
    """CUHK-PEDES / ICFG-PEDES / RSTPReid: one JSON with a ``split`` key per entry, images under ``imgs/``."""
    _, filename, path_key = RAW_FORMATS[fmt]
    source = Path(root) / filename
    entries = _read_json_list(source)
    opts = (check_files, skip_bad, allow_outside_root)
    available = list(dict.fromkeys(str(e.get("split")) for e in entries if isinstance(e, dict)))
    if split is None:
        return DatasetDict({s: _load_raw_split(entries, source, s, path_key, *opts) for s in available})
    if split not in available:
        raise _unknown_split(split, available, source)
    return _load_raw_split(entries, source, split, path_key, *opts)


def _load_raw_split(
    entries: list[dict[str, Any]],
    source: Path,
    split: str,
    path_key: str,
    check_files: bool,
    skip_bad: bool,
    allow_outside_root: bool = False,
) -> Dataset:
    selected = ((i, e) for i, e in enumerate(entries) if isinstance(e, dict) and str(e.get("split")) == split)
    rows = _build_rows(
        selected, source, source.parent / "imgs", split, path_key, skip_bad, allow_outside_root
    )
    return _to_dataset(rows, source, check_files)


def load_cuhk_pedes(
    root: str | os.PathLike,
    split: str | None = None,
    *,
    check_files: bool = True,
    skip_bad: bool = False,
    allow_outside_root: bool = False,
) -> Dataset | DatasetDict:
    """CUHK-PEDES ``root/reid_raw.json``; one split as a Dataset, or all splits (``split=None``) as a DatasetDict."""
    return _load_raw(root, "cuhk-pedes", split, check_files, skip_bad, allow_outside_root)


def load_icfg_pedes(
    root: str | os.PathLike,
    split: str | None = None,
    *,
    check_files: bool = True,
    skip_bad: bool = False,
    allow_outside_root: bool = False,
) -> Dataset | DatasetDict:
    """ICFG-PEDES ``root/ICFG-PEDES.json``; one split as a Dataset, or all splits (``split=None``)."""
    return _load_raw(root, "icfg-pedes", split, check_files, skip_bad, allow_outside_root)


def load_rstpreid(
    root: str | os.PathLike,
    split: str | None = None,
    *,
    check_files: bool = True,
    skip_bad: bool = False,
    allow_outside_root: bool = False,
) -> Dataset | DatasetDict:
    """RSTPReid ``root/data_captions.json`` (``img_path`` under ``imgs/``); one split or all (``split=None``)."""
    return _load_raw(root, "rstpreid", split, check_files, skip_bad, allow_outside_root)


def _normalise_name(name: str) -> str:
    return name.lower().replace("_", "-")


def _resolve_tagpedes(path: Path, image_dir: str | os.PathLike | None) -> tuple[Path, Path] | None:
    """(anno dir or file, image dir) if ``path`` looks like TAG-PEDES, else None."""
    if path.is_file() and path.name.endswith("_reid.json"):
        anno = path
    elif (path / "anno_dir").is_dir():
        anno = path / "anno_dir"
    elif path.is_dir() and any(path.glob("*_reid.json")):
        anno = path
    else:
        return None
    if image_dir is None:
        folder = anno if anno.is_dir() else anno.parent
        # images/ beside anno_dir/ (the TAG-PEDES layout), else images/ beside the *_reid.json files
        candidates = [folder.parent / "images", folder / "images"]
        image_dir = next((c for c in candidates if c.is_dir()), candidates[0])
    return anno, Path(image_dir)


def load_dataset_split(
    name_or_path: str | os.PathLike,
    split: str,
    image_dir: str | os.PathLike | None = None,
    *,
    data_root: str | os.PathLike | None = None,
    check_files: bool = True,
    skip_bad: bool = False,
    allow_outside_root: bool = False,
) -> Dataset:
    """Load one split from a dataset name or a path, detecting the format.

    Names (``tag-pedes``, ``cuhk-pedes``, ``icfg-pedes``, ``rstpreid``) resolve to the usual directory
    (``TAG-PEDES``, ``CUHK-PEDES``, ``ICFG-PEDES``, ``RSTPReid``) under ``data_root`` (default: env
    ``TAGCLIP_DATA_ROOT`` or ``./data``). A path may be a ``*_reid.json`` file, a directory holding
    ``*_reid.json`` or ``anno_dir/`` (TAG-PEDES; images default to ``images/`` beside the annotations), or a
    raw dataset root holding ``reid_raw.json`` / ``ICFG-PEDES.json`` / ``data_captions.json`` (images are then
    always under ``imgs/`` and ``image_dir`` is ignored).
    """
    name = _normalise_name(str(name_or_path))
    root = Path(data_root or os.environ.get("TAGCLIP_DATA_ROOT", "data"))
    if name in TAGPEDES_NAMES:
        path = root / "TAG-PEDES"
    elif name in RAW_FORMATS:
        path = root / RAW_FORMATS[name][0]
    else:
        path = Path(name_or_path)
    opts = {"check_files": check_files, "skip_bad": skip_bad, "allow_outside_root": allow_outside_root}
    tag = _resolve_tagpedes(path, image_dir)
    if tag is not None:
        return load_tagpedes(tag[0], tag[1], split, **opts)
    for fmt, (_, filename, _) in RAW_FORMATS.items():
        if (path / filename).is_file():
            return _load_raw(path, fmt, split, **opts)
    known = [*TAGPEDES_NAMES, *RAW_FORMATS]
    raise ValueError(f"cannot detect a dataset at {path} (from {name_or_path!r}); known names: {known}")


# ----------------------------------------------------------------------------- views and splits


def _explode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
    out: dict[str, list] = {key: [] for key in PAIR_FEATURES}
    for i, captions in enumerate(batch["captions"]):
        for caption in captions:
            out["caption"].append(caption)
            out["image_path"].append(batch["image_path"][i])
            out["person_id"].append(batch["person_id"][i])
            out["view"].append(batch["view"][i])
            out["image_index"].append(indices[i])
    return out


def pairs_view(ds: Dataset) -> Dataset:
    """One row per (image, caption): ``caption``, ``image_path``, ``person_id``, ``view``, ``image_index``."""
    return ds.map(
        _explode,
        batched=True,
        with_indices=True,
        remove_columns=ds.column_names,
        features=PAIR_FEATURES,
        desc="pairs",
    )


def remap_ids(ds: Dataset, column: str = "person_id") -> tuple[Dataset, dict[int, int]]:
    """Add a ``label`` column with contiguous ids 0..C-1 in order of first appearance; return the mapping."""
    mapping: dict[int, int] = {}
    for pid in ds[column]:
        mapping.setdefault(pid, len(mapping))
    labels = [mapping[pid] for pid in ds[column]]
    if "label" in ds.column_names:
        ds = ds.remove_columns("label")
    return ds.add_column("label", labels, feature=Value("int64")), mapping


def split_validation(ds: Dataset, fraction: float = 0.1, seed: int = 0) -> DatasetDict:
    """Split by identity into ``train`` and ``validation`` (disjoint ids), deterministically from ``seed``.

    ``round(fraction * n_ids)`` identities (at least one) go to validation; their ``split`` column, if any,
    becomes ``"validation"``.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    pids = np.asarray(ds["person_id"])
    unique = np.unique(pids)
    if len(unique) < 2:
        raise ValueError(f"need at least 2 identities to split, got {len(unique)}")
    n_val = min(max(1, round(fraction * len(unique))), len(unique) - 1)
    val_ids = np.random.default_rng(seed).permutation(unique)[:n_val]
    is_val = np.isin(pids, val_ids)
    train, val = ds.select(np.flatnonzero(~is_val)), ds.select(np.flatnonzero(is_val))
    if "split" in val.column_names:
        val = val.map(lambda _: {"split": "validation"}, desc="relabel split")
    return DatasetDict({"train": train, "validation": val})
