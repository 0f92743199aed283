"""``tagclip ingest``: footage -> frames -> detector (batched) -> tracker -> the K best crops of each finished
track -> crop files + ``manifest.csv`` -> the gallery.

A source is committed as a unit: its crops are written to a hidden ``.partial-*`` folder with ``crops.json``
(the unit's manifest rows and the source's fingerprint), which is renamed into place in one step; then the
manifest is rewritten, the gallery indexes what it lacks and ``ingest_state.json`` marks the source done. A re-run
after a kill at any point finishes a renamed unit from its ``crops.json`` or redoes the source (decoding is
deterministic), so the gallery equals that of an uninterrupted run. A live stream commits a unit every
``flush_seconds`` of footage, so it lands in the gallery as it goes, and reconnects with backoff when it drops.

Test hook: ``TAGCLIP_INGEST_KILL_AT=STAGE`` (one of ``KILL_STAGES``) kills the process with SIGKILL there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from modeling_tagclip.progress import Progress, main_process

from .cameras import Camera, camera_for, read_cameras
from .frames import Frame, Source, VideoError, container_start, iter_frames
from .gallery import GalleryTarget, add_to_gallery
from .manifest import replace_rows
from .state import KILL_ENV, KILL_STAGES, IngestState, checkpoint, fingerprint

__all__ = ["KILL_ENV", "KILL_STAGES", "IngestOptions", "Ingest", "bounded_boxes", "checkpoint"]

UNIT_FILE = "crops.json"


@dataclass(frozen=True)
class IngestOptions:
    crops: Path  # the crops folder (the gallery's image root)
    target: GalleryTarget
    cameras: Path | None = None
    fps: float = 4.0
    frame_rate: float = 1.0  # frames per second of a frame folder
    crops_per_track: int = 3
    min_track_frames: int = 3
    min_track_score: float = 0.3
    max_lost: int = 8  # sampled frames a track may go unseen before it is finished
    batch_size: int = 8
    max_boxes: int = 100
    reconnect: int = 3
    backoff_s: float = 1.0
    duration: float | None = None  # seconds of footage per source (streams: stop after it)
    max_frames: int | None = None  # sampled frames per source
    flush_seconds: float = 30.0
    stall_timeout: float = 10.0  # seconds a stream may send nothing before it counts as dropped


@dataclass
class Summary:
    sources: int = 0
    skipped: int = 0
    tracks: int = 0
    crops: int = 0
    failed: list[str] = field(default_factory=list)


def bounded_boxes(boxes: Any, limit: int) -> np.ndarray:
    """A detector's (n, 5) output made safe: non-finite rows and boxes without area dropped, at most ``limit``
    kept by score."""
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 5)
    keep = np.isfinite(boxes).all(axis=1) & (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    boxes = boxes[keep]
    if len(boxes) > limit:
        boxes = boxes[np.argsort(-boxes[:, 4], kind="stable")[:limit]]
    return boxes


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "source"


def _iso(seconds: float) -> str:
    return (
        datetime.fromtimestamp(seconds, timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _batches(frames: Iterable[Frame], size: int) -> Iterator[list[Frame]]:
    batch: list[Frame] = []
    for frame in frames:
        batch.append(frame)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Ingest:
    """One ``tagclip ingest`` run: ``run(sources)`` ingests each source (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        detector_for: Callable[[Source], Any],
        options: IngestOptions,
        say: Callable[[str], None] | None = None,
    ):
        """``detector_for(source)``: the detector of a source (a ``Detector``, or boxes keyed by frame)."""
        self.model, self.processor, self.detector_for, self.options = model, processor, detector_for, options
        self.say = say or (lambda line: print(f"tagclip ingest: {line}", file=sys.stderr))
        self.crops = Path(options.crops)
        self.cameras: list[Camera] | None = read_cameras(options.cameras) if options.cameras else None

    # -- the run -------------------------------------------------------------------------------------------

    def run(self, sources: list[Source]) -> Summary:
        """Ingest ``sources`` in order; a source that cannot be read is reported in one line and skipped."""
        where = (
            {s.location: camera_for(s, self.cameras, self.options.cameras) for s in sources}
            if self.cameras
            else {}
        )
        summary = Summary()
        self.crops.mkdir(parents=True, exist_ok=True)
        self.state = IngestState(self.crops)
        self._finish_renamed()
        for source in sources:
            try:
                self._source(source, where.get(source.location), summary)
            except VideoError as error:
                summary.failed.append(str(error))
                self.say(f"error: {error}")
        return summary

    def _source(self, source: Source, camera: Camera | None, summary: Summary) -> None:
        entry, print_ = self.state.get(source.location), fingerprint(source)
        if source.kind != "stream" and entry.get("status") == "done":
            summary.skipped += 1
            same = entry.get("fingerprint") == print_
            self.say(
                f"{source.location}: already ingested, nothing added"
                if same
                else f"{source.location}: changed since it was ingested; skipped (ingest it under a new name)"
            )
            return
        name = camera.camera if camera else source.stem
        folder = f"{_safe(name)}/{_safe(source.stem)}"
        owner = self.state.folder_owner(folder)
        if owner not in (None, source.location):
            raise VideoError(f"{source.location}: its crops folder {folder} already holds {owner}")
        start, how = (camera.start, "the camera file") if camera and camera.start is not None else (None, "")
        if start is None:
            start, how = container_start(source)
            self.say(f"{source.location}: times count from {how} ({_iso(start)})")
        run = _SourceRun(self, source, name, camera.view if camera else None, folder, print_, entry)
        summary.sources += 1
        if source.kind == "stream":
            run.stream(start)
        else:
            run.file(start)
        summary.tracks += run.tracks
        summary.crops += run.crops

    # -- committing ----------------------------------------------------------------------------------------

    def commit(self, tmp: Path, final: Path, unit: dict[str, Any]) -> None:
        """Put the unit in ``tmp`` in place at ``final`` (one rename), then finish it."""
        (tmp / UNIT_FILE).write_text(json.dumps(unit), encoding="utf-8")
        checkpoint("crops")
        if final.exists():  # a unit of the same source that a kill left before its state was written
            shutil.rmtree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, final)
        checkpoint("move")
        self.finish(final, unit)

    def finish(self, final: Path, unit: dict[str, Any]) -> None:
        """Manifest, gallery, state of a unit already in place (idempotent)."""
        folder = final.relative_to(self.crops).as_posix()
        replace_rows(self.crops, folder, unit["rows"])
        checkpoint("manifest")
        add_to_gallery(self.model, self.processor, self.crops, self.options.target)
        checkpoint("state")
        entry = self.state.get(unit["source"])
        before = entry if unit["stream"] else {}  # a stream's parts add up; a file has one unit
        self.state.update(
            unit["source"],
            fingerprint=unit["fingerprint"],
            folder=unit["folder"],
            status=unit["status"],
            camera=unit["camera"],
            next_track=unit["next_track"],
            units=sorted({*entry.get("units", []), folder}),
            tracks=before.get("tracks", 0) + unit["tracks"],
            crops=before.get("crops", 0) + len(unit["rows"]),
            gaps=before.get("gaps", []) + unit["gaps"],
        )

    def _finish_renamed(self) -> None:
        """Units a kill left renamed but not finished (their ``crops.json`` is in place, the state lags)."""
        for unit_file in sorted(self.crops.glob(f"**/{UNIT_FILE}")):
            if any(part.startswith(".") for part in unit_file.relative_to(self.crops).parts):
                continue
            unit = json.loads(unit_file.read_text(encoding="utf-8"))
            folder = unit_file.parent.relative_to(self.crops).as_posix()
            if folder not in self.state.get(unit["source"]).get("units", []):
                self.say(f"{unit['source']}: finishing {folder}, which an interrupted run left")
                self.finish(unit_file.parent, unit)


