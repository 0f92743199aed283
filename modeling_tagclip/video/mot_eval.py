"""Detection and tracking scores against MOTChallenge ground truth, computed by py-motmetrics (``motmetrics``,
MIT; in the ``video`` extra): detection recall and precision at IoU 0.5, and IDF1, MOTA and ID switches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

__all__ = ["GroundTruth", "detection_scores", "noisy_detections", "read_gt", "tracking_scores"]

GroundTruth = dict[int, tuple[np.ndarray, np.ndarray]]  # MOT frame -> (ids (n,), boxes x1 y1 x2 y2 (n, 4))
MAX_DISTANCE = 0.5  # 1 - IoU: a match needs IoU >= 0.5


def read_gt(path: str | Path) -> GroundTruth:
    """MOTChallenge ``frame,id,x,y,w,h,...`` rows by frame (frames from 1)."""
    rows = np.loadtxt(path, delimiter=",", ndmin=2)
    out: GroundTruth = {}
    for frame in np.unique(rows[:, 0]).astype(int) if len(rows) else []:
        sel = rows[rows[:, 0] == frame]
        out[int(frame)] = (sel[:, 1].astype(int), np.column_stack([sel[:, 2:4], sel[:, 2:4] + sel[:, 4:6]]))
    return out


def _xywh(boxes: np.ndarray) -> np.ndarray:
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    return np.column_stack([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]])


def _distances(objects: np.ndarray, hypotheses: np.ndarray) -> np.ndarray:
    """motmetrics' IoU distance matrix (``mm.distances.iou_matrix`` calls ``np.asfarray``, gone in numpy 2):
    1 - IoU by ``mm.distances.boxiou``, NaN (no pairing) above ``MAX_DISTANCE``."""
    import motmetrics as mm

    if not len(objects) or not len(hypotheses):
        return np.empty((len(objects), len(hypotheses)))
    distance = 1 - mm.distances.boxiou(objects[:, None], hypotheses[None, :])
    return np.where(distance > MAX_DISTANCE, np.nan, distance)


def _accumulate(
    gt: GroundTruth, hypotheses: Mapping[int, tuple[Iterable[int], np.ndarray]], frames: Iterable[int]
):
    import motmetrics as mm

    acc = mm.MOTAccumulator(auto_id=False)
    empty = (np.zeros(0, dtype=int), np.zeros((0, 4)))
    for frame in frames:
        gt_ids, gt_boxes = gt.get(frame, empty)
        hyp_ids, hyp_boxes = hypotheses.get(frame, empty)
        distances = _distances(_xywh(gt_boxes), _xywh(hyp_boxes))
        acc.update(list(gt_ids), list(hyp_ids), distances, frameid=frame)
    return acc


def _summary(acc, metrics: list[str]) -> dict[str, float]:
    import motmetrics as mm

    row = mm.metrics.create().compute(acc, metrics=metrics, name="all")
    return {name: float(row[name].iloc[0]) for name in metrics}


def detection_scores(
    gt: GroundTruth, detections: Mapping[int, np.ndarray], frames: Iterable[int]
) -> dict[str, float]:
    """Recall and precision at IoU 0.5 of per-frame boxes (x1 y1 x2 y2 [score]) over ``frames`` (MOT numbering)."""
    hyps, next_id = {}, 0
    for frame, boxes in detections.items():
        boxes = np.asarray(boxes).reshape(-1, np.asarray(boxes).shape[-1] if np.size(boxes) else 4)[:, :4]
        hyps[frame] = (list(range(next_id, next_id + len(boxes))), boxes)
        next_id += len(boxes)
    return _summary(
        _accumulate(gt, hyps, frames), ["recall", "precision", "num_objects", "num_false_positives"]
    )


def tracking_scores(
    gt: GroundTruth, tracks: Mapping[int, list[tuple[int, np.ndarray]]], frames: Iterable[int]
) -> dict[str, float]:
    """IDF1, MOTA, ID switches (and recall, precision) of per-frame ``(track id, box)`` lists over ``frames``."""
    hyps = {
        f: ([i for i, _ in items], np.asarray([b[:4] for _, b in items]).reshape(-1, 4))
        for f, items in tracks.items()
    }
    metrics = ["idf1", "mota", "num_switches", "recall", "precision", "num_unique_objects"]
    return _summary(_accumulate(gt, hyps, frames), metrics)


def noisy_detections(
    gt: GroundTruth,
    frames: Iterable[int],
    rng: np.random.Generator,
    *,
    noise: float = 0.05,
    drop: float = 0.1,
    scores: tuple[float, float] = (0.5, 1.0),
) -> dict[int, np.ndarray]:
    """Ground-truth boxes as a detector's output: each coordinate moved by ``noise`` x the box's width or height
    (Gaussian), each frame dropped whole with probability ``drop``, scores uniform in ``scores``."""
    out = {}
    empty = (np.zeros(0, dtype=int), np.zeros((0, 4)))
    for frame in frames:
        boxes = gt.get(frame, empty)[1]
        if rng.random() < drop:
            boxes = boxes[:0]
        size = np.tile(boxes[:, 2:] - boxes[:, :2], 2)
        moved = boxes + rng.normal(0, noise, boxes.shape) * size
        out[frame] = np.column_stack([moved, rng.uniform(*scores, len(boxes))])
    return out
