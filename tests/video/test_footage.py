"""Synthetic footage: files, ground truth that matches the pixels, the camera file, determinism."""

import json
from datetime import datetime

import av
import numpy as np
import pytest

from modeling_tagclip.engine.config import read_recipe
from modeling_tagclip.video.cameras import read_cameras
from modeling_tagclip.video.footage import crop_set_identities, render_footage

TINY = {
    "ground_cameras": 1,
    "aerial_cameras": 1,
    "people": 3,
    "people_per_camera": 2,
    "seconds": 2.0,
    "fps": 5.0,
    "size": (64, 96),
}


@pytest.fixture(scope="module")
def footage(tmp_path_factory):
    return render_footage(tmp_path_factory.mktemp("footage"), seed=3, **TINY)


def _decode(path):
    with av.open(str(path)) as container:
        metadata = dict(container.metadata)
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)], metadata


def _gt(path):
    return np.loadtxt(path, delimiter=",", ndmin=2)


def test_videos_gt_and_cameras(footage):
    assert [v.name for v in footage.videos] == ["ground-01.mp4", "aerial-01.mp4"]
    cameras = read_cameras(footage.cameras)
    assert [(c.source, c.camera, c.view) for c in cameras] == [
        ("ground-01.mp4", "ground-01", "ground"),
        ("aerial-01.mp4", "aerial-01", "aerial"),
    ]
    identities = footage.identities.read_text()
    for video, gt_path, camera in zip(footage.videos, footage.gt, cameras, strict=True):
        frames, metadata = _decode(video)
        assert len(frames) == 10 and frames[0].shape == (64, 96, 3)
        created = datetime.fromisoformat(metadata["creation_time"].replace("Z", "+00:00"))
        assert created.timestamp() == camera.start  # the container and the camera file agree
        gt = _gt(gt_path)
        assert gt.shape[1] == 10 and set(gt[:, 6]) == {1} and set(gt[:, 7:].ravel()) == {-1}
        assert gt[:, 0].min() >= 1 and gt[:, 0].max() <= 10
        assert (
            (gt[:, 2] >= 0).all() and (gt[:, 2] + gt[:, 4] <= 96).all() and (gt[:, 3] + gt[:, 5] <= 64).all()
        )
        assert len(set(gt[:, 1])) == 2  # people_per_camera walkers, each with its own id
        for identity in set(gt[:, 1].astype(int)):
            assert f'"{identity}"' in identities


def test_gt_boxes_cover_the_people(footage):
    """Inside a ground-truth box the frame differs from the empty scene; the rest of the frame does not."""
    frames, _ = _decode(footage.videos[0])
    gt = _gt(footage.gt[0])
    stack = np.stack(frames).astype(np.float64)
    empty = np.median(stack, axis=0)  # people move, so the per-pixel median is the scene
    for row in gt:
        frame = stack[int(row[0]) - 1]
        x, y, w, h = (int(v) for v in row[2:6])
        diff = np.abs(frame - empty).sum(axis=2)
        inside = diff[y : y + h, x : x + w]
        assert (inside > 40).mean() > 0.15, row
    covered = np.zeros((len(frames), 64, 96), dtype=bool)
    for row in gt:
        x, y, w, h = (int(v) for v in row[2:6])
        covered[int(row[0]) - 1, max(0, y - 2) : y + h + 2, max(0, x - 2) : x + w + 2] = True
    outside = np.abs(stack - empty).sum(axis=3)[~covered]
    assert np.percentile(outside, 99) < 40


def test_identities_are_the_crop_sets_test_identities(footage):
    params = read_recipe("default")["synthetic"]
    n_test = round(params["num_identities"] * params["test_fraction"])
    pool = crop_set_identities()
    assert len(pool) == n_test and min(p["id"] for p in pool) == params["num_identities"] - n_test
    identities = json.loads(footage.identities.read_text())
    by_id = {str(p["id"]): p for p in pool}
    assert len(identities) == 3
    for key, entry in identities.items():
        assert entry["captions"] == by_id[key]["captions"] and len(entry["captions"]) >= 6
        assert set(entry["cameras"]) <= {"ground-01", "aerial-01"}


def test_deterministic_given_the_seed(footage, tmp_path):
    again = render_footage(tmp_path / "a", seed=3, **TINY)
    for first, second in zip(footage.videos + footage.gt, again.videos + again.gt, strict=True):
        assert first.read_bytes() == second.read_bytes()
    other = render_footage(tmp_path / "b", seed=4, **TINY)
    assert other.gt[0].read_bytes() != footage.gt[0].read_bytes()


def test_bad_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="even"):
        render_footage(tmp_path, size=(63, 96))
    assert not (tmp_path / "videos").exists()
