"""Synthetic footage: short videos of the synthetic person set, the embedded default and the tests' ground truth.

Ground cameras look at a street from the side: people cross at several depths (so at several scales), and the
nearer one hides the farther one where they pass. Aerial cameras look steeply down on terrain: people are small
and cross in any direction. The people are the crop set's test identities (the main job's recipe) with its
captions, so text search can be scored from footage to track. Everything is deterministic given the seed.

``render_footage(out)`` writes ``out/videos/<camera>.mp4`` (MPEG-4 Part 2, with the camera's start time as the
container's ``creation_time``), ``out/gt/<camera>.txt`` (MOTChallenge ground truth: ``frame,id,x,y,w,h,1,-1,-1,-1``
with frame numbers from 1 and the crop set's identity as the id), ``out/cameras.yaml`` (the camera file) and
``out/identities.json`` (identity -> attributes, captions and the cameras it appears in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import yaml

from modeling_tagclip.atomic_io import atomic_write, write_with
from modeling_tagclip.data.raster import resize_bilinear, to_uint8
from modeling_tagclip.data.synthetic import (
    image_captions,
    plan_identities,
    render_person_with_mask,
    street_background,
    terrain_background,
)
from modeling_tagclip.engine.config import read_recipe
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND, VIEW_NAMES

__all__ = ["FootageSet", "Person", "crop_set_identities", "render_footage"]

START = datetime(2026, 1, 1, 10, 0, tzinfo=timezone.utc)  # the first camera's first frame
CAMERA_OFFSET_S = 90  # each further camera starts this much later
MIN_INSIDE = 0.5  # ground truth keeps a person while at least this share of the box is inside the frame
MIN_VISIBLE = 0.3  # ... and at least this share of the person is not hidden by a nearer one
POSE_PERIOD_S = 0.5  # a walker's pose changes this often
NOISE_STD = 1.5  # sensor noise added to every frame (0-255 scale)


Sprite = tuple[np.ndarray, np.ndarray]  # a cut-out person: RGB float (h, w, 3), alpha float (h, w)


@dataclass(frozen=True)
class FootageSet:
    root: Path
    videos: list[Path]
    gt: list[Path]
    cameras: Path
    identities: Path


@dataclass(frozen=True)
class Person:
    """One walker in one camera: its sprites (RGB float, alpha float) and its path through the frame."""

    identity: int
    sprites: list[Sprite]
    height: float  # pixels (ground: fixed by depth; aerial: fixed)
    depth: float  # paint order: larger is nearer
    t0: float  # seconds
    duration: float
    start: tuple[float, float]  # (x, y) of the box's bottom centre at t0
    end: tuple[float, float]  # ... at t0 + duration


def crop_set_identities() -> list[dict[str, Any]]:
    """Test-split identities of the crop set the main job renders (``recipes/default.yaml``), with captions."""
    params = read_recipe("default")["synthetic"]
    plan = plan_identities(
        params["num_identities"],
        params["seed"],
        params.get("test_fraction", 0.25),
        params.get("ground_only_fraction", 0.2),
        params.get("aerial_only_fraction", 0.2),
    )
    per_view = params.get("test_images_per_view") or params.get("images_per_view", 2)
    views = {"ground": [GROUND], "aerial": [AERIAL], "both": [AERIAL, GROUND]}
    out = []
    for p in plan:
        if p["split"] != "test":
            continue
        captions = [
            c
            for v in views[p["views"]]
            for k in range(per_view)
            for c in image_captions(p["attributes"], params["seed"], p["id"], v, k)
        ]
        out.append({"id": p["id"], "attributes": p["attributes"], "captions": captions})
    return out


def _sprite(attrs: dict[str, Any], view: int, rng: np.random.Generator, size: tuple[int, int]) -> Sprite:
    """A rendered person cut to its mask's bounding box: (RGB float (h, w, 3), alpha float (h, w))."""
    image, mask = render_person_with_mask(attrs, view, rng, size)
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    window = np.s_[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    return np.asarray(image, dtype=np.float64)[window], mask[window].astype(np.float64)


def _ground_person(
    identity: int, sprites: list[Sprite], rng: np.random.Generator, size: tuple[int, int], duration: float
) -> Person:
    """A walker crossing the street sideways at a random depth (its height follows the depth)."""
    h, w = size
    depth = float(rng.uniform(0, 1))
    foot = h * (0.74 + 0.24 * depth)
    height = h * (0.3 + 0.42 * depth)
    cross = duration * float(rng.uniform(0.45, 0.8))
    margin = 0.3 * height
    x0, x1 = (-margin, w + margin) if rng.random() < 0.5 else (w + margin, -margin)
    t0 = float(rng.uniform(-0.15, 0.45)) * duration
    return Person(identity, sprites, height, depth, t0, cross, (x0, foot), (x1, foot))


def _border_point(
    rng: np.random.Generator, side: int, size: tuple[int, int], margin: float
) -> tuple[float, float]:
    h, w = size
    u = float(rng.uniform(0.15, 0.85))
    return [(u * w, -margin), (w + margin, u * h), (u * w, h + margin), (-margin, u * h)][side]


def _aerial_person(
    identity: int, sprites: list[Sprite], rng: np.random.Generator, size: tuple[int, int], duration: float
) -> Person:
    """A small walker crossing the drone's view from one border to the opposite one."""
    height = size[0] * float(rng.uniform(0.12, 0.18))
    side = int(rng.integers(4))
    start = _border_point(rng, side, size, 0.6 * height)
    end = _border_point(rng, (side + 2) % 4, size, 0.6 * height)
    cross = duration * float(rng.uniform(0.5, 0.85))
    t0 = float(rng.uniform(-0.1, 0.4)) * duration
    return Person(identity, sprites, height, float(rng.uniform(0, 1)), t0, cross, start, end)


def _place(person: Person, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(RGB, alpha, box x1 y1 x2 y2 floats) of ``person`` at time ``t``, or None off its path."""
    u = (t - person.t0) / person.duration
    if not 0 <= u <= 1:
        return None
    rgb, alpha = person.sprites[int((t - person.t0) / POSE_PERIOD_S) % len(person.sprites)]
    sh = max(2, round(person.height))
    sw = max(2, round(sh * rgb.shape[1] / rgb.shape[0]))
    x = person.start[0] + u * (person.end[0] - person.start[0])
    y = person.start[1] + u * (person.end[1] - person.start[1])
    box = np.array([round(x - sw / 2), round(y - sh), round(x - sw / 2) + sw, round(y)], dtype=np.float64)
    return resize_bilinear(rgb, sh, sw), resize_bilinear(alpha, sh, sw), box


def _composite(
    frame: np.ndarray, owner: np.ndarray, rgb: np.ndarray, alpha: np.ndarray, box: np.ndarray, label: int
) -> None:
    """Blend a placed sprite into ``frame`` (float, in place) and mark the pixels it covers in ``owner``."""
    h, w = frame.shape[:2]
    x1, y1, x2, y2 = (int(v) for v in box)
    fx1, fy1, fx2, fy2 = max(x1, 0), max(y1, 0), min(x2, w), min(y2, h)
    if fx1 >= fx2 or fy1 >= fy2:
        return
    a = alpha[fy1 - y1 : fy2 - y1, fx1 - x1 : fx2 - x1]
    src = rgb[fy1 - y1 : fy2 - y1, fx1 - x1 : fx2 - x1]
    region = frame[fy1:fy2, fx1:fx2]
    region[...] = src * a[..., None] + region * (1 - a[..., None])
    owner[fy1:fy2, fx1:fx2][a > 0.5] = label


def _gt_rows(frame_no: int, placed: list, owner: np.ndarray, size: tuple[int, int]) -> list[str]:
    """MOTChallenge rows of the people that are mostly inside the frame and mostly visible."""
    h, w = size
    rows = []
    for label, (person, (_, alpha, box)) in enumerate(placed):
        x1, y1, x2, y2 = box
        inside = (min(x2, w) - max(x1, 0)) * (min(y2, h) - max(y1, 0))
        if (
            min(x2, w) <= max(x1, 0)
            or min(y2, h) <= max(y1, 0)
            or inside < MIN_INSIDE * (x2 - x1) * (y2 - y1)
        ):
            continue
        if np.count_nonzero(owner == label) < MIN_VISIBLE * np.count_nonzero(alpha > 0.5):
            continue
        cx1, cy1, cx2, cy2 = max(x1, 0), max(y1, 0), min(x2, w), min(y2, h)
        rows.append(f"{frame_no},{person.identity},{cx1:g},{cy1:g},{cx2 - cx1:g},{cy2 - cy1:g},1,-1,-1,-1")
    return rows


def _frames(
    people: list[Person], background: np.ndarray, fps: float, n_frames: int, rng: np.random.Generator
):
    """Yield (uint8 RGB frame, MOTChallenge rows) for each frame."""
    size = background.shape[:2]
    for i in range(n_frames):
        t = i / fps
        frame = background.copy()
        owner = np.full(size, -1, dtype=np.int64)
        placed = [(p, pl) for p in sorted(people, key=lambda p: p.depth) if (pl := _place(p, t)) is not None]
        for label, (_, (rgb, alpha, box)) in enumerate(placed):
            _composite(frame, owner, rgb, alpha, box, label)
        frame += rng.normal(0, NOISE_STD, frame.shape)
        yield to_uint8(frame), _gt_rows(i + 1, placed, owner, size)


def _encode(path: Path, frames, fps: float, size: tuple[int, int], start: datetime) -> list[str]:
    """Write the frames as an MPEG-4 video (atomically); return the ground-truth rows."""
    rows: list[str] = []

    def write(tmp: Path) -> None:
        with av.open(str(tmp), "w", format="mp4") as container:
            container.metadata["creation_time"] = start.astimezone(timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%S.000000Z"
            )
            stream = container.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1001))
            stream.height, stream.width = size
            stream.pix_fmt = "yuv420p"
            stream.bit_rate = int(8 * size[0] * size[1] * fps / 4)  # ~1 bit a pixel: few artefacts
            stream.codec_context.thread_count = 1  # the same bytes on every machine
            for image, gt in frames:
                rows.extend(gt)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
            container.mux(stream.encode())

    write_with(path, write)
    return rows


def _camera_plan(ground: int, aerial: int) -> list[tuple[str, int]]:
    return [(f"ground-{i + 1:02d}", GROUND) for i in range(ground)] + [
        (f"aerial-{i + 1:02d}", AERIAL) for i in range(aerial)
    ]


def _start_text(moment: datetime, index: int) -> str:
    """ISO 8601 with a time zone; every other camera states its time in UTC+01:00 (same instant)."""
    zone = timezone(timedelta(hours=1)) if index % 2 else timezone.utc
    return moment.astimezone(zone).isoformat()


def render_footage(
    out: str | Path,
    *,
    seed: int = 0,
    ground_cameras: int = 2,
    aerial_cameras: int = 1,
    people: int = 8,
    people_per_camera: int = 4,
    seconds: float = 12.0,
    fps: float = 10.0,
    size: tuple[int, int] = (270, 480),
    poses: int = 2,
) -> FootageSet:
    """Render the synthetic footage into ``out`` (see the module docstring); ``size`` is (H, W), both even.

    ``people`` crop-set test identities walk through the footage, ``people_per_camera`` of them in each camera.
    """
    if size[0] % 2 or size[1] % 2 or min(size) < 16:
        raise ValueError(f"size must be two even numbers >= 16 (height, width), got {size!r}")
    if not 1 <= people_per_camera <= people or seconds <= 0 or fps <= 0 or poses < 1:
        raise ValueError("need 1 <= people_per_camera <= people, seconds > 0, fps > 0 and poses >= 1")
    root = Path(out)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    (root / "gt").mkdir(exist_ok=True)
    pool = crop_set_identities()
    chosen = [pool[int(i)] for i in np.random.default_rng([seed, 10]).permutation(len(pool))[:people]]
    n_frames = max(1, round(seconds * fps))
    videos, gts, entries, seen = [], [], [], {p["id"]: [] for p in chosen}
    for index, (camera, view) in enumerate(_camera_plan(ground_cameras, aerial_cameras)):
        rng = np.random.default_rng([seed, 11, index])
        cast = [chosen[int(i)] for i in rng.permutation(people)[:people_per_camera]]
        walkers = []
        for p in cast:
            sprite_size = (max(64, size[0]), max(32, size[0] // 2)) if view == GROUND else (128, 64)
            sprites = [_sprite(p["attributes"], view, rng, sprite_size) for _ in range(poses)]
            make = _ground_person if view == GROUND else _aerial_person
            walkers.append(make(p["id"], sprites, rng, size, seconds))
            seen[p["id"]].append(camera)
        background = (street_background if view == GROUND else terrain_background)(rng, *size)
        start = START + timedelta(seconds=CAMERA_OFFSET_S * index)
        video = root / "videos" / f"{camera}.mp4"
        rows = _encode(video, _frames(walkers, background, fps, n_frames, rng), fps, size, start)
        atomic_write(root / "gt" / f"{camera}.txt", "".join(r + "\n" for r in rows).encode())
        videos.append(video)
        gts.append(root / "gt" / f"{camera}.txt")
        entries.append(
            {
                "source": video.name,
                "camera": camera,
                "view": VIEW_NAMES[view],
                "start": _start_text(start, index),
                "name": f"synthetic {VIEW_NAMES[view]} camera",
            }
        )
    atomic_write(root / "cameras.yaml", yaml.safe_dump(entries, sort_keys=False).encode())
    identities = {str(p["id"]): {**p, "cameras": seen[p["id"]]} for p in chosen}
    atomic_write(root / "identities.json", (json.dumps(identities, indent=1) + "\n").encode())
    return FootageSet(root, videos, gts, root / "cameras.yaml", root / "identities.json")
