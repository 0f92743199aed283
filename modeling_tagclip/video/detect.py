"""Person detectors: the embedded weight-free motion detector, any local transformers detector, and boxes a user
already has (a MOTChallenge ``det.txt`` or JSON file).

Every detector maps a batch of H x W x 3 uint8 RGB images to one float32 ``(n, 5)`` array per image: ``x1, y1, x2,
y2, score`` in pixels, at most ``max_boxes`` rows (the highest scores), no non-finite rows, each box at least
``min_size`` pixels on its shorter side and clipped to the image.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from scipy import ndimage

from .frames import VideoError

__all__ = [
    "DetectionFile",
    "Detector",
    "DetectorError",
    "MotionDetector",
    "TransformersDetector",
    "bound",
    "load_detections",
    "load_detector",
]

PERSON_LABELS = ("person", "pedestrian", "people", "human")  # id2label names taken for the person class
PROMPT = "a person"  # what zero-shot detectors are asked for
THRESHOLDS = {"detection": 0.5, "zero-shot": 0.2}  # default score thresholds (zero-shot scores run lower)
EMPTY = np.zeros((0, 5), dtype=np.float32)
MAX_PARTS = 200  # foreground blobs the motion detector considers per frame (the largest)


class DetectorError(VideoError):
    """A detector or a detections file that cannot be used (one line naming it)."""


class DetectionFileError(DetectorError):
    """A detections file that cannot be read (names the file and the line or item)."""


class Detector(Protocol):
    name: str

    def __call__(self, images: Sequence[np.ndarray]) -> list[np.ndarray]: ...


def bound(
    boxes: Any, shape: tuple[int, ...], *, threshold: float, min_size: float, max_boxes: int
) -> np.ndarray:
    """``boxes`` (n, 5) made safe: non-finite rows dropped, boxes clipped to the image of ``shape``, those under
    ``threshold`` or with a side under ``min_size`` dropped, the ``max_boxes`` best kept (best first)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 5)
    boxes = boxes[np.isfinite(boxes).all(axis=1)]
    h, w = shape[:2]
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, w)
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, h)
    sides = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    boxes = boxes[(sides >= max(min_size, 1e-6)) & (boxes[:, 4] >= threshold)]
    order = np.argsort(-boxes[:, 4], kind="stable")[:max_boxes]
    return boxes[order].astype(np.float32)


