"""Tiny synthetic clips for the ingest tests: coloured rectangles moving over a static background, written with
PyAV, with their true boxes (so tests know the answer)."""

from __future__ import annotations

import csv
import sqlite3
from pathlib import Path

import av
import numpy as np

COLOURS = ((220, 30, 30), (30, 200, 40), (40, 60, 230))


def background(height: int, width: int) -> np.ndarray:
    """A static textured background (a gradient, so compression keeps it stable)."""
    y = np.linspace(60, 120, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 40, width, dtype=np.float32)[None, :]
    grey = (y + x).astype(np.uint8)
    return np.repeat(grey[:, :, None], 3, axis=2)


def people_boxes(frame: int, people: int, height: int, width: int) -> list[tuple[int, int, int, int, int]]:
    """(id, x1, y1, x2, y2) of each rectangle "person" in ``frame``: walking left to right at its own row."""
    boxes = []
    for p in range(people):
        w, h = 10, 24
        x1 = 4 + (frame + 17 * p) % max(1, width - w - 8)
        y1 = 6 + p * (h + 6)
        if y1 + h < height:
            boxes.append((p + 1, x1, y1, x1 + w, y1 + h))
    return boxes


def draw(frame: int, people: int, height: int, width: int) -> np.ndarray:
    image = background(height, width).copy()
    for pid, x1, y1, x2, y2 in people_boxes(frame, people, height, width):
        image[y1:y2, x1:x2] = COLOURS[(pid - 1) % len(COLOURS)]
        image[y1 : y1 + 6, x1 + 2 : x2 - 2] = (240, 200, 160)  # a head
    return image


def write_clip(
    path: Path,
    frames: int = 20,
    fps: int = 10,
    people: int = 2,
    size: tuple[int, int] = (96, 128),
    codec: str = "mpeg4",
    creation_time: str | None = None,
    fmt: str | None = None,
) -> Path:
    """Write a clip of ``frames`` frames at ``fps``; returns ``path``."""
    height, width = size
    container = av.open(str(path), "w", format=fmt)
    if creation_time:
        container.metadata["creation_time"] = creation_time
    stream = container.add_stream(codec, rate=fps)
    stream.width, stream.height = width, height
    stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(draw(i, people, height, width), format="rgb24")
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return path


def gt_boxes(frames: int, people: int = 2, size: tuple[int, int] = (96, 128)) -> dict[int, np.ndarray]:
    """frame index -> (n, 5) true boxes with score 1 (a "detector" that is always right)."""
    height, width = size
    return {
        i: np.array([[*b[1:], 1.0] for b in people_boxes(i, people, height, width)], dtype=np.float32)
        for i in range(frames)
    }


def serve(
    port: int,
    frames: int,
    sessions: int,
    fps: int = 10,
    people: int = 2,
    size: tuple[int, int] = (96, 128),
    pause: float = 0.5,
) -> None:
    """Serve the clip as MPEG-TS on tcp://127.0.0.1:PORT ``sessions`` times: each waits for a reader, sends
    ``frames`` frames and hangs up (a stream that drops), then listens again after ``pause`` seconds."""
    import time

    height, width = size
    for _ in range(sessions):
        container = av.open(f"tcp://127.0.0.1:{port}?listen=1", "w", format="mpegts")
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(draw(i, people, height, width), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        container.close()
        time.sleep(pause)


CAMERAS = """
- {source: "*/gate.mp4", camera: gate, view: ground, start: "2024-05-01T10:00:00Z"}
- {source: "*/yard.mp4", camera: yard, view: aerial, start: "2024-05-01T11:00:00+01:00"}
"""
FRAMES, FPS = 30, 10


def write_detections(path: Path, frames: int = FRAMES, people: int = 2) -> Path:
    """MOTChallenge det.txt of the clip's true boxes (frame numbers from 1)."""
    lines = []
    for i, boxes in gt_boxes(frames, people).items():
        lines += [f"{i + 1},-1,{x1},{y1},{x2 - x1},{y2 - y1},{s:.2f},-1,-1,-1" for x1, y1, x2, y2, s in boxes]
    path.write_text("\n".join(lines) + "\n")
    return path


def manifest(crops: Path) -> list[dict]:
    with open(crops / "manifest.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def gallery_rows(out: Path) -> list[tuple]:

    db = sqlite3.connect(out / "gallery.sqlite")
    try:
        return db.execute("SELECT path, view, camera, timestamp FROM crops ORDER BY path").fetchall()
    finally:
        db.close()


def bad_files(tmp_path: Path, clip: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a bad file made from ``clip``, a phrase its error must hold)."""
    data = clip.read_bytes()
    mjpeg = write_clip(tmp_path / "m.avi", frames=3, codec="mjpeg").read_bytes()
    noise = bytearray(data)
    noise[2000:6000] = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    files = {
        "zero-length": (b"", "an empty (zero-length) file"),
        "not a video": (b"hello, this is text", "not a readable video"),
        "truncated": (data[: len(data) // 2], "not a readable video: truncated"),
        "corrupt": (bytes(noise), "truncated, corrupt"),
        "unsupported codec": (mjpeg.replace(b"MJPG", b"QQQQ"), "unsupported video codec"),
    }
    out = {}
    for i, (name, (payload, message)) in enumerate(files.items()):
        path = tmp_path / f"bad{i}.avi"
        path.write_bytes(payload)
        out[name] = (path, message)
    return out
