"""Image re-ID datasets (CARGO, AG-ReID.v2, LAGPeR, Market-1501, the synthetic set) as ``datasets.Dataset``
tables, the P x K identity batch sampler and the reference image transforms (docs/visa-reference.md §5-6).

Every table has one row per image with ``REID_FEATURES``: ``image_path`` (absolute), ``person_id`` (raw id),
``camera`` (the camera number in the file name), ``camera_id`` (the id used for same-camera filtering, with
each dataset's rule) and ``view`` (0 = aerial, 1 = ground). A loader returns a ``ReIDDataset``: train, the
full query and gallery tables, and the dataset's evaluation protocols (``modeling_tagclip.metrics.reid.Protocol``).

Camera -> view and camera-id rules, exactly as the reference (ViSA / SeCap data code):

- CARGO ``{train,query,gallery}/Cam{c}/Cam{c}_{day|night}_{pid}_{idx}.jpg``: Cam1-5 aerial, Cam6-13 ground,
  camera_id = c - 1.
- AG-ReID.v2 ``AG-ReID.v2/AG-ReID.v2/{train_all,query,gallery}/<P..T..A..>/P{p}T{t}A{a}C{c}F{f}.jpg``:
  pid = int(p t a), C0 = UAV (aerial), C2 wearable / C3 CCTV (ground); camera_id = c - 1 (0 for C0) for train
  and query, but 0 (UAV) / 1 (any ground camera) in the gallery. Protocols from ``exp*.txt`` (lines starting
  ``query/`` are queries).
- LAGPeR: regex ``([-\\d]+)_c([-\\d]+)`` (first match on the path below the dataset folder), aerial cameras
  {3, 6, 9, 13, 16, 19, 22}, then camera_id = c - 1 for c > 10 (else c). Train = ``bounding_box_train/*/*.jpg``
  (one sub-folder level); protocols from ``exp{3,4,5}_*.txt`` (a line whose first path component, cut at the
  first ``_``, is ``query`` is a query).
- Market-1501: regex ``([-\\d]+)_c(\\d)``, pid -1 dropped, camera_id = c - 1, every image takes the ground path.

Differences from the reference, on purpose: setting-file lines are stripped (the reference drops the last
character, so its last line needs a newline); AG-ReID.v2 attributes (``qut_attribute_v8.mat``) are not read.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import ClassLabel, Dataset, Features, Value
from PIL import Image

from modeling_tagclip.data.text_retrieval import VIEW_NAMES
from modeling_tagclip.metrics.reid import Protocol, view_protocols
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND
from modeling_tagclip.models.tagclip.processing_tagclip import load_rgb

__all__ = [
    "IMAGENET_MEAN_255",
    "LOADERS",
    "REID_FEATURES",
    "IdentityBatchSampler",
    "ReIDDataset",
    "ReIDTransform",
    "load_agreidv2",
    "load_cargo",
    "load_lagper",
    "load_market1501",
    "load_reid_dataset",
    "parse_agreidv2_name",
    "parse_cargo_name",
    "parse_lagper_path",
    "parse_market_name",
    "relabel",
]

logger = logging.getLogger(__name__)

REID_FEATURES = Features(
    {
        "image_path": Value("string"),
        "person_id": Value("int64"),
        "camera": Value("int64"),
        "camera_id": Value("int64"),
        "view": ClassLabel(names=VIEW_NAMES),
    }
)
CARGO_AERIAL_CAMERAS = range(1, 6)
LAGPER_AERIAL_CAMERAS = frozenset({3, 6, 9, 13, 16, 19, 22})
LAGPER_PATTERN = re.compile(r"([-\d]+)_c([-\d]+)")
MARKET_PATTERN = re.compile(r"([-\d]+)_c(\d)")
AGREID_PATTERN = re.compile(r"P(\d+)T(\d+)A(\d+)C(\d+)F(\d+)")
AGREID_PROTOCOLS = {
    "A->C": "exp1_aerial_to_cctv.txt",
    "A->W": "exp2_aerial_to_wearable.txt",
    "C->A": "exp4_cctv_to_aerial.txt",
    "W->A": "exp5_wearable_to_aerial.txt",
}
LAGPER_PROTOCOLS = {"A->G": "exp3", "G->A": "exp4", "G->A+G": "exp5"}
IMAGENET_MEAN_255 = (123.675, 116.28, 103.53)


@dataclass
class ReIDDataset:
    """Train / query / gallery tables and the evaluation protocols (indices into query and gallery)."""

    name: str
    train: Dataset
    query: Dataset
    gallery: Dataset
    protocols: dict[str, Protocol] = field(default_factory=dict)


Row = dict[str, Any]


def _row(path: Path, pid: int, camera: int, camera_id: int, view: int) -> Row:
    return {"image_path": str(path), "person_id": pid, "camera": camera, "camera_id": camera_id, "view": view}


def _table(rows: list[Row], what: str) -> Dataset:
    if not rows:
        raise ValueError(f"no images found for {what}")
    return Dataset.from_list(rows, features=REID_FEATURES)


def _dataset_dir(root: str | Path, name: str) -> Path:
    """`root/name` if it exists (a `datasets/` folder was given), else `root` itself."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset folder not found: {root}")
    return root / name if (root / name).is_dir() else root


