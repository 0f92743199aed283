"""An aerial-ground re-ID set in CARGO's layout, cut from the synthetic footage (``modeling_tagclip.video.footage``).

A crop is a video frame cut at a ground-truth box of ``gt/<camera>.txt`` with the context margin of ingest's
crops (``video.crops.crop_box``), so identities, cameras and views are the footage's own. Per identity and
camera: ``crops_per_camera`` frames evenly spaced over the frames it is seen in (boxes clear of the frame's
border when there are any). Aerial cameras become CARGO's Cam1-5 and ground cameras Cam6-13, in camera-file
order; files are ``{train,query,gallery}/Cam{c}/Cam{c}_day_{pid:04d}_{idx:04d}.jpg`` (the footage is daylight;
pid: the footage identity), so ``modeling_tagclip.data.reid.load_cargo`` and every CARGO protocol read it.

A seeded ``test_fraction`` of the identities is the test split, the rest ``train`` (which the bench does not
use; CARGO's layout has one). As ``data.synthetic_reid`` puts a test identity's first image of each view in
``query``, a test identity's first camera of each view goes to ``query`` (all its crops there) and its other
cameras to ``gallery``, views taken in turn (aerial first for odd pids) and a camera kept in the gallery
whenever moving it would leave none: every query keeps a match on another camera.

Usage: ``cut_reid_dataset(footage_root, out)`` from a footage folder, or ``render_footage_reid(out, seed=0)``
(renders the footage into a temporary folder and cuts it); ``dataset_info.json`` records how.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND

__all__ = ["FOOTAGE", "cut_reid_dataset", "render_footage_reid"]

GENERATOR_VERSION = 1
CARGO_CAMERAS = {AERIAL: (1, 2, 3, 4, 5), GROUND: (6, 7, 8, 9, 10, 11, 12, 13)}
VIEWS = {"aerial": AERIAL, "ground": GROUND}
# every CARGO camera; enough people a camera that a person is seen by about two drones and three street cameras
FOOTAGE = {
    "ground_cameras": 8,
    "aerial_cameras": 5,
    "people": 40,
    "people_per_camera": 16,
    "seconds": 12.0,
}

Sightings = dict[tuple[int, str], list[tuple[int, np.ndarray]]]  # (identity, camera) -> [(MOT frame, box)]


def _cargo_cameras(cameras: list[Any], where: Path) -> dict[str, tuple[int, int]]:
    """Footage camera id -> (CARGO camera number, view), aerial ones on Cam1-5 and ground ones on Cam6-13."""
    out, used = {}, {AERIAL: 0, GROUND: 0}
    for camera in cameras:
        if camera.view not in VIEWS:
            raise ValueError(f"{where}: camera {camera.camera!r} has no view (aerial or ground)")
        view = VIEWS[camera.view]
        if used[view] == len(CARGO_CAMERAS[view]):
            raise ValueError(
                f"{where}: more than {len(CARGO_CAMERAS[view])} {camera.view} cameras; CARGO's layout has "
                f"Cam1-5 aerial and Cam6-13 ground"
            )
        out[camera.camera] = (CARGO_CAMERAS[view][used[view]], view)
        used[view] += 1
    return out


def _sightings(root: Path, cameras: dict[str, tuple[int, int]]) -> Sightings:
    """Every ground-truth box of every identity on every camera, by (identity, camera)."""
    from modeling_tagclip.video.mot_eval import read_gt

    seen: Sightings = defaultdict(list)
    for camera in cameras:
        path = root / "gt" / f"{camera}.txt"
        if not path.is_file():
            raise FileNotFoundError(f"{root}: no ground truth gt/{camera}.txt for camera {camera!r}")
        for frame, (ids, boxes) in sorted(read_gt(path).items()):
            for identity, box in zip(ids.tolist(), boxes, strict=True):
                seen[(int(identity), camera)].append((frame, box))
    return dict(seen)


def _picks(
    boxes: list[tuple[int, np.ndarray]], count: int, size: tuple[int, int]
) -> list[tuple[int, np.ndarray]]:
    """``count`` sightings evenly spaced in time, preferring boxes clear of the frame's border."""
    from modeling_tagclip.video.crops import BORDER_PIXELS

    h, w = size
    clear = [
        (f, b)
        for f, b in boxes
        if b[0] > BORDER_PIXELS
        and b[1] > BORDER_PIXELS
        and b[2] < w - BORDER_PIXELS
        and b[3] < h - BORDER_PIXELS
    ]
    pool = clear or boxes
    index = np.unique(np.floor((np.arange(count) + 0.5) * len(pool) / count).astype(int))
    return [pool[i] for i in index]


def _frames(video: Path) -> dict[int, np.ndarray]:
    """Decoded frames by MOT frame number (from 1)."""
    import av

    if not video.is_file():
        raise FileNotFoundError(f"video not found: {video}")
    with av.open(str(video)) as container:
        return {i + 1: f.to_ndarray(format="rgb24") for i, f in enumerate(container.decode(video=0))}


