"""Resident memory of the ingest stages over a long stream: is it flat?

The synthetic footage's street camera (seed 0), sampled at ``--fps``, is played in a loop for ``--minutes`` of
stream time, each pass later in time than the last, through the motion detector, the tracker and the crop
keeper; finished tracks are handed off and dropped, as ``tagclip ingest`` commits them. The process's
resident set size (VmRSS) is read after every minute of stream time. Decoding (the frames are decoded once
and replayed) and the gallery writes are not part of this loop.

    python benchmarks/bench_ingest_memory.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, print_table, write_json  # noqa: E402
from modeling_tagclip.video.crops import TrackCrops  # noqa: E402
from modeling_tagclip.video.detect import load_detector  # noqa: E402
from modeling_tagclip.video.footage import render_footage  # noqa: E402
from modeling_tagclip.video.frames import Frame, iter_frames  # noqa: E402
from modeling_tagclip.video.track import ByteTracker  # noqa: E402


def rss_mib() -> float:
    """This process's resident set size (VmRSS of /proc/self/status) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmRSS in /proc/self/status")


def run(minutes: int, fps: float) -> tuple[list[dict[str, Any]], int, int]:
    """RSS per minute of stream time; also the frames and the finished tracks."""
    with tempfile.TemporaryDirectory() as tmp:
        video = render_footage(Path(tmp), seed=0, ground_cameras=1, aerial_cameras=0).videos[0]
        clip = list(iter_frames(str(video), fps, 0.0))
    span = len(clip) / fps  # seconds of stream one pass covers
    detector, tracker = load_detector("motion"), ByteTracker(max_lost=8)
    keeper = TrackCrops(k=3, min_frames=3, min_score=0.3, max_lost=8)
    rows, finished, frames, batch = [{"minute": 0, "rss_mib": rss_mib()}], 0, 0, []
    for number in range(round(minutes * 60 * fps)):
        source = clip[number % len(clip)]
        offset = (number // len(clip)) * span
        batch.append(Frame(number, source.pts_seconds + offset, source.time + offset, source.image))
        if len(batch) < detector.batch_size:
            continue
        for frame, boxes in zip(batch, detector([f.image for f in batch]), strict=True):
            finished += len(keeper.update(frame, tracker.update(boxes)))
        frames += len(batch)
        batch = []
        if frames % round(60 * fps) < detector.batch_size and frames >= 60 * fps:
            rows.append({"minute": round(frames / fps / 60), "rss_mib": rss_mib()})
    return rows, frames, finished + len(keeper.flush())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=int, default=30, help="minutes of stream time")
    parser.add_argument(
        "--fps", type=float, default=4.0, help="frames taken per second (tagclip ingest's default)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "ingest_memory_cpu.json")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows, frames, tracks = run(args.minutes, args.fps)
    print_table(rows, ["minute", "rss_mib"])
    payload = {
        "minutes": args.minutes,
        "fps": args.fps,
        "frames": frames,
        "tracks_finished": tracks,
        "wall_s": time.perf_counter() - start,
        "rows": rows,
    }
    write_json(args.output, payload)
    print(f"wrote {args.output}")
    return payload


if __name__ == "__main__":
    main()