# ----------------------------------------------------------------------------- CARGO (and the synthetic set)


def parse_cargo_name(name: str) -> tuple[int, int, int]:
    """`Cam{c}_{day|night}_{pid}_{idx}.jpg` -> (pid, camera c, view): Cam1-5 aerial, Cam6-13 ground."""
    parts = Path(name).name.split("_")
    if len(parts) < 4 or not parts[0].startswith("Cam"):
        raise ValueError(f"not a CARGO file name (Cam{{c}}_{{day|night}}_{{pid}}_{{idx}}.jpg): {name!r}")
    camera, pid = int(parts[0][3:]), int(parts[2])
    return pid, camera, AERIAL if camera in CARGO_AERIAL_CAMERAS else GROUND


def _cargo_split(folder: Path) -> list[Row]:
    rows = []
    for path in sorted(folder.glob("Cam*/*.jpg")):
        pid, camera, view = parse_cargo_name(path.name)
        rows.append(_row(path, pid, camera, camera - 1, view))
    return rows


def load_cargo(root: str | Path, name: str = "CARGO") -> ReIDDataset:
    """CARGO (or a folder in its layout): protocols ALL, A<->G (ViSA/SeCap), G<->G, A<->A, A<->G (VDT), G->A."""
    folder = _dataset_dir(root, name)
    tables = {
        split: _table(_cargo_split(folder / split), f"{folder}/{split}")
        for split in ("train", "query", "gallery")
    }
    protocols = view_protocols(tables["query"]["view"], tables["gallery"]["view"])
    return ReIDDataset(name, tables["train"], tables["query"], tables["gallery"], protocols)


# ----------------------------------------------------------------------------- AG-ReID.v2


def parse_agreidv2_name(name: str, gallery: bool = False) -> tuple[int, int, int, int]:
    """`P{p}T{t}A{a}C{c}F{f}.jpg` -> (pid = int(p t a), camera c, camera_id, view); C0 = UAV = aerial.

    camera_id: c - 1 (0 for C0) for train / query; in the gallery 0 for UAV and 1 for any ground camera.
    """
    match = AGREID_PATTERN.search(Path(name).name)
    if match is None:
        raise ValueError(f"not an AG-ReID.v2 file name (P..T..A..C..F...jpg): {name!r}")
    p, t, a, c, _ = match.groups()
    camera = int(c)
    view = AERIAL if camera == 0 else GROUND
    if gallery:
        camera_id = 0 if camera == 0 else 1
    else:
        camera_id = camera - 1 if camera != 0 else 0
    return int(p + t + a), camera, camera_id, view


def _agreid_row(path: Path, gallery: bool) -> Row:
    pid, camera, camera_id, view = parse_agreidv2_name(path.name, gallery)
    return _row(path, pid, camera, camera_id, view)


def _read_setting(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"protocol file not found: {path}")
    return [
        line.strip() for line in path.read_text().splitlines()
    ]  # blank lines kept: line numbers in errors


def _protocol_rows(
    images: Path, lines: list[str], is_query: Callable[[str], bool], parse, source: Path
) -> tuple[list, list]:
    """Query and gallery rows of a setting file; a line that leaves ``images`` or does not parse is an error
    naming the file and line."""
    query, gallery = [], []
    root = os.path.abspath(images)
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        if not os.path.normpath(os.path.join(root, line)).startswith(root + os.sep):
            raise ValueError(f"{source}, line {number}: {line!r} points outside the dataset folder {images}")
        try:
            (query if is_query(line) else gallery).append(parse(images / line, not is_query(line)))
        except ValueError as error:
            raise ValueError(f"{source}, line {number}: {error}") from error
    return query, gallery


