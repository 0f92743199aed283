"""ByteTrack-style multi-object tracking (Zhang et al., 2022): one id per person per source.

Each frame, tracks predict their box with a constant-velocity Kalman filter on (centre x, centre y, aspect,
height). High-score detections are matched to all live and lost tracks by IoU (Hungarian,
``scipy.optimize``); the low-score ones then recover the live tracks the first pass left, so a person half
hidden keeps its id. Unmatched high-score detections start tentative tracks, which get an id when they are
matched again on the next frame (immediately on a tracker's first frame); the step between those two
sightings is the track's first velocity. A track unseen for more than ``max_lost`` frames is dropped.

Two changes from ByteTrack, for footage sampled at a few frames per second, where a small person moves
more than its own width between frames: IoU is taken between boxes grown by ``buffer`` on each side
(buffered IoU, as in C-BIoU), and a new track starts moving at once (two-point start) instead of at rest.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = ["ByteTracker", "iou"]

STD_POSITION = 1 / 20  # Kalman noise, relative to the box height (ByteTrack's values)
STD_VELOCITY = 1 / 160
TENTATIVE_BUFFER = 1.0  # a track seen once has no velocity yet: its next box is looked for this much wider


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU of (n, 4) and (m, 4) x1 y1 x2 y2 boxes: an (n, m) array."""
    a, b = np.asarray(a, dtype=np.float64).reshape(-1, 4), np.asarray(b, dtype=np.float64).reshape(-1, 4)
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area_a = np.prod(a[:, 2:] - a[:, :2], axis=1)
    area_b = np.prod(b[:, 2:] - b[:, :2], axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def _xyah(box: np.ndarray) -> np.ndarray:
    w, h = box[2] - box[0], box[3] - box[1]
    return np.array([box[0] + w / 2, box[1] + h / 2, w / max(h, 1e-6), h])


class _Kalman:
    """Constant-velocity Kalman filter on (x, y, a, h) and their velocities."""

    F = np.eye(8) + np.eye(8, k=4)
    H = np.eye(4, 8)

    def __init__(self, box: np.ndarray) -> None:
        self.mean = np.r_[_xyah(box), np.zeros(4)]
        h = self.mean[3]
        std = [
            2 * STD_POSITION * h,
            2 * STD_POSITION * h,
            1e-2,
            2 * STD_POSITION * h,
            10 * STD_VELOCITY * h,
            10 * STD_VELOCITY * h,
            1e-5,
            10 * STD_VELOCITY * h,
        ]
        self.cov = np.diag(np.square(std))

    def predict(self) -> None:
        h = self.mean[3]
        std = [
            STD_POSITION * h,
            STD_POSITION * h,
            1e-2,
            STD_POSITION * h,
            STD_VELOCITY * h,
            STD_VELOCITY * h,
            1e-5,
            STD_VELOCITY * h,
        ]
        self.mean = self.F @ self.mean
        self.cov = self.F @ self.cov @ self.F.T + np.diag(np.square(std))

    def update(self, box: np.ndarray) -> None:
        h = self.mean[3]
        noise = np.diag(np.square([STD_POSITION * h, STD_POSITION * h, 1e-1, STD_POSITION * h]))
        innovation_cov = self.H @ self.cov @ self.H.T + noise
        gain = np.linalg.solve(innovation_cov, self.H @ self.cov).T
        self.mean = self.mean + gain @ (_xyah(box) - self.H @ self.mean)
        self.cov = self.cov - gain @ innovation_cov @ gain.T

    def box(self) -> np.ndarray:
        x, y, a, h = self.mean[:4]
        w = a * h
        return np.array([x - w / 2, y - h / 2, x + w / 2, y + h / 2])


class _Track:
    def __init__(self, box: np.ndarray, score: float) -> None:
        self.kalman, self.box, self.score = _Kalman(box), box, score
        self.id: int | None = None  # given when confirmed
        self.lost = 0  # frames since the last match

    def hit_again(self, box: np.ndarray, score: float) -> None:
        """The second sighting (two-point start): the filter restarts there, moving by the centre's step."""
        step = _xyah(box) - _xyah(self.box)
        self.kalman = _Kalman(box)
        self.kalman.mean[4:6] = step[:2]
        self.box, self.score, self.lost = box, score, 0

    def hit(self, box: np.ndarray, score: float) -> None:
        self.kalman.update(box)
        self.box, self.score, self.lost = box, score, 0


def _grow(boxes: np.ndarray, buffer: float) -> np.ndarray:
    """Boxes widened by ``buffer`` times their width and height on each side."""
    pad = (boxes[:, 2:4] - boxes[:, :2]) * buffer
    return np.concatenate([boxes[:, :2] - pad, boxes[:, 2:4] + pad], axis=1)


def _match(
    tracks: list[_Track], boxes: np.ndarray, min_iou: float, buffer: float
) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Hungarian matching on 1 - buffered IoU (both boxes grown by ``buffer``, so a small fast person still
    overlaps its prediction) of predicted track boxes and detections: (pairs, unmatched tracks, unmatched
    detections); a pair needs a buffered IoU >= ``min_iou``."""
    if not tracks or not len(boxes):
        return [], list(range(len(tracks))), list(range(len(boxes)))
    predicted = np.stack([t.kalman.box() for t in tracks])
    overlap = iou(_grow(predicted, buffer), _grow(boxes[:, :4], buffer))
    rows, cols = linear_sum_assignment(1 - overlap)
    pairs = [(r, c) for r, c in zip(rows, cols, strict=True) if overlap[r, c] >= min_iou]
    matched_tracks, matched_boxes = {r for r, _ in pairs}, {c for _, c in pairs}
    return (
        pairs,
        [i for i in range(len(tracks)) if i not in matched_tracks],
        [j for j in range(len(boxes)) if j not in matched_boxes],
    )


class ByteTracker:
    """``update(detections)`` per frame, in order: ``detections`` is (n, 5) x1 y1 x2 y2 score; returns the
    confirmed tracks matched in this frame as ``(track id, box, score)``; ids count from 1."""

    def __init__(
        self,
        *,
        high: float = 0.5,
        low: float = 0.1,
        match_iou: float = 0.3,
        max_lost: int = 30,
        buffer: float = 0.3,
    ) -> None:
        if not 0 <= low <= high or not 0 < match_iou <= 1 or max_lost < 0 or buffer < 0:
            raise ValueError("need 0 <= low <= high, 0 < match_iou <= 1, max_lost >= 0 and buffer >= 0")
        self.high, self.low, self.match_iou, self.max_lost = high, low, match_iou, max_lost
        self.buffer = buffer
        self.tracks: list[_Track] = []  # confirmed, live or lost
        self.tentative: list[_Track] = []  # seen once
        self.next_id = 1
        self.frames = 0

    def _confirm(self, track: _Track) -> None:
        track.id, self.next_id = self.next_id, self.next_id + 1
        self.tracks.append(track)

    def update(self, detections: np.ndarray) -> list[tuple[int, np.ndarray, float]]:
        dets = np.asarray(detections, dtype=np.float64).reshape(-1, 5)
        dets = dets[np.isfinite(dets).all(axis=1) & (dets[:, 4] >= self.low)]
        high, low = dets[dets[:, 4] >= self.high], dets[dets[:, 4] < self.high]
        for track in self.tracks + self.tentative:
            track.kalman.predict()
        matched: list[_Track] = []
        # 1. high-score detections against every confirmed track, live or lost
        pairs, left, new = _match(self.tracks, high, self.match_iou, self.buffer)
        for t, d in pairs:
            self.tracks[t].hit(high[d, :4], float(high[d, 4]))
            matched.append(self.tracks[t])
        # 2. low-score detections recover the tracks that were live last frame (a stricter overlap)
        live = [self.tracks[t] for t in left if self.tracks[t].lost == 0]
        pairs, _, _ = _match(live, low, max(self.match_iou, 0.5), self.buffer)
        for t, d in pairs:
            live[t].hit(low[d, :4], float(low[d, 4]))
            matched.append(live[t])
        # 3. the rest of the high-score detections confirm tentative tracks, or start them
        rest = high[new]
        pairs, _, unused = _match(self.tentative, rest, self.match_iou, self.buffer + TENTATIVE_BUFFER)
        for t, d in pairs:
            self.tentative[t].hit_again(rest[d, :4], float(rest[d, 4]))
            self._confirm(self.tentative[t])
            matched.append(self.tentative[t])
        self.tentative = [_Track(rest[d, :4], float(rest[d, 4])) for d in unused]
        if self.frames == 0:  # nothing to confirm against on the first frame: every person starts now
            for track in self.tentative:
                self._confirm(track)
                matched.append(track)
            self.tentative = []
        self.frames += 1
        for track in self.tracks:
            if track not in matched:
                track.lost += 1
        self.tracks = [t for t in self.tracks if t.lost <= self.max_lost]
        return [(t.id, t.box.copy(), t.score) for t in matched]
