"""Frames out of footage: video files, folders of videos or of frames, and live streams, sampled at ``fps``.

PyAV (FFmpeg in its wheel) decodes; a frame is converted to RGB only when it is sampled, and no frame is kept
after it is yielded, so memory stays flat over any length of footage. Inter-frame codecs need every packet
decoded (the sampled frames depend on the ones before); only the sampled ones are converted. Intra-only codecs
(MJPEG) decode only the sampled frames.

Every frame has a time: ``start_time`` (UTC seconds) + its pts in seconds from the source's first frame. A frame
whose pts is not after the previous frame's (a clock that runs backwards) is skipped; the count is reported once
per source through ``warn``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

__all__ = [
    "STREAM_SCHEMES",
    "VIDEO_EXTENSIONS",
    "Frame",
    "Source",
    "VideoError",
    "container_start",
    "expand_sources",
    "iter_frames",
]

VIDEO_EXTENSIONS = (
    ".mp4",
    ".m4v",
    ".mov",
    ".mkv",
    ".webm",
    ".avi",
    ".ts",
    ".mts",
    ".mpg",
    ".mpeg",
    ".flv",
    ".wmv",
    ".3gp",
)
STREAM_SCHEMES = ("rtsp://", "rtsps://", "http://", "https://", "udp://", "tcp://", "rtmp://", "srt://")
STREAM_TIMEOUT_S = 10.0  # a stream that sends nothing for this long counts as dropped


class VideoError(ValueError):
    """A source that cannot be read as footage (the message names it)."""


@dataclass(frozen=True)
class Frame:
    """One sampled frame."""

    index: int  # 0-based number of this frame among the source's decoded frames (MOTChallenge frame - 1)
    pts_seconds: float  # seconds from the source's first frame
    time: float  # absolute UTC seconds (start time + pts_seconds)
    image: np.ndarray  # H x W x 3 uint8 RGB


@dataclass(frozen=True)
class Source:
    """One unit of footage: a video file, a folder of frames or a stream URL."""

    location: str  # a path or a URL
    kind: str  # "video", "frames" or "stream"

    @property
    def stem(self) -> str:
        """The default camera id: the file or folder name without extension, or the stream's host_port."""
        if self.kind == "stream":
            netloc = self.location.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
            return netloc.rsplit("@", 1)[-1].replace(":", "_") or "stream"
        return Path(self.location).stem if self.kind == "video" else Path(self.location).name


def is_stream(location: str) -> bool:
    return location.lower().startswith(STREAM_SCHEMES)


def _image_files(folder: Path) -> list[Path]:
    from modeling_tagclip.retrieval.embedded.gallery_index import IMAGE_EXTENSIONS

    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
    )


def expand_sources(items: list[str]) -> list[Source]:
    """SOURCE arguments -> sources: a URL, a video file, a folder's videos (recursive, sorted) or, for a folder
    holding images and no videos, that folder as one frame sequence (frames sorted by name)."""
    sources: list[Source] = []
    for item in items:
        if is_stream(item):
            sources.append(Source(item, "stream"))
            continue
        path = Path(item).resolve()  # one name per file, whatever the working folder
        if path.is_file():
            sources.append(Source(str(path), "video"))
        elif path.is_dir():
            videos = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and p.suffix.lower() in VIDEO_EXTENSIONS
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if videos:
                sources.extend(Source(str(p), "video") for p in videos)
            elif _image_files(path):
                sources.append(Source(str(path), "frames"))
            else:
                raise VideoError(
                    f"{path}: a folder with no videos ({', '.join(VIDEO_EXTENSIONS)}) and no frames"
                )
        else:
            raise VideoError(
                f"{item}: no such file or folder (a stream needs one of {', '.join(STREAM_SCHEMES)})"
            )
    return sources


def _reason(error: Exception) -> str:
    """FFmpeg's reason without its errno: "Invalid data found when processing input"."""
    return getattr(error, "strerror", None) or str(error).split("\n", 1)[0] or type(error).__name__


def _av_error(source: Source, error: Exception, timeout: float) -> VideoError:
    import av

    if source.kind == "stream" and isinstance(error, av.error.ExitError):  # the read timed out
        return VideoError(f"{source.location}: the stream sent nothing for {timeout:g} s (stalled)")
    if source.kind == "stream":
        return VideoError(f"{source.location}: cannot read the stream ({_reason(error)})")
    return VideoError(f"{source.location}: cannot decode, truncated or corrupt ({_reason(error)})")


def _open(source: Source, timeout: float = STREAM_TIMEOUT_S):
    """The PyAV container of a video file or stream and its first video stream (errors name the source)."""
    import av

    where = source.location
    if source.kind == "video":
        size = os.path.getsize(where)
        if size == 0:
            raise VideoError(f"{where}: an empty (zero-length) file")
    try:
        container = av.open(where, timeout=timeout if source.kind == "stream" else None)
    except av.error.FFmpegError as error:
        if source.kind == "stream":
            raise _av_error(source, error, timeout) from None
        raise VideoError(
            f"{where}: not a readable video: truncated, corrupt or not a video ({_reason(error)})"
        ) from None
    if not container.streams.video:
        container.close()
        raise VideoError(f"{where}: holds no video stream")
    stream = container.streams.video[0]
    codec = stream.codec_context
    if codec is None or stream.codec_context.codec is None:
        container.close()
        raise VideoError(f"{where}: unsupported video codec")
    stream.thread_type = "AUTO"
    return container, stream