def _merge_protocols(per_protocol: dict[str, tuple[list[Row], list[Row]]], name: str):
    """Union query / gallery tables over the protocols (by path) and index arrays per protocol."""
    tables, index = {}, {"query": {}, "gallery": {}}
    rows: dict[str, list[Row]] = {"query": [], "gallery": []}
    for query_rows, gallery_rows in per_protocol.values():
        for side, side_rows in (("query", query_rows), ("gallery", gallery_rows)):
            for row in side_rows:
                if row["image_path"] not in index[side]:
                    index[side][row["image_path"]] = len(rows[side])
                    rows[side].append(row)
    for side in ("query", "gallery"):
        tables[side] = _table(rows[side], f"{name} {side}")
    protocols = {
        key: Protocol(
            np.asarray([index["query"][r["image_path"]] for r in q], dtype=np.int64),
            np.asarray([index["gallery"][r["image_path"]] for r in g], dtype=np.int64),
            "camera",
            key,
        )
        for key, (q, g) in per_protocol.items()
    }
    return tables["query"], tables["gallery"], protocols


def load_agreidv2(root: str | Path, name: str = "AG-ReID.v2") -> ReIDDataset:
    """AG-ReID.v2 with the protocols A->C, A->W, C->A, W->A of the setting files present."""
    folder = _dataset_dir(root, name)
    images = folder / "AG-ReID.v2" if (folder / "AG-ReID.v2").is_dir() else folder
    train = _table(
        [_agreid_row(p, False) for p in sorted((images / "train_all").glob("*/*.jpg"))], "train_all"
    )
    per_protocol = {}
    for key, filename in AGREID_PROTOCOLS.items():
        if not (folder / filename).is_file():
            logger.warning("AG-ReID.v2 protocol %s skipped: %s not found", key, folder / filename)
            continue
        lines = _read_setting(folder / filename)
        per_protocol[key] = _protocol_rows(
            images, lines, lambda s: s.startswith("query/"), _agreid_row, folder / filename
        )
    if not per_protocol:
        raise FileNotFoundError(
            f"no AG-ReID.v2 setting file ({', '.join(AGREID_PROTOCOLS.values())}) in {folder}"
        )
    query, gallery, protocols = _merge_protocols(per_protocol, name)
    return ReIDDataset(name, train, query, gallery, protocols)


# ----------------------------------------------------------------------------- LAGPeR


def parse_lagper_path(path: str) -> tuple[int, int, int, int]:
    """First `([-\\d]+)_c([-\\d]+)` match on the path -> (pid, camera, camera_id, view).

    Aerial cameras {3, 6, 9, 13, 16, 19, 22}; camera_id = camera - 1 if camera > 10 (numbering skips 10).
    """
    match = LAGPER_PATTERN.search(str(path))
    if match is None:
        raise ValueError(f"no '<pid>_c<camera>' in LAGPeR path {path!r}")
    pid, camera = int(match.group(1)), int(match.group(2))
    view = AERIAL if camera in LAGPER_AERIAL_CAMERAS else GROUND
    return pid, camera, camera - 1 if camera > 10 else camera, view


def _lagper_row(folder: Path, relative: str) -> Row:
    pid, camera, camera_id, view = parse_lagper_path(relative)
    return _row(folder / relative, pid, camera, camera_id, view)


def _lagper_is_query(line: str) -> bool:
    return line.split("/")[0].split("_")[0] == "query"


def load_lagper(root: str | Path, name: str = "LAGPeR") -> ReIDDataset:
    """LAGPeR with the protocols A->G (exp3), G->A (exp4), G->A+G (exp5) of the setting files present."""
    folder = _dataset_dir(root, name)
    train_paths = sorted((folder / "bounding_box_train").glob("*/*.jpg"))
    train = _table(
        [_lagper_row(folder, str(p.relative_to(folder))) for p in train_paths], "bounding_box_train"
    )
    per_protocol = {}
    for key, prefix in LAGPER_PROTOCOLS.items():
        files = sorted(folder.glob(f"{prefix}_*.txt"))
        if not files:
            logger.warning("LAGPeR protocol %s skipped: no %s_*.txt in %s", key, prefix, folder)
            continue
        lines = _read_setting(files[0])
        per_protocol[key] = _protocol_rows(
            folder,
            lines,
            _lagper_is_query,
            lambda p, _g: _lagper_row(folder, str(p.relative_to(folder))),
            files[0],
        )
    if not per_protocol:
        raise FileNotFoundError(f"no LAGPeR setting file (exp3_*.txt, exp4_*.txt, exp5_*.txt) in {folder}")
    query, gallery, protocols = _merge_protocols(per_protocol, name)
    return ReIDDataset(name, train, query, gallery, protocols)


