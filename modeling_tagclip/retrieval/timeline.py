"""Results per person: crop hits collapsed into one hit per track, and a per-camera timeline of sightings.

Works on the hit dicts every gallery backend returns (``score``, ``path``, ``camera``, ``timestamp`` and, for
crops that ``tagclip ingest`` cut from footage, ``track``, ``source``, ``t_start``, ``t_end``, ``offset``). A
crop without a track is a track of its own. Times are UTC seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Sighting",
    "Timeline",
    "frame_seconds",
    "per_track",
    "timeline",
    "timeline_html",
    "video_link",
    "with_seek",
]


def track_key(hit: dict[str, Any]) -> tuple:
    """What makes two crops one person's track: the camera and the track id (the crop's path without one)."""
    if hit.get("track") in (None, ""):
        return ("crop", hit.get("path"), hit.get("index"))
    return ("track", hit.get("camera"), str(hit["track"]))


def _span(hit: dict[str, Any]) -> tuple[float | None, float | None]:
    start = hit.get("t_start") if hit.get("t_start") is not None else hit.get("timestamp")
    end = hit.get("t_end") if hit.get("t_end") is not None else hit.get("timestamp")
    return start, end


def _merge_span(a: tuple, b: tuple) -> tuple:
    starts = [t for t in (a[0], b[0]) if t is not None]
    ends = [t for t in (a[1], b[1]) if t is not None]
    return (min(starts) if starts else None, max(ends) if ends else None)


@functools.lru_cache(maxsize=256)
def _frame_rate(source: str) -> float | None:
    try:
        import av

        with av.open(source) as container:
            rate = container.streams.video[0].average_rate
            return float(rate) if rate else None
    except (ImportError, OSError, IndexError, ValueError):
        return None


def frame_seconds(source: str | None, frame: int | None) -> float | None:
    """Seconds into the video file ``source`` of its frame number ``frame`` (from the file's frame rate, read
    with PyAV once per file); None for a stream, a file not here, or without PyAV."""
    if source is None or frame is None or "://" in str(source):
        return None
    rate = _frame_rate(str(source))
    return frame / rate if rate else None


def with_seek(hits: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``hits`` with ``offset``: the second of each crop's frame in its source video (None when unknown)."""
    return [
        {**hit, "offset": hit.get("offset", frame_seconds(hit.get("source"), hit.get("frame")))}
        for hit in hits
    ]


def per_track(hits: Iterable[dict[str, Any]], top_k: int | None = None) -> list[dict[str, Any]]:
    """One hit per track, best first: the track's best crop (its fields and score) with ``crops`` (how many of
    the track's crops matched), ``t_start``/``t_end`` spanning them, and ``seek`` (seconds into ``source`` of
    the best crop, when known). Ranks are renumbered; ``top_k`` keeps the first tracks."""
    best: dict[tuple, dict[str, Any]] = {}
    for hit in hits:
        key = track_key(hit)
        if key not in best:
            best[key] = {**hit, "crops": 1, "seek": hit.get("offset")}
            best[key]["t_start"], best[key]["t_end"] = _span(hit)
            continue
        kept = best[key]
        span = _merge_span((kept["t_start"], kept["t_end"]), _span(hit))
        if hit["score"] > kept["score"]:
            kept = best[key] = {**hit, "crops": kept["crops"], "seek": hit.get("offset")}
        kept["crops"] += 1
        kept["t_start"], kept["t_end"] = span
    ranked = sorted(best.values(), key=lambda h: -h["score"])[:top_k]
    return [{**hit, "rank": rank} for rank, hit in enumerate(ranked, 1)]


@dataclass(frozen=True)
class Sighting:
    """One track on a camera's row of the timeline."""

    t_start: float
    t_end: float
    score: float
    hit: dict[str, Any]