class _SourceRun:
    """Frames of one source through the detector, the tracker and the crop keeper into committed units."""

    def __init__(
        self,
        ingest: Ingest,
        source: Source,
        camera: str,
        view: str | None,
        folder: str,
        print_: dict,
        entry: dict,
    ):
        from .crops import TrackCrops
        from .track import ByteTracker

        self.ingest, self.options, self.source = ingest, ingest.options, source
        self.detector = ingest.detector_for(source)
        self.camera, self.view, self.folder, self.print_ = camera, view, folder, print_
        self.new_tracker = lambda: ByteTracker(max_lost=self.options.max_lost)  # both end a track alike
        self.new_keeper = lambda: TrackCrops(
            k=self.options.crops_per_track,
            min_frames=self.options.min_track_frames,
            min_score=self.options.min_track_score,
            max_lost=self.options.max_lost,
        )
        self.tracker, self.keeper, self.connection = self.new_tracker(), self.new_keeper(), 0
        self.numbers: dict[
            tuple[int, int], int
        ] = {}  # (connection, tracker id) -> this source's track number
        self.next_track = int(entry.get("next_track", 1))
        self.unit_number = len(entry.get("units", []))
        self.tracks = self.crops = 0
        self.gaps: list[list[float]] = []
        key = hashlib.sha256(folder.encode()).hexdigest()[:12]
        self.tmp = ingest.crops / f".partial-{key}"

    # -- files and frame folders --------------------------------------------------------------------------

    def file(self, start: float) -> None:
        final = self.ingest.crops / self.folder
        self._fresh_tmp()
        rows = self._track(self._frames(start))
        self._commit(final, rows, status="done")

    # -- live streams -------------------------------------------------------------------------------------

    def stream(self, start: float) -> None:
        """Read the stream until ``duration`` / ``max_frames`` or until it is gone after ``reconnect`` tries;
        a unit is committed every ``flush_seconds`` of footage and at the end."""
        self._fresh_tmp()
        began, seen, tries, dropped = time.monotonic(), 0, 0, None
        rows: list[dict] = []
        while True:
            connected = time.time()
            try:
                for _ in self._track_frames(self._frames(connected), rows):
                    seen += 1
                    if dropped is not None:
                        self.gaps.append([dropped, connected])
                        self.ingest.say(
                            f"{self.source.location}: back after a gap of {connected - dropped:.1f} s"
                        )
                    dropped, tries = None, 0
                    if self._stop(began, seen):
                        break
            except VideoError as error:
                self.ingest.say(f"{self.source.location}: stream dropped ({error})")
            if self._stop(began, seen) or tries >= self.options.reconnect:
                break
            dropped = dropped or time.time()
            tries += 1
            wait = min(self.options.backoff_s * 2 ** (tries - 1), 30.0)
            self.ingest.say(
                f"{self.source.location}: reconnecting in {wait:g} s (try {tries} of "
                f"{self.options.reconnect})"
            )
            time.sleep(wait)
        rows += self._rows(self.keeper.flush())
        self._commit_unit(rows, status="ended")
        if tries >= self.options.reconnect and not self._stop(began, seen):
            self.ingest.say(
                f"{self.source.location}: gone after {self.options.reconnect} reconnect tries; stopped"
            )

    def _stop(self, began: float, seen: int) -> bool:
        limit = self.options.duration
        return (limit is not None and time.monotonic() - began >= limit) or (
            self.options.max_frames is not None and seen >= self.options.max_frames
        )

    def _track_frames(self, frames: Iterable[Frame], rows: list[dict]) -> Iterator[Frame]:
        """A stream connection's frames through a fresh tracker; finished tracks are committed as a unit every
        ``flush_seconds`` of footage."""
        self._reset_detector()
        self.tracker, self.connection = self.new_tracker(), self.connection + 1
        last_flush = None
        for batch in _batches(frames, self.options.batch_size):
            for frame, boxes in zip(batch, self._detect(batch), strict=True):
                rows += self._rows(self.keeper.update(frame, self._ids(self.tracker.update(boxes))))
                last_flush = frame.time if last_flush is None else last_flush
                if frame.time - last_flush >= self.options.flush_seconds and rows:
                    self._commit_unit(rows, status="streaming")
                    rows.clear()
                    last_flush = frame.time
                yield frame
        rows += self._rows(self.keeper.flush())  # a connection's tracks end with it
        self.keeper = self.new_keeper()

    def _commit_unit(self, rows: list[dict], status: str) -> None:
        self.unit_number += 1
        final = self.ingest.crops / self.folder / f"{self.unit_number:05d}"
        self._commit(final, list(rows), status)
        self._fresh_tmp()

    # -- the stages ---------------------------------------------------------------------------------------

    def _frames(self, start: float) -> Iterator[Frame]:
        frames = iter_frames(
            self.source,
            self.options.fps,
            start,
            frame_rate=self.options.frame_rate,
            timeout=self.options.stall_timeout,
            warn=lambda line: self.ingest.say(line),
        )
        with Progress(f"tracking {self.source.location}", None, "frame", enabled=main_process()) as bar:
            for n, frame in enumerate(frames):
                if self.options.max_frames is not None and n >= self.options.max_frames:
                    return
                if self.options.duration is not None and frame.pts_seconds >= self.options.duration:
                    return
                yield frame
                bar.update()

    def _reset_detector(self) -> None:
        """A new background for a detector that keeps one per source (the motion detector)."""
        reset = getattr(self.detector, "reset", None)
        if reset is not None:
            reset()

    def _detect(self, batch: list[Frame]) -> list[np.ndarray]:
        detector = self.detector
        if hasattr(detector, "boxes"):  # boxes a user already has, keyed by frame
            found = [detector.boxes(frame.index) for frame in batch]
        else:
            found = detector([frame.image for frame in batch])
        return [bounded_boxes(boxes, self.options.max_boxes) for boxes in found]

    def _ids(self, tracks: list[tuple[int, np.ndarray, float]]) -> list[tuple[int, np.ndarray, float]]:
        """Tracker ids -> this source's track numbers (a stream's keep counting across connections and runs)."""
        return [(self._number(track_id), box, score) for track_id, box, score in tracks]

    def _number(self, track_id: int) -> int:
        key = (self.connection, track_id)
        if key not in self.numbers:
            self.numbers[key] = self.next_track
            self.next_track += 1
        return self.numbers[key]

    def _track(self, frames: Iterable[Frame]) -> list[dict]:
        """A file's or frame folder's frames through the detector, the tracker and the crop keeper: the rows of
        its kept crops (written into the unit being built)."""
        self._reset_detector()
        rows: list[dict] = []
        for batch in _batches(frames, self.options.batch_size):
            for frame, boxes in zip(batch, self._detect(batch), strict=True):
                rows += self._rows(self.keeper.update(frame, self._ids(self.tracker.update(boxes))))
            checkpoint("frames")
        return rows + self._rows(self.keeper.flush())

    def _rows(self, tracks: Iterable[Any]) -> list[dict]:
        """Write each finished track's crops into the unit being built; its manifest rows."""
        from PIL import Image

        rows = []
        for track in tracks:
            view = self.view or self._predicted_view(track)
            self.tracks += 1
            for crop in track.crops:
                name = f"{track.id:05d}_{crop.frame:07d}.jpg"
                Image.fromarray(np.ascontiguousarray(crop.image)).save(self.tmp / name, quality=95)
                self.crops += 1
                rows.append(
                    {
                        "name": name,
                        "view": view or "",
                        "camera": self.camera,
                        "timestamp": _iso(crop.time),
                        "tags": "",
                        "track": f"{_safe(self.source.stem)}/{track.id}",
                        "source": self.source.location,
                        "frame": str(crop.frame),
                        "box": " ".join(str(int(round(v))) for v in crop.box[:4]),
                        "t_start": _iso(track.t_start),
                        "t_end": _iso(track.t_end),
                    }
                )
        return rows

    def _predicted_view(self, track: Any) -> str | None:
        """The model's view of a track: the majority of its crops' router predictions."""
        from PIL import Image

        from modeling_tagclip.retrieval.encode import VIEW_NAMES, encode_images

        images = [Image.fromarray(np.ascontiguousarray(crop.image)) for crop in track.crops]
        probs = encode_images(
            self.ingest.model, self.ingest.processor, images, device=self.options.target.device
        ).get("view_probs")
        if probs is None:
            return None
        votes = Counter(int(i) for i in probs.argmax(-1))
        best = max(votes, key=lambda v: (votes[v], float(probs[:, v].mean())))
        return VIEW_NAMES[best]

    def _fresh_tmp(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)

    def _commit(self, final: Path, rows: list[dict], status: str) -> None:
        prefix = final.relative_to(self.ingest.crops).as_posix()
        unit = {
            "source": self.source.location,
            "fingerprint": self.print_,
            "folder": self.folder,
            "camera": self.camera,
            "status": status,
            "stream": self.source.kind == "stream",
            "next_track": self.next_track,
            "tracks": len({r["track"] for r in rows}),
            "gaps": self.gaps,
            "rows": [{"path": f"{prefix}/{row.pop('name')}", **row} for row in rows],
        }
        self.gaps = []
        try:
            self.ingest.commit(self.tmp, final, unit)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