# ----------------------------------------------------------------------------- Market-1501


def parse_market_name(name: str) -> tuple[int, int] | None:
    """`{pid}_c{c}s..._....jpg` -> (pid, camera c); `None` for junk images (pid -1)."""
    match = MARKET_PATTERN.search(Path(name).name)
    if match is None:
        raise ValueError(f"not a Market-1501 file name ({{pid}}_c{{camera}}...jpg): {name!r}")
    pid, camera = int(match.group(1)), int(match.group(2))
    return None if pid == -1 else (pid, camera)


def _market_split(folder: Path) -> list[Row]:
    rows = []
    for path in sorted(folder.glob("*.jpg")):
        parsed = parse_market_name(path.name)
        if parsed is not None:
            rows.append(_row(path, parsed[0], parsed[1], parsed[1] - 1, GROUND))
    return rows


def load_market1501(root: str | Path, name: str = "market1501") -> ReIDDataset:
    """Market-1501: every image is ground (takes the ground view token / experts); protocol ALL."""
    folder = _dataset_dir(root, name)
    splits = {"train": "bounding_box_train", "query": "query", "gallery": "bounding_box_test"}
    tables = {key: _table(_market_split(folder / sub), f"{folder}/{sub}") for key, sub in splits.items()}
    protocols = {"ALL": Protocol(description="all queries vs the whole gallery")}
    return ReIDDataset(name, tables["train"], tables["query"], tables["gallery"], protocols)


# ----------------------------------------------------------------------------- registry


def _load_synthetic(root: str | Path) -> ReIDDataset:
    return load_cargo(root, name="synthetic_reid")


LOADERS: dict[str, Callable[[str | Path], ReIDDataset]] = {
    "cargo": load_cargo,
    "agreidv2": load_agreidv2,
    "lagper": load_lagper,
    "market1501": load_market1501,
    "synthetic": _load_synthetic,
}


def _read_text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def detect_dataset(root: str | Path) -> str:
    """Guess the dataset kind of a folder from its layout."""
    root = Path(root)
    checks = [
        ("synthetic", lambda r: "data.synthetic_reid" in _read_text(r / "dataset_info.json")),
        (
            "agreidv2",
            lambda r: any(
                (r / d / f).is_file() for d in ("", "AG-ReID.v2") for f in AGREID_PROTOCOLS.values()
            ),
        ),
        ("lagper", lambda r: (r / "bounding_box_train").is_dir() and any(r.glob("exp*_*.txt"))),
        ("market1501", lambda r: (r / "bounding_box_test").is_dir()),
        ("cargo", lambda r: (r / "query").is_dir() and any((r / "query").glob("Cam*"))),
    ]
    for kind, check in checks:
        if check(root) or any(check(sub) for sub in root.iterdir() if sub.is_dir()):
            return kind
    raise ValueError(f"cannot tell the re-ID dataset layout of {root}; pass the dataset name explicitly")


def load_reid_dataset(name_or_root: str, root: str | Path | None = None) -> ReIDDataset:
    """`load_reid_dataset("cargo", "datasets/")`, or `load_reid_dataset("path/to/folder")` (layout detected)."""
    if root is None:
        root, name = name_or_root, detect_dataset(name_or_root)
    else:
        name = name_or_root.lower().replace("-", "").replace("_", "").replace(".", "")
    if name not in LOADERS:
        raise ValueError(f"unknown re-ID dataset {name_or_root!r}; choose from {sorted(LOADERS)}")
    return LOADERS[name](root)


def relabel(table: Dataset) -> tuple[np.ndarray, dict[int, int]]:
    """Contiguous training labels 0..C-1 in order of first appearance (fast-reid relabels train pids)."""
    mapping: dict[int, int] = {}
    for pid in table["person_id"]:
        mapping.setdefault(pid, len(mapping))
    return np.asarray([mapping[pid] for pid in table["person_id"]], dtype=np.int64), mapping


# ----------------------------------------------------------------------------- P x K sampler


