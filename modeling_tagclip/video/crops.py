"""Crop quality and the K best crops of each track.

A crop's quality is the geometric mean of three scores in [0, 1], halved when the box touches the frame's
border (the person is likely cut off there):

- size: the box height over ``FULL_HEIGHT`` (the model's input height), at most 1;
- sharpness: ``v / (v + SHARPNESS_HALF)`` where ``v`` is the variance of the Laplacian of the crop's grey levels;
- the detector's score.

``TrackCrops`` follows the tracker's output frame by frame and keeps, per track, only its ``k`` best crops
(copies), its first and last time, its length and mean score: memory stays flat however long the footage is.
A track unseen for more than ``max_lost`` frames is finished; finished tracks shorter than ``min_frames`` or
with a mean score under ``min_score`` are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import ndimage

__all__ = ["Crop", "Track", "TrackCrops", "crop_box", "quality"]

FULL_HEIGHT = 128  # pixels: a box this tall (the model's input height) gets full marks for size
SHARPNESS_HALF = 100.0  # Laplacian variance that scores 0.5 for sharpness
BORDER_PIXELS = 2  # a box this close to the frame's edge is cut at the border
BORDER_FACTOR = 0.5  # quality multiplier of a crop cut at the border
MARGIN = 0.08  # context around the box in a crop, as a share of the box height on each side


@dataclass
class Crop:
    frame: int  # Frame.index
    time: float  # UTC seconds
    box: tuple[int, int, int, int]  # x1 y1 x2 y2 of the detection, in frame pixels
    score: float  # detector score
    quality: float
    image: np.ndarray  # H x W x 3 uint8: the box plus MARGIN of context


@dataclass
class Track:
    id: int
    t_start: float
    t_end: float
    length: int = 0  # frames it was seen in
    score_sum: float = 0.0
    crops: list[Crop] = field(default_factory=list)  # best first
    last_seen: int = 0  # the update number it was last seen at

    @property
    def mean_score(self) -> float:
        return self.score_sum / self.length if self.length else 0.0


def sharpness(image: np.ndarray) -> float:
    """Variance of the Laplacian of the grey levels (0-255 scale)."""
    grey = np.asarray(image, dtype=np.float64).mean(axis=2)
    return float(ndimage.laplace(grey, mode="nearest").var())


def quality(image: np.ndarray, box: tuple[float, ...], score: float, frame_shape: tuple[int, ...]) -> float:
    """The crop quality of ``box`` (x1 y1 x2 y2; ``image`` is its pixels) in a frame of ``frame_shape``."""
    h, w = frame_shape[:2]
    x1, y1, x2, y2 = box
    size = min(1.0, (y2 - y1) / FULL_HEIGHT)
    v = sharpness(image)
    sharp = v / (v + SHARPNESS_HALF)
    value = float(np.cbrt(max(size, 0.0) * sharp * min(max(score, 0.0), 1.0)))
    cut = x1 <= BORDER_PIXELS or y1 <= BORDER_PIXELS or x2 >= w - BORDER_PIXELS or y2 >= h - BORDER_PIXELS
    return value * (BORDER_FACTOR if cut else 1.0)


def crop_box(box: Any, frame_shape: tuple[int, ...]) -> tuple[tuple[int, int, int, int], tuple[slice, slice]]:
    """The detection ``box`` rounded into the frame, and the window of the crop (the box and its margin)."""
    h, w = frame_shape[:2]
    x1, y1 = max(0, int(round(box[0]))), max(0, int(round(box[1])))
    x2, y2 = min(w, max(x1 + 1, int(round(box[2])))), min(h, max(y1 + 1, int(round(box[3]))))
    pad = int(round(MARGIN * (y2 - y1)))
    window = np.s_[max(0, y1 - pad) : min(h, y2 + pad), max(0, x1 - pad) : min(w, x2 + pad)]
    return (x1, y1, x2, y2), window


class TrackCrops:
    """Per track, the ``k`` best crops; ``update`` per frame returns the tracks that just finished, ``flush``
    the rest at the end of a source (both after the drop rules)."""

    def __init__(self, k: int = 3, min_frames: int = 3, min_score: float = 0.3, max_lost: int = 8) -> None:
        if k < 1 or min_frames < 1 or max_lost < 0:
            raise ValueError("need k >= 1, min_frames >= 1 and max_lost >= 0")
        self.k, self.min_frames, self.min_score, self.max_lost = k, min_frames, min_score, max_lost
        self.open: dict[int, Track] = {}
        self.updates = 0

    def _keep(self, track: Track) -> bool:
        return track.length >= self.min_frames and track.mean_score >= self.min_score

    def _add(self, track: Track, frame: Any, box: Any, score: float) -> None:
        rounded, window = crop_box(box, frame.image.shape)
        pixels = frame.image[rounded[1] : rounded[3], rounded[0] : rounded[2]]
        value = quality(pixels, rounded, score, frame.image.shape)
        if len(track.crops) == self.k and value <= track.crops[-1].quality:
            return  # not among the k best: nothing copied
        crop = Crop(frame.index, frame.time, rounded, float(score), value, frame.image[window].copy())
        track.crops = sorted([*track.crops, crop], key=lambda c: -c.quality)[: self.k]

    def update(self, frame: Any, tracks: Iterable[tuple[int, Any, float]]) -> list[Track]:
        """Add ``frame``'s tracked boxes (``(track id, box, score)``, the tracker's output); return the tracks
        unseen for more than ``max_lost`` updates, dropped ones left out."""
        self.updates += 1
        for track_id, box, score in tracks:
            track = self.open.get(track_id)
            if track is None:
                track = self.open[track_id] = Track(track_id, frame.time, frame.time)
            track.t_end, track.length, track.last_seen = frame.time, track.length + 1, self.updates
            track.score_sum += float(score)
            self._add(track, frame, box, float(score))
        finished = [t for t in self.open.values() if self.updates - t.last_seen > self.max_lost]
        for track in finished:
            del self.open[track.id]
        return [t for t in finished if self._keep(t)]

    def flush(self) -> list[Track]:
        """Finish every open track (the end of a source); dropped ones left out."""
        finished, self.open = list(self.open.values()), {}
        return [t for t in finished if self._keep(t)]