class MotionDetector:
    """Background subtraction for FIXED cameras (no weights): anything that moves against the scene is a box.

    The scene is the per-pixel median of the last ``history`` frames and the current batch, on a copy of each
    frame shrunk to about ``work_side`` pixels on its long side. Pixels differing from it by more than
    ``difference`` (0-255, any channel) are foreground; small specks are opened away, nearby parts closed into
    one blob; each blob's box is a detection scored by how much of the box it fills. It cannot tell people from
    other moving things, does not work on a moving camera, misses a person who stands still for longer than
    the history, and merges people who overlap. The first batch of a source is its first scene model: give it
    several frames (``batch_size``).
    """

    name = "motion"

    def __init__(
        self,
        *,
        threshold: float = 0.3,
        min_size: int = 8,
        max_boxes: int = 100,
        batch_size: int = 8,
        history: int = 16,
        difference: float = 18.0,
        work_side: int = 320,
    ) -> None:
        self.threshold, self.min_size, self.max_boxes = threshold, min_size, max_boxes
        self.batch_size, self.difference, self.work_side = batch_size, difference, work_side
        self.history: deque[np.ndarray] = deque(maxlen=history)

    def reset(self) -> None:
        """Forget the scene (a new source)."""
        self.history.clear()

    def _factor(self, shape: tuple[int, ...]) -> int:
        return max(1, round(max(shape[:2]) / self.work_side))

    def _shrink(self, image: np.ndarray, k: int) -> np.ndarray:
        h, w = image.shape[0] // k * k, image.shape[1] // k * k
        return image[:h, :w].reshape(h // k, k, w // k, k, 3).mean(axis=(1, 3), dtype=np.float32)

    def __call__(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        start = 0
        while start < len(images):  # runs of one frame size: a new size is a new scene
            stop = start + 1
            while stop < len(images) and images[stop].shape == images[start].shape:
                stop += 1
            out += self._same_size(images[start:stop])
            start = stop
        return out

    def _same_size(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        k = self._factor(images[0].shape)
        small = [self._shrink(np.asarray(image), k) for image in images]
        if self.history and self.history[0].shape != small[0].shape:
            self.reset()
        scene = np.median(np.stack([*self.history, *small]), axis=0)
        self.history.extend(small)
        return [self._boxes(s, scene, k, image.shape) for s, image in zip(small, images, strict=True)]

    def _boxes(self, small: np.ndarray, scene: np.ndarray, k: int, shape: tuple[int, ...]) -> np.ndarray:
        mask = np.abs(small - scene).max(axis=2) > self.difference
        mask = ndimage.binary_opening(mask, iterations=1)
        mask = ndimage.binary_closing(mask, iterations=2)
        labels, _ = ndimage.label(mask)
        parts = [
            (xs.start, ys.start, xs.stop, ys.stop)
            for ys, xs in ndimage.find_objects(labels)
            if ys is not None
        ]
        rows = []
        for x1, y1, x2, y2 in _stack_parts(parts):
            fill = np.count_nonzero(mask[y1:y2, x1:x2]) / ((y2 - y1) * (x2 - x1))
            rows.append((x1 * k, y1 * k, x2 * k, y2 * k, fill))
        return bound(rows, shape, threshold=self.threshold, min_size=self.min_size, max_boxes=self.max_boxes)


def _stackable(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether box ``b`` sits above or below ``a``: over half the narrower width shared, a vertical gap under
    half the taller height."""
    overlap = min(a[2], b[2]) - max(a[0], b[0])
    gap = max(a[1], b[1]) - min(a[3], b[3])
    return overlap >= 0.5 * min(a[2] - a[0], b[2] - b[0]) and gap <= 0.5 * max(a[3] - a[1], b[3] - b[1])


def _stack_parts(boxes: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Join blobs stacked above one another (a person whose clothes match the scene in places falls apart
    into head, body and legs) until none are; only the ``MAX_PARTS`` largest blobs take part (a shaking
    camera makes thousands of specks)."""
    boxes = sorted(boxes, key=lambda b: -(b[2] - b[0]) * (b[3] - b[1]))[:MAX_PARTS]
    merged = True
    while merged:
        merged = False
        for i, j in itertools.combinations(range(len(boxes)), 2):
            if _stackable(boxes[i], boxes[j]):
                a, b = boxes[i], boxes.pop(j)
                boxes[i] = (min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))
                merged = True
                break
    return boxes


def _person_class(config: Any, spec: str) -> int:
    """The id of the person class in ``config.id2label``; a DetectorError when there is none."""
    labels = {int(i): str(name) for i, name in (getattr(config, "id2label", None) or {}).items()}
    for i, name in sorted(labels.items()):
        if name.strip().lower() in PERSON_LABELS:
            return i
    shown = ", ".join(list(labels.values())[:8]) + (", ..." if len(labels) > 8 else "")
    raise DetectorError(f"--detector {spec}: its id2label has no person class ({shown or 'no labels'})")


class TransformersDetector:
    """A transformers object detector (``AutoModelForObjectDetection``: DETR, RT-DETR, ...) keeping its person
    class, or a zero-shot one (``AutoModelForZeroShotObjectDetection``: OWLv2, Grounding DINO) asked for
    "a person"; ``batch_size`` frames a forward pass, on ``device``."""

    def __init__(
        self,
        spec: str,
        *,
        device: str = "cpu",
        threshold: float | None = None,
        min_size: int = 8,
        max_boxes: int = 100,
        batch_size: int = 8,
    ) -> None:
        import torch
        import transformers as tf
        from transformers.models.auto.modeling_auto import MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING_NAMES

        try:
            config = tf.AutoConfig.from_pretrained(spec)
        except (OSError, ValueError) as error:
            raise DetectorError(
                f"--detector {spec}: not a transformers checkpoint ({_first_line(error)})"
            ) from None
        self.zero_shot = config.model_type in MODEL_FOR_ZERO_SHOT_OBJECT_DETECTION_MAPPING_NAMES
        self.person = None if self.zero_shot else _person_class(config, spec)
        auto = tf.AutoModelForZeroShotObjectDetection if self.zero_shot else tf.AutoModelForObjectDetection
        try:
            self.model = auto.from_pretrained(spec).to(device).eval()
            self.processor = (tf.AutoProcessor if self.zero_shot else tf.AutoImageProcessor).from_pretrained(
                spec
            )
        except (OSError, ValueError) as error:
            raise DetectorError(
                f"--detector {spec}: cannot load it as a detector ({_first_line(error)})"
            ) from None
        self.name, self.device, self.torch = spec, device, torch
        if threshold is None:
            threshold = THRESHOLDS["zero-shot" if self.zero_shot else "detection"]
        self.threshold, self.min_size, self.max_boxes = threshold, min_size, max_boxes
        self.batch_size = batch_size

    def __call__(self, images: Sequence[np.ndarray]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for start in range(0, len(images), self.batch_size):
            out += self._batch(list(images[start : start + self.batch_size]))
        return out

    def _batch(self, images: list[np.ndarray]) -> list[np.ndarray]:
        sizes = [image.shape[:2] for image in images]
        if self.zero_shot:
            inputs = self.processor(text=[[PROMPT]] * len(images), images=images, return_tensors="pt")
        else:
            inputs = self.processor(images=images, return_tensors="pt")
        inputs = inputs.to(self.device)
        with self.torch.inference_mode():
            outputs = self.model(**inputs)
        results = self._post_process(outputs, inputs, sizes)
        return [
            bound(
                self._rows(result),
                size,
                threshold=self.threshold,
                min_size=self.min_size,
                max_boxes=self.max_boxes,
            )
            for result, size in zip(results, sizes, strict=True)
        ]

    def _post_process(self, outputs: Any, inputs: Any, sizes: list[tuple[int, int]]) -> list[dict]:
        if not self.zero_shot:
            return self.processor.post_process_object_detection(outputs, threshold=0.0, target_sizes=sizes)
        post = self.processor.post_process_grounded_object_detection
        extra = (
            {"input_ids": inputs["input_ids"]} if "input_ids" in inspect.signature(post).parameters else {}
        )
        return post(outputs, threshold=0.0, target_sizes=sizes, **extra)

    def _rows(self, result: dict) -> np.ndarray:
        boxes = result["boxes"].float().cpu().numpy().reshape(-1, 4)
        scores = result["scores"].float().cpu().numpy().reshape(-1, 1)
        rows = np.concatenate([boxes, scores], axis=1)
        if self.person is not None:
            rows = rows[result["labels"].cpu().numpy() == self.person]
        return rows


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_detector(
    spec: str | None,
    *,
    device: str = "cpu",
    threshold: float | None = None,
    min_size: int = 8,
    max_boxes: int = 100,
    batch_size: int = 8,
) -> Detector:
    """``None`` or ``"motion"``: the ``MotionDetector``; else a transformers checkpoint (folder or Hub id).
    ``threshold`` None: the detector's own default (motion 0.3, transformers 0.5, zero-shot 0.2)."""
    if max_boxes < 1 or batch_size < 1 or min_size < 0:
        raise DetectorError("max_boxes and batch_size must be >= 1 and min_size >= 0")
    options = {"min_size": min_size, "max_boxes": max_boxes, "batch_size": batch_size}
    if threshold is not None:
        options["threshold"] = threshold
    if spec is None or spec == "motion":
        return MotionDetector(**options)
    return TransformersDetector(spec, device=device, **options)


class DetectionFile:
    """Boxes a user already has, keyed by frame: ``boxes(frame_index)`` is the (n, 5) array of the source's
    0-based decoded frame ``frame_index`` (MOTChallenge frame ``frame_index + 1``)."""

    name = "detections"

    def __init__(self, path: Path, frames: dict[int, np.ndarray]) -> None:
        self.path, self.frames = path, frames

    def boxes(self, frame_index: int) -> np.ndarray:
        return self.frames.get(frame_index + 1, EMPTY)

    def __len__(self) -> int:
        return sum(len(b) for b in self.frames.values())


def _group(path: Path, rows: list[tuple[int, list[float]]]) -> DetectionFile:
    by_frame: dict[int, list[list[float]]] = {}
    for frame, row in rows:
        by_frame.setdefault(frame, []).append(row)
    return DetectionFile(
        path, {f: np.asarray(r, dtype=np.float32).reshape(-1, 5) for f, r in by_frame.items()}
    )


def _number(text: Any, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise DetectionFileError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise DetectionFileError(f"{where}: {text!r} is not a finite number")
    return value


def _frame(value: Any, where: str) -> int:
    number = _number(value, where)
    if number < 1 or number != int(number):
        raise DetectionFileError(
            f"{where}: frame {value!r} must be a whole number >= 1 (MOTChallenge numbering)"
        )
    return int(number)


def _mot_rows(path: Path, text: str) -> list[tuple[int, list[float]]]:
    """``frame,id,x,y,w,h,score[,...]`` lines (MOTChallenge det.txt; frames from 1)."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        fields = line.replace(" ", "").split(",")
        if len(fields) < 7:
            raise DetectionFileError(
                f"{where}: a MOTChallenge line needs frame,id,x,y,w,h,score; got {line!r}"
            )
        x, y, w, h, score = (_number(v, where) for v in fields[2:7])
        if w <= 0 or h <= 0:
            raise DetectionFileError(f"{where}: width and height must be > 0, got {w:g} x {h:g}")
        rows.append((_frame(fields[0], where), [x, y, x + w, y + h, score]))
    return rows


def _json_rows(path: Path, data: Any) -> list[tuple[int, list[float]]]:
    """A list of ``{"frame": N (from 1), "box": [x1, y1, x2, y2], "score": s}``."""
    if not isinstance(data, list):
        raise DetectionFileError(f"{path}: JSON detections must be a list of {{frame, box, score}} objects")
    rows = []
    for number, item in enumerate(data):
        where = f"{path}: item {number}"
        if not isinstance(item, dict) or not {"frame", "box"} <= set(item):
            raise DetectionFileError(f"{where}: needs 'frame' and 'box' ([x1, y1, x2, y2]), got {item!r}")
        box = item["box"]
        if not isinstance(box, list) or len(box) != 4:
            raise DetectionFileError(f"{where}: box must be [x1, y1, x2, y2], got {box!r}")
        x1, y1, x2, y2 = (_number(v, where) for v in box)
        if x2 <= x1 or y2 <= y1:
            raise DetectionFileError(f"{where}: box {box} has no area (x2 > x1 and y2 > y1 needed)")
        rows.append((_frame(item["frame"], where), [x1, y1, x2, y2, _number(item.get("score", 1.0), where)]))
    return rows


def load_detections(path: str | Path) -> DetectionFile:
    """Boxes from a MOTChallenge ``det.txt`` (``.txt``/``.csv``) or a JSON list of ``{frame, box, score}``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise DetectionFileError(f"--detections {path}: cannot read it ({_first_line(error)})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise DetectionFileError(f"{path}: not valid JSON ({error})") from None
        return _group(path, _json_rows(path, data))
    return _group(path, _mot_rows(path, text))
