"""Crop quality (known answers) and the K best crops per track with the drop rules."""

import numpy as np
import pytest

from modeling_tagclip.video.crops import BORDER_FACTOR, MARGIN, TrackCrops, crop_box, quality, sharpness
from modeling_tagclip.video.frames import Frame


def _stripes(h, w):
    image = np.zeros((h, w, 3), dtype=np.uint8)
    image[:, 1::2] = 255
    return image


def test_sharpness_known_answers():
    assert sharpness(np.full((10, 8, 3), 77, dtype=np.uint8)) == 0.0
    # per row, the Laplacian of 0,255,0,...,255 (edges repeated) is 255,-510,510,-510,510,-510,510,-255
    assert sharpness(_stripes(6, 8)) == pytest.approx((2 * 255**2 + 6 * 510**2) / 8)


def test_quality_size_score_and_border():
    image, frame = _stripes(64, 32), (480, 640, 3)
    inner = (100, 100, 132, 164)  # 64 px tall, far from the border
    full = quality(image, inner, 1.0, frame)
    v = sharpness(image)
    assert full == pytest.approx(np.cbrt(0.5 * v / (v + 100)))
    assert quality(image, (100, 100, 132, 228), 1.0, frame) == pytest.approx(
        full / np.cbrt(0.5)
    )  # 128 px tall
    assert quality(image, inner, 0.125, frame) == pytest.approx(full * 0.5)  # cube root of the score
    assert quality(image, (0, 100, 32, 164), 1.0, frame) == pytest.approx(full * BORDER_FACTOR)
    assert quality(image, (100, 100, 132, 479), 1.0, frame) == pytest.approx(
        BORDER_FACTOR * np.cbrt(min(1, 379 / 128) * v / (v + 100))
    )
    assert quality(np.full((64, 32, 3), 9, dtype=np.uint8), inner, 1.0, frame) == 0.0  # flat: no detail


def test_crop_box_rounds_clips_and_adds_margin():
    box, window = crop_box([10.4, -3, 30.6, 50.2], (60, 40, 3))
    assert box == (10, 0, 31, 50)
    pad = round(MARGIN * 50)
    assert window == np.s_[0 : min(60, 50 + pad), 10 - pad : min(40, 31 + pad)]


def _frame(index, image):
    return Frame(index=index, pts_seconds=index / 4, time=1000.0 + index / 4, image=image)


def test_k_best_crops_per_track():
    rng = np.random.default_rng(0)
    keeper = TrackCrops(k=2, min_frames=2, min_score=0.3, max_lost=1)
    heights = [40, 90, 60, 120, 20]  # track 1's box height per frame: the best two are frames 3 and 1
    image = rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)
    for i, h in enumerate(heights):
        frame = _frame(i, image.copy())
        finished = keeper.update(
            frame,
            [
                (1, np.array([50, 30, 90, 30 + h], dtype=float), 0.8),
                (2, np.array([200, 40, 230, 100], dtype=float), 0.1),
            ],
        )
        assert finished == []
        frame.image[:] = 0  # the decoder reuses its buffer: kept crops are copies
    assert keeper.update(_frame(5, image), []) == []  # unseen for 1 update: still open
    finished = keeper.update(_frame(6, image), [])  # unseen for 2 > max_lost: finished
    assert [t.id for t in finished] == [1]  # track 2's mean score 0.1 < 0.3: dropped
    track = finished[0]
    assert (track.t_start, track.t_end, track.length) == (1000.0, 1001.0, 5)
    assert track.mean_score == pytest.approx(0.8)
    assert [c.frame for c in track.crops] == [3, 1]
    assert track.crops[0].quality > track.crops[1].quality
    best = track.crops[0]
    assert best.box == (50, 30, 90, 150) and best.time == 1000.75 and best.score == pytest.approx(0.8)
    pad = round(MARGIN * 120)
    assert best.image.shape == (120 + 2 * pad, 40 + 2 * pad, 3)
    np.testing.assert_array_equal(best.image, image[30 - pad : 150 + pad, 50 - pad : 90 + pad])
    assert keeper.open == {}


def test_flush_and_min_frames():
    keeper = TrackCrops(k=3, min_frames=3, min_score=0.0, max_lost=30)
    image = _stripes(100, 100)
    for i in range(3):
        keeper.update(
            _frame(i, image),
            [(7, np.array([10, 10, 40, 80.0]), 0.9)]
            + ([(8, np.array([50, 10, 80, 80.0]), 0.9)] if i == 0 else []),
        )
    flushed = keeper.flush()
    assert [(t.id, t.length, len(t.crops)) for t in flushed] == [(7, 3, 3)]  # track 8: 1 frame < 3, dropped
    assert keeper.flush() == []


def test_bad_parameters():
    with pytest.raises(ValueError, match="k >= 1"):
        TrackCrops(k=0)