@dataclass
class Timeline:
    """Per camera, the sightings above ``min_score`` in time order, and the gaps longer than ``gap_seconds``
    between consecutive sightings; ``undated`` holds matches without a time."""

    min_score: float | None
    gap_seconds: float
    cameras: dict[str, list[Sighting]] = field(default_factory=dict)
    gaps: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    undated: list[dict[str, Any]] = field(default_factory=list)

    @property
    def span(self) -> tuple[float, float] | None:
        """First and last time over every camera (None when nothing is dated)."""
        rows = [s for row in self.cameras.values() for s in row]
        return (min(s.t_start for s in rows), max(s.t_end for s in rows)) if rows else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: per camera its sightings (with the hit) and gaps."""
        return {
            "min_score": self.min_score,
            "gap_seconds": self.gap_seconds,
            "cameras": {
                camera: {
                    "sightings": [
                        {"t_start": s.t_start, "t_end": s.t_end, "score": s.score, **_brief(s.hit)}
                        for s in row
                    ],
                    "gaps": [list(gap) for gap in self.gaps.get(camera, [])],
                }
                for camera, row in self.cameras.items()
            },
            "undated": [_brief(hit) for hit in self.undated],
        }


BRIEF_KEYS = ("rank", "score", "path", "camera", "view", "track", "source", "seek", "crops", "timestamp")


def _brief(hit: dict[str, Any]) -> dict[str, Any]:
    return {key: hit.get(key) for key in BRIEF_KEYS if key in hit}


def timeline(
    hits: Sequence[dict[str, Any]], min_score: float | None = None, gap_seconds: float = 60.0
) -> Timeline:
    """The per-camera timeline of the tracks among ``hits`` scoring at least ``min_score`` (``per_track`` is
    applied first), cameras ordered by their first sighting; a gap is a pause of more than ``gap_seconds``
    between the end of one sighting and the start of the next on the same camera."""
    if not gap_seconds >= 0:
        raise ValueError(f"the timeline's gap must be a number of seconds >= 0, got {gap_seconds!r}")
    result = Timeline(min_score=min_score, gap_seconds=gap_seconds)
    rows: dict[str, list[Sighting]] = {}
    for hit in per_track(h for h in hits if min_score is None or h["score"] >= min_score):
        if hit["t_start"] is None:
            result.undated.append(hit)
            continue
        camera = str(hit.get("camera") if hit.get("camera") is not None else "unknown camera")
        rows.setdefault(camera, []).append(Sighting(hit["t_start"], hit["t_end"], hit["score"], hit))
    for camera, row in sorted(rows.items(), key=lambda item: min(s.t_start for s in item[1])):
        row.sort(key=lambda s: (s.t_start, s.t_end))
        result.cameras[camera] = row
        result.gaps[camera] = _gaps(row, gap_seconds)
    return result


def _gaps(row: list[Sighting], gap_seconds: float) -> list[tuple[float, float]]:
    """The pauses longer than ``gap_seconds`` in a time-ordered row (a long sighting covers later short ones)."""
    gaps, end = [], row[0].t_end
    for sighting in row[1:]:
        if sighting.t_start - end > gap_seconds:
            gaps.append((end, sighting.t_start))
        end = max(end, sighting.t_end)
    return gaps


def _clock(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _percent(t: float, span: tuple[float, float]) -> float:
    width = max(span[1] - span[0], 1e-9)
    return round(100.0 * (t - span[0]) / width, 3)


def timeline_html(
    line: Timeline, thumbnail: Callable[[dict[str, Any]], str], link: Callable[[dict[str, Any]], str | None]
) -> str:
    """An HTML block (no script) of ``line``: time on the x axis, one row per camera, a marker per track with its
    thumbnail (``thumbnail(hit)``: an image URI) linking to the video at its second (``link(hit)``, e.g.
    ``file.mp4#t=12.5``; None: no link); pauses longer than the gap are shaded."""
    import html

    span = line.span
    if span is None:
        return "<section class='timeline'><p>No dated sighting above the score threshold.</p></section>"
    parts = [
        "<section class='timeline'><style>.timeline .row{position:relative;height:80px;margin:4px 0 4px 9em;"
        "border-left:1px solid #888;border-bottom:1px solid #ccc}.timeline .cam{position:absolute;left:-9em;"
        "width:8.5em;top:30px;font:12px sans-serif}.timeline .gap{position:absolute;top:0;bottom:0;"
        "background:#eee}.timeline .mark{position:absolute;top:4px;transform:translateX(-50%)}"
        ".timeline .mark img{height:60px;border:2px solid #36c}.timeline .axis{margin-left:9em;"
        "font:11px sans-serif;display:flex;justify-content:space-between}</style>"
    ]
    for camera, row in line.cameras.items():
        parts.append(
            f"<div class='row' data-camera='{html.escape(camera)}'><span class='cam'>{html.escape(camera)}</span>"
        )
        for start, end in line.gaps.get(camera, []):
            left, right = _percent(start, span), _percent(end, span)
            parts.append(
                f"<span class='gap' title='no sighting {html.escape(_clock(start))} to "
                f"{html.escape(_clock(end))}' style='left:{left}%;width:{right - left}%'></span>"
            )
        for s in row:
            title = f"{camera} {_clock(s.t_start)} to {_clock(s.t_end)}, score {s.score:.3f}"
            image = f"<img src='{html.escape(thumbnail(s.hit), quote=True)}' alt='{html.escape(title)}'>"
            target = link(s.hit)
            body = f"<a href='{html.escape(target, quote=True)}'>{image}</a>" if target else image
            parts.append(
                f"<span class='mark' title='{html.escape(title)}' style='left:{_percent(s.t_start, span)}%'"
                f">{body}</span>"
            )
        parts.append("</div>")
    parts.append(
        f"<div class='axis'><span>{_clock(span[0])}</span><span>{_clock(span[1])}</span></div></section>"
    )
    return "".join(parts)


def video_link(hit: dict[str, Any]) -> str | None:
    """``source#t=SECONDS`` (the media fragment a browser seeks to) for a hit cut from a video file; None for a
    crop without a source or seek second, or a stream."""
    source, seek = hit.get("source"), hit.get("seek", hit.get("offset"))
    if not source or seek is None or "://" in str(source):
        return None
    return f"{source}#t={float(seek):.2f}"
