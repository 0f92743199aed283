"""ByteTracker: ids on known paths, tentative tracks, the lost-track buffer, low-score recovery, and IDF1 on the
synthetic footage's ground truth with noise and dropped frames (motmetrics)."""

import numpy as np
import pytest

from modeling_tagclip.video.footage import render_footage
from modeling_tagclip.video.mot_eval import noisy_detections, read_gt, tracking_scores
from modeling_tagclip.video.track import ByteTracker, iou


def _box(x, y, w=20, h=40, score=0.9):
    return [x, y, x + w, y + h, score]


def _ids(tracker, rows):
    return {int(i): box for i, box, _ in tracker.update(np.array(rows, dtype=float).reshape(-1, 5))}


def test_iou_known_answers():
    np.testing.assert_allclose(
        iou([[0, 0, 10, 10]], [[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]]), [[1.0, 50 / 150, 0.0]]
    )


def test_two_walkers_who_cross_keep_their_ids():
    """One walks right, one left, one above the other: they pass each other; each keeps its id throughout."""
    tracker = ByteTracker()
    for t in range(30):
        found = _ids(tracker, [_box(10 + 6 * t, 50), _box(190 - 6 * t, 75)])
        assert set(found) == {1, 2}
        assert found[1][0] == pytest.approx(10 + 6 * t) and found[2][0] == pytest.approx(190 - 6 * t)


def test_a_one_frame_blip_gets_no_id():
    tracker = ByteTracker()
    assert set(_ids(tracker, [_box(10, 10)])) == {1}  # the first frame starts every track
    assert set(_ids(tracker, [_box(12, 10), _box(150, 10)])) == {1}  # the newcomer is tentative
    assert set(_ids(tracker, [_box(14, 10)])) == {1}  # ... and gone: never confirmed, no id used
    assert set(_ids(tracker, [_box(16, 10), _box(150, 60)])) == {1}
    assert set(_ids(tracker, [_box(18, 10), _box(152, 60)])) == {1, 2}  # seen twice: confirmed, the next id


def test_lost_buffer():
    tracker = ByteTracker(max_lost=3)
    for t in range(3):
        _ids(tracker, [_box(10 + 5 * t, 10)])
    for _ in range(3):
        assert _ids(tracker, []) == {}  # unseen for 3 frames: still kept
    assert set(_ids(tracker, [_box(40, 10)])) == {1}  # back where the velocity says: same id
    for _ in range(4):
        _ids(tracker, [])  # unseen for 4 > max_lost frames: dropped
    _ids(tracker, [_box(60, 10)])
    assert set(_ids(tracker, [_box(65, 10)])) == {2}


def test_low_scores_continue_tracks_but_start_none():
    tracker = ByteTracker(high=0.5, low=0.1)
    _ids(tracker, [_box(10, 10, score=0.9)])
    found = tracker.update(np.array([_box(12, 10, score=0.3), _box(150, 10, score=0.3)]))
    assert [(i, s) for i, _, s in found] == [(1, pytest.approx(0.3))]
    assert tracker.update(np.array([_box(151, 10, score=0.3)])) == []
    assert tracker.update(np.array([_box(14, 10, score=0.05)])) == []  # under low: ignored
    assert tracker.update(np.array([[np.nan, 0, 1, 1, 0.9]])) == []


def test_bad_parameters():
    with pytest.raises(ValueError, match="low <= high"):
        ByteTracker(high=0.2, low=0.5)


@pytest.fixture(scope="module")
def footage(tmp_path_factory):
    return render_footage(
        tmp_path_factory.mktemp("footage"),
        seed=2,
        ground_cameras=1,
        aerial_cameras=1,
        people=4,
        people_per_camera=3,
        seconds=6.0,
        fps=5.0,
        size=(96, 160),
    )


@pytest.mark.parametrize("camera", [0, 1])
def test_idf1_on_noisy_ground_truth(footage, camera):
    """Ground-truth boxes, each coordinate moved by 5% of the box size, 10% of the frames dropped whole:
    IDF1 >= 0.8 (motmetrics) on the ground and the aerial camera."""
    gt = read_gt(footage.gt[camera])
    frames = range(1, 31)
    detections = noisy_detections(gt, frames, np.random.default_rng(0), noise=0.05, drop=0.1)
    tracker = ByteTracker(max_lost=8)
    tracks = {f: [(i, box) for i, box, _ in tracker.update(detections[f])] for f in frames}
    scores = tracking_scores(gt, tracks, frames)
    assert scores["num_unique_objects"] == 3
    assert scores["idf1"] >= 0.8, scores