def _split(
    identities: list[int],
    cameras_of: dict[int, list[str]],
    views: dict[str, int],
    test_fraction: float,
    seed: int,
):
    """(folder of each (identity, camera), test identities): train, or query / gallery as the module says."""
    rng = np.random.default_rng([seed, 20])
    n_test = min(max(1, round(len(identities) * test_fraction)), len(identities) - 1)
    test = sorted(int(i) for i in rng.permutation(identities)[:n_test])
    folder = {(pid, cam): "train" for pid in identities for cam in cameras_of[pid]}
    for pid in test:
        cams = cameras_of[pid]
        folder.update({(pid, cam): "gallery" for cam in cams})
        order = (AERIAL, GROUND) if pid % 2 else (GROUND, AERIAL)
        for view in order:
            first = next((cam for cam in cams if views[cam] == view), None)
            left = sum(folder[(pid, cam)] == "gallery" for cam in cams)
            if first is not None and left >= 2:
                folder[(pid, first)] = "query"
    return folder, test


def cut_reid_dataset(
    footage: str | Path,
    out: str | Path,
    *,
    crops_per_camera: int = 4,
    test_fraction: float = 0.75,
    seed: int = 0,
) -> dict[str, Any]:
    """Cut the CARGO-layout set from a footage folder (``render_footage``'s layout) into ``out``; returns what
    ``dataset_info.json`` records (cameras, identities, counts per folder)."""
    from modeling_tagclip.video.cameras import read_cameras

    if crops_per_camera < 1:
        raise ValueError(f"crops_per_camera must be >= 1, got {crops_per_camera}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    root, out = Path(footage), Path(out)
    if not (root / "cameras.yaml").is_file():
        raise FileNotFoundError(f"{root}: not a footage folder (no cameras.yaml; render_footage writes one)")
    entries = read_cameras(root / "cameras.yaml")
    cargo = _cargo_cameras(entries, root / "cameras.yaml")
    seen = _sightings(root, cargo)
    cameras_of: dict[int, list[str]] = defaultdict(list)
    for pid, camera in seen:  # camera-file order within an identity
        cameras_of[pid].append(camera)
    cameras_of = {pid: sorted(cams, key=list(cargo).index) for pid, cams in cameras_of.items()}
    identities = sorted(cameras_of)
    if len(identities) < 2:
        raise ValueError(
            f"{root}: the ground truth shows {len(identities)} identities; a re-ID set needs >= 2"
        )
    folder, test = _split(identities, cameras_of, {c: v for c, (_, v) in cargo.items()}, test_fraction, seed)
    counts, next_index = {"train": 0, "query": 0, "gallery": 0}, dict.fromkeys(identities, 0)
    for entry in entries:
        frames = _frames(root / "videos" / entry.source)
        number = cargo[entry.camera][0]
        size = next(iter(frames.values())).shape[:2]
        for pid in identities:
            if (pid, entry.camera) in seen:
                for frame_no, box in _picks(seen[(pid, entry.camera)], crops_per_camera, size):
                    split = folder[(pid, entry.camera)]
                    name = f"Cam{number}_day_{pid:04d}_{next_index[pid]:04d}.jpg"
                    _write_crop(out / split / f"Cam{number}" / name, frames[frame_no], box)
                    counts[split], next_index[pid] = counts[split] + 1, next_index[pid] + 1
    return {
        "cameras": {camera: f"Cam{number}" for camera, (number, _) in cargo.items()},
        "identities": {"train": [p for p in identities if p not in test], "test": test},
        "counts": counts,
    }


def _write_crop(path: Path, image: np.ndarray, box: np.ndarray) -> None:
    """Save the crop of ``image`` at ``box`` with ingest's margin."""
    from PIL import Image

    from modeling_tagclip.video.crops import crop_box

    _, window = crop_box(box, image.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image[window]).save(path, quality=95)


def render_footage_reid(
    out: str | Path,
    *,
    seed: int = 0,
    footage: dict[str, Any] | None = None,
    crops_per_camera: int = 4,
    test_fraction: float = 0.75,
) -> dict[str, Any]:
    """Render the footage of ``seed`` (``render_footage`` options ``footage`` over ``FOOTAGE``) into a temporary
    folder, cut the set into ``out`` and write ``out/dataset_info.json``; returns its content."""
    from modeling_tagclip.video.footage import render_footage

    options = {**FOOTAGE, **(footage or {})}
    out = Path(out)
    if (out / "query").exists() or (out / "gallery").exists():
        raise FileExistsError(f"{out} already holds a re-ID set; remove it or choose another folder")
    with tempfile.TemporaryDirectory(prefix="footage-reid-") as tmp:
        render_footage(tmp, seed=seed, **options)
        try:
            cut = cut_reid_dataset(
                tmp, out, crops_per_camera=crops_per_camera, test_fraction=test_fraction, seed=seed
            )
        except Exception:
            for split in ("train", "query", "gallery"):
                shutil.rmtree(out / split, ignore_errors=True)
            raise
    info = {
        "generator": "modeling_tagclip.data.footage_reid",
        "version": GENERATOR_VERSION,
        "layout": "cargo",
        "description": (
            "person crops cut at the ground-truth boxes of the synthetic footage "
            "(modeling_tagclip.video.footage.render_footage)"
        ),
        "footage": {"seed": seed, **{k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}},
        "parameters": {"crops_per_camera": crops_per_camera, "test_fraction": test_fraction, "seed": seed},
        **cut,
    }
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