class IdentityBatchSampler(torch.utils.data.Sampler[list[int]]):
    """fast-reid's `NaiveIdentitySampler` as a batch sampler: P identities without replacement, K images each.

    Identities with fewer than K images are sampled with replacement. The index stream continues across
    epochs (the reference sampler is infinite); an epoch is `len(ids) // batch_size` batches, as the reference's
    iterations per epoch. Deterministic given `seed`.
    """

    def __init__(self, person_ids: Sequence[int], batch_size: int, num_instances: int, seed: int = 0):
        if batch_size % num_instances or batch_size < num_instances:
            raise ValueError(f"batch_size {batch_size} must be a multiple of num_instances {num_instances}")
        self.person_ids = np.asarray(person_ids)
        self.batch_size, self.num_instances = batch_size, num_instances
        self.num_pids_per_batch = batch_size // num_instances
        self.index_of: dict[int, list[int]] = {}
        for index, pid in enumerate(self.person_ids.tolist()):
            self.index_of.setdefault(pid, []).append(index)
        if len(self.index_of) < self.num_pids_per_batch:
            raise ValueError(
                f"P x K sampling needs at least P = {self.num_pids_per_batch} identities, got {len(self.index_of)}"
            )
        self.rng = np.random.default_rng(seed)
        self._stream = self._batches()

    def __len__(self) -> int:
        return max(1, len(self.person_ids) // self.batch_size)

    def _batches(self) -> Iterator[list[int]]:
        pids = sorted(self.index_of)
        while True:
            available, pools, batch = list(pids), {}, []
            while len(available) >= self.num_pids_per_batch:
                for pid in self.rng.choice(available, self.num_pids_per_batch, replace=False).tolist():
                    if pid not in pools:
                        pool = list(self.index_of[pid])
                        if len(pool) < self.num_instances:
                            pool = self.rng.choice(pool, self.num_instances, replace=True).tolist()
                        self.rng.shuffle(pool)
                        pools[pid] = pool
                    batch.extend(pools[pid][: self.num_instances])
                    del pools[pid][: self.num_instances]
                    if len(pools[pid]) < self.num_instances:
                        available.remove(pid)
                yield batch
                batch = []

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(len(self)):
            yield next(self._stream)


# ----------------------------------------------------------------------------- transforms


def _random_erasing(image: torch.Tensor, scale=(0.02, 0.33), ratio=(0.3, 3.3)) -> torch.Tensor:
    """torchvision's RandomErasing (one box, 10 tries), filled with the ImageNet mean in 0-255."""
    _, height, width = image.shape
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        erase_area = area * float(torch.empty(1).uniform_(*scale))
        aspect = math.exp(float(torch.empty(1).uniform_(*log_ratio)))
        h, w = round(math.sqrt(erase_area * aspect)), round(math.sqrt(erase_area / aspect))
        if h < height and w < width:
            top = int(torch.randint(0, height - h + 1, (1,)))
            left = int(torch.randint(0, width - w + 1, (1,)))
            image = image.clone()
            image[:, top : top + h, left : left + w] = torch.tensor(IMAGENET_MEAN_255)[:, None, None]
            return image
    return image


class ReIDTransform:
    """Reference transforms on a PIL image, then (x - 127.5) / 127.5 (the model's input normalisation).

    Test: Resize(H, W, bicubic). Train adds Pad(10) -> RandomCrop -> HFlip(0.5) -> RandomErasing(0.5).
    """

    def __init__(
        self, size: Sequence[int] = (256, 128), train: bool = False, padding: int = 10, erasing: float = 0.5
    ):
        self.size, self.train, self.padding, self.erasing = (
            (int(size[0]), int(size[1])),
            train,
            padding,
            erasing,
        )

    def __call__(self, image: Image.Image) -> torch.Tensor:
        height, width = self.size
        image = load_rgb(image).resize((width, height), Image.BICUBIC)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)  # 0-255
        if self.train:
            pixels = self._augment(pixels)
        return (pixels - 127.5) / 127.5

    def _augment(self, pixels: torch.Tensor) -> torch.Tensor:
        height, width = self.size
        padded = torch.nn.functional.pad(pixels, [self.padding] * 4)
        top = int(torch.randint(0, padded.shape[1] - height + 1, (1,)))
        left = int(torch.randint(0, padded.shape[2] - width + 1, (1,)))
        pixels = padded[:, top : top + height, left : left + width]
        if float(torch.rand(1)) < 0.5:
            pixels = pixels.flip(-1)
        if float(torch.rand(1)) < self.erasing:
            pixels = _random_erasing(pixels)
        return pixels
