"""Synthetic aerial-ground image re-ID set in CARGO's layout, rendered with ``modeling_tagclip.data.synthetic``'s people.

``{train,query,gallery}/Cam{c}/Cam{c}_{day|night}_{pid:04d}_{idx:04d}.jpg`` with CARGO's cameras: Cam1-5 aerial
(drones), Cam6-13 ground, so ``modeling_tagclip.data.reid.load_cargo`` (and every CARGO protocol) reads it as is.
Each identity gets ``aerial_per_id`` aerial and ``ground_per_id`` ground images on random cameras of the view.
Test identities put one aerial and one ground image in ``query`` and the rest in ``gallery``, so every query
has a same-view and a cross-view match on another camera. Deterministic given the seed.

Usage: ``generate_reid_dataset(out_dir)``; ``tagclip train --task reid`` renders it into
``data/synthetic_reid`` when absent.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modeling_tagclip.data.synthetic import render_person, sample_identities
from modeling_tagclip.flags import accept_both_spellings
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND
from modeling_tagclip.progress import Progress

__all__ = ["AERIAL_CAMERAS", "GROUND_CAMERAS", "generate_reid_dataset", "main"]

AERIAL_CAMERAS = (1, 2, 3, 4, 5)
GROUND_CAMERAS = (6, 7, 8, 9, 10, 11, 12, 13)
GENERATOR_VERSION = 2  # 2: people drawn by the numpy rasteriser (synthetic.GENERATOR_VERSION 2)


def _cameras(view: int, count: int, rng: np.random.Generator) -> list[int]:
    """`count` cameras of a view, distinct while possible (so same-camera filtering keeps matches)."""
    pool = AERIAL_CAMERAS if view == AERIAL else GROUND_CAMERAS
    replace = count > len(pool)
    return [int(c) for c in rng.choice(pool, size=count, replace=replace)]


def _identity_jobs(pid: int, split: str, aerial: int, ground: int, rng: np.random.Generator) -> list[dict]:
    """(split folder, camera, view, image index) of every image of one identity."""
    jobs = []
    for view, count in ((AERIAL, aerial), (GROUND, ground)):
        for k, camera in enumerate(_cameras(view, count, rng)):
            folder = split if split == "train" else ("query" if k == 0 else "gallery")
            jobs.append({"pid": pid, "folder": folder, "camera": camera, "view": view, "index": len(jobs)})
    return jobs


def generate_reid_dataset(
    out_dir: str | Path,
    num_identities: int = 200,
    seed: int = 0,
    image_size: tuple[int, int] = (128, 64),
    aerial_per_id: int = 3,
    ground_per_id: int = 3,
    test_fraction: float = 0.5,
    progress: bool = True,
) -> dict[str, Any]:
    """Render the set into `out_dir` and return image counts per folder."""
    if num_identities < 2 or aerial_per_id < 2 or ground_per_id < 2:
        raise ValueError("need >= 2 identities and >= 2 images per view and identity")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    out = Path(out_dir)
    rng = np.random.default_rng([seed, 10])
    people = sample_identities(num_identities, rng)
    n_test = min(max(1, round(num_identities * test_fraction)), num_identities - 1)
    counts: dict[str, int] = {"train": 0, "query": 0, "gallery": 0}
    jobs = []
    for pid in range(num_identities):
        split = "train" if pid < num_identities - n_test else "test"
        jobs += _identity_jobs(pid + 1, split, aerial_per_id, ground_per_id, rng)
    bar = Progress("rendering synthetic re-ID set", len(jobs), "image", enabled=progress)
    for job in jobs:
        image_rng = np.random.default_rng([seed, 11, job["pid"], job["index"]])
        time = "night" if image_rng.random() < 0.3 else "day"
        name = f"Cam{job['camera']}_{time}_{job['pid']:04d}_{job['index']:04d}.jpg"
        path = out / job["folder"] / f"Cam{job['camera']}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        render_person(people[job["pid"] - 1], job["view"], image_rng, image_size).save(path, quality=95)
        counts[job["folder"]] += 1
        bar.update()
    bar.close()
    info = {
        "generator": "modeling_tagclip.data.synthetic_reid",
        "version": GENERATOR_VERSION,
        "layout": "cargo",
        "cameras": {"aerial": list(AERIAL_CAMERAS), "ground": list(GROUND_CAMERAS)},
        "parameters": {
            "num_identities": num_identities,
            "seed": seed,
            "image_size": list(image_size),
            "aerial_per_id": aerial_per_id,
            "ground_per_id": ground_per_id,
            "test_fraction": test_fraction,
        },
        "counts": counts,
    }
    (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return counts


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-identities", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--aerial-per-id", type=int, default=3)
    p.add_argument("--ground-per-id", type=int, default=3)
    p.add_argument("--test-fraction", type=float, default=0.5)
    p.add_argument("--no-progress", action="store_true")
    return accept_both_spellings(p).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI entry point."""
    a = _parse_args(argv)
    counts = generate_reid_dataset(
        a.out,
        a.num_identities,
        a.seed,
        (a.height, a.width),
        a.aerial_per_id,
        a.ground_per_id,
        a.test_fraction,
        not a.no_progress,
    )
    print(json.dumps(counts))
    return counts