def container_start(source: Source) -> tuple[float, str]:
    """(UTC seconds of the first frame, where that came from) when no camera file gives it: a video's
    ``creation_time`` metadata, else the file's modification time less its duration (a recording ends when
    it is last written); a frame folder: its first frame's modification time; a stream: now."""
    if source.kind == "stream":
        return time.time(), "the time the stream was opened"
    if source.kind == "frames":
        first = _image_files(Path(source.location))[0]
        return first.stat().st_mtime, f"the modification time of its first frame {first.name}"
    container, stream = _open(source)
    try:
        stamp = stream.metadata.get("creation_time") or container.metadata.get("creation_time")
        duration = float(container.duration or 0) / 1_000_000  # AV_TIME_BASE
    finally:
        container.close()
    if stamp:
        with contextlib.suppress(ValueError):
            moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
            return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp(), (
                "the container's creation_time"
            )
    mtime = os.stat(source.location).st_mtime
    return (
        mtime - duration,
        "the file's modification time less its duration (the container has no creation_time)",
    )


class _Sampler:
    """Keeps the first frame at or after each multiple of 1/fps; drops a frame whose pts is not increasing."""

    def __init__(self, fps: float):
        self.fps, self.due, self.last, self.backwards = fps, 0.0, -math.inf, 0

    def take(self, seconds: float) -> bool:
        if seconds <= self.last:
            self.backwards += 1
            return False
        self.last = seconds
        if seconds + 1e-6 < self.due:
            return False
        self.due = (math.floor(seconds * self.fps + 1e-6) + 1) / self.fps
        return True


def _video_frames(
    source: Source, sampler: _Sampler, timeout: float
) -> Iterator[tuple[int, float, np.ndarray]]:
    import av

    container, stream = _open(source, timeout)
    base = stream.time_base
    intra = stream.codec_context.codec.intra_only  # every frame stands alone (MJPEG): skip the unsampled ones
    origin = None
    index = -1
    try:
        for packet in container.demux(stream):
            if intra and packet.pts is not None and packet.size:
                index += 1
                origin = packet.pts if origin is None else origin
                seconds = float((packet.pts - origin) * base)
                if sampler.take(seconds):
                    for frame in packet.decode():
                        yield index, seconds, frame.to_ndarray(format="rgb24")
                continue
            for frame in packet.decode():
                index += 1
                pts = frame.pts if frame.pts is not None else frame.dts
                if pts is None:
                    continue
                origin = pts if origin is None else origin
                seconds = float((pts - origin) * base)
                if sampler.take(seconds):
                    yield index, seconds, frame.to_ndarray(format="rgb24")
    except av.error.FFmpegError as error:
        raise _av_error(source, error, timeout) from None
    finally:
        container.close()
    if index < 0:
        raise VideoError(f"{source.location}: no frame could be decoded (truncated or corrupt)")


def _folder_frames(
    source: Source, sampler: _Sampler, frame_rate: float
) -> Iterator[tuple[int, float, np.ndarray]]:
    from PIL import Image, UnidentifiedImageError

    for index, path in enumerate(_image_files(Path(source.location))):
        seconds = index / frame_rate
        if not sampler.take(seconds):
            continue
        try:
            with Image.open(path) as image:
                array = np.asarray(image.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as error:
            raise VideoError(f"{path}: not a readable frame ({error})") from None
        yield index, seconds, array


def iter_frames(
    source: Source | str,
    fps: float,
    start_time: float,
    *,
    frame_rate: float = 1.0,
    timeout: float = STREAM_TIMEOUT_S,
    warn: Callable[[str], None] | None = None,
) -> Iterator[Frame]:
    """Frames of ``source`` sampled at ``fps`` per second, timed from ``start_time`` (UTC seconds).
    ``frame_rate``: frames per second of a frame folder; ``timeout``: seconds a stream may send nothing.
    Raises ``VideoError`` naming the source."""
    if not (math.isfinite(fps) and fps > 0):
        raise VideoError(f"fps must be a positive number, got {fps!r}")
    if isinstance(source, str):
        source = expand_sources([source])[0]
    sampler = _Sampler(fps)
    if source.kind == "frames":
        if not (math.isfinite(frame_rate) and frame_rate > 0):
            raise VideoError(f"frame rate must be a positive number, got {frame_rate!r}")
        frames = _folder_frames(source, sampler, frame_rate)
    else:
        frames = _video_frames(source, sampler, timeout)
    try:
        for index, seconds, image in frames:
            yield Frame(index, seconds, start_time + seconds, image)
    finally:
        if sampler.backwards and warn is not None:
            warn(f"{source.location}: {sampler.backwards} frame(s) whose time ran backwards were skipped")
