"""``tagclip ingest``: video files, folders of videos or frames and live streams into a searchable gallery.

tagclip ingest SOURCE... --model M --output gallery.idx [--crops DIR] [--cameras cameras.yaml]
               [--detector PATH_OR_REPO | --detections FILE_OR_DIR] [--fps 4] [--crops-per-track 3] ...
tagclip ingest SOURCE... --model M --milvus-uri gallery.db --collection people ...
tagclip ingest            (no SOURCE: the synthetic footage, rendered if absent, with the main job's model)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from modeling_tagclip.flags import finite_float, positive_int, usage_error

__all__ = ["DEFAULT_FOOTAGE", "DEFAULT_MODEL", "DEFAULT_OUT", "add_arguments", "main", "run"]

DEFAULT_MODEL = "outputs/tagclip-synthetic/best"
DEFAULT_FOOTAGE = "data/synthetic_footage"
DEFAULT_OUT = "outputs/synthetic-footage.idx"


def _positive(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _nonnegative(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip ingest``."""
    parser.description = (
        "Find people in footage, track them, and index the best crops of each track with camera, view and time. "
        f"Without SOURCE: the synthetic footage (rendered into {DEFAULT_FOOTAGE} if absent) with the main job's "
        "model."
    )
    parser.add_argument(
        "sources",
        nargs="*",
        metavar="SOURCE",
        help="a video file, a folder of videos, a folder of frames, or a stream URL "
        "(rtsp://, http(s)://, udp://, tcp://)",
    )
    parser.add_argument("--model", default=None, help=f"TAG-CLIP folder or Hub id (default {DEFAULT_MODEL})")
    parser.add_argument(
        "--output", dest="out", default=None, metavar="DIR", help="embedded gallery index folder"
    )
    parser.add_argument("--milvus-uri", default=None, help="Milvus server URI or Milvus Lite file (.db)")
    parser.add_argument("--collection", default=None, help="Milvus collection (with --milvus-uri)")
    parser.add_argument(
        "--reid-model",
        default=None,
        metavar="VISA",
        help="a ViSA folder: the ingested crops also get re-identification embeddings, for "
        "`tagclip search --reid-model` (default: none)",
    )
    parser.add_argument(
        "--crops",
        default=None,
        help="crops folder: the gallery's images, manifest.csv and "
        "ingest_state.json (default OUT.crops, or URI.crops for Milvus)",
    )
    parser.add_argument(
        "--cameras",
        default=None,
        help="camera file (YAML/JSON): source glob, camera, view, start with time zone, name",
    )
    found = parser.add_mutually_exclusive_group()
    found.add_argument(
        "--detector",
        default=None,
        help="'motion' (default: background subtraction, fixed "
        "cameras only, no weights) or a local transformers detector folder / Hub id",
    )
    found.add_argument(
        "--detections",
        default=None,
        help="boxes you already have: a MOTChallenge det.txt or "
        "JSON file (one source), or a folder of SOURCE-STEM.txt|.json",
    )
    parser.add_argument(
        "--detector-threshold", type=finite_float, default=None, help="detector score threshold"
    )
    parser.add_argument("--min-box-size", type=positive_int, default=None, help="smallest box side in pixels")
    parser.add_argument("--max-boxes", type=positive_int, default=100, help="boxes kept per frame (by score)")
    parser.add_argument("--fps", type=_positive, default=4.0, help="frames taken per second of footage")
    parser.add_argument(
        "--frame-rate", type=_positive, default=1.0, help="frames per second of a frame folder"
    )
    parser.add_argument("--crops-per-track", type=positive_int, default=3, help="best crops kept per track")
    parser.add_argument("--min-track-frames", type=positive_int, default=3, help="shorter tracks are dropped")
    parser.add_argument(
        "--min-track-score",
        type=finite_float,
        default=0.3,
        help="tracks with a lower mean detector score are dropped",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8, help="frames per detector batch")
    parser.add_argument("--device", default="auto", help="auto: the GPU if there is one, else cpu")
    parser.add_argument("--reconnect", type=int, default=3, help="reconnect tries when a stream drops")
    parser.add_argument("--duration", type=_positive, default=None, help="seconds to read from each source")
    parser.add_argument(
        "--max-frames", type=positive_int, default=None, help="frames to take from each source"
    )
    parser.add_argument(
        "--flush-seconds",
        type=_positive,
        default=30.0,
        help="a stream's finished tracks go into the gallery every this many seconds",
    )
    parser.add_argument(
        "--stall-timeout",
        type=_positive,
        default=10.0,
        help="a stream that sends nothing for this many seconds counts as dropped",
    )
    parser.add_argument("--backoff", type=_nonnegative, default=1.0, help="first reconnect wait in seconds")


def _fail(message: str) -> None:
    """A bad input: one ``tagclip ingest: error: ...`` line, exit status 2."""
    usage_error("tagclip ingest", " ".join(message.split()))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"tagclip ingest: warning: {message}", file=sys.stderr)


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _defaults(args: argparse.Namespace) -> None:
    """No SOURCE: the synthetic footage (rendered now if absent), its camera file and the main job's model."""
    if args.sources:
        if args.model is None:
            _fail("give --model (a trained TAG-CLIP folder or Hub id)")
        return
    from modeling_tagclip.cli import MAIN_JOB

    args.model = args.model or DEFAULT_MODEL
    if not Path(args.model).is_dir():
        _fail(
            f"no model at {args.model}: train it first with the main job ({MAIN_JOB}), or give --model "
            "and SOURCE"
        )
    footage = Path(DEFAULT_FOOTAGE)
    if not (footage / "cameras.yaml").is_file():
        from .footage import render_footage

        print(f"tagclip ingest: rendering the synthetic footage into {footage}", file=sys.stderr)
        render_footage(footage)
    args.sources = [str(footage / "videos")]
    args.cameras = args.cameras or str(footage / "cameras.yaml")
    if not args.out and not args.milvus_uri:
        args.out = DEFAULT_OUT


def _check(args: argparse.Namespace) -> None:
    if bool(args.milvus_uri) == bool(args.out):
        _fail("give --output DIR (embedded index) or --milvus-uri URI --collection NAME (one of them)")
    if args.milvus_uri and not args.collection:
        _fail("--milvus-uri needs --collection")
    if args.reconnect < 0:
        _fail(f"--reconnect must be zero or more, got {args.reconnect}")
    if args.detector_threshold is not None and not 0 <= args.detector_threshold <= 1:
        _fail(f"--detector-threshold must be between 0 and 1, got {args.detector_threshold}")
    if not 0 <= args.min_track_score <= 1 or math.isnan(args.min_track_score):
        _fail(f"--min-track-score must be between 0 and 1, got {args.min_track_score}")


def _detector_for(args: argparse.Namespace, device: str):
    """source -> its detector: one loaded detector for all sources, or a source's own detections file."""
    if args.detections:
        from .detect import load_detections
        from .frames import VideoError

        where = Path(args.detections)
        if where.is_dir():

            def own(source):
                stem = source.stem
                files = [p for p in (where / f"{stem}.txt", where / f"{stem}.json") if p.is_file()]
                if not files:  # this source is skipped with its line; the others go on
                    raise VideoError(
                        f"{source.location}: no {stem}.txt or {stem}.json in --detections {where}"
                    )
                return load_detections(files[0])

            return own
        loaded = load_detections(where)
        return lambda source: loaded
    from .detect import load_detector

    options = {"device": device, "max_boxes": args.max_boxes, "batch_size": args.batch_size}
    options.update(
        {
            key: value
            for key, value in (("threshold", args.detector_threshold), ("min_size", args.min_box_size))
            if value is not None
        }
    )
    detector = load_detector(args.detector, **options)
    return lambda source: detector


def _ingest(args: argparse.Namespace) -> int:
    from .frames import expand_sources
    from .gallery import GalleryTarget
    from .ingest import Ingest, IngestOptions

    sources = expand_sources(args.sources)
    if args.detections and Path(args.detections).is_file() and len(sources) > 1:
        _fail(
            "a --detections file holds one source's boxes: give a folder of SOURCE-STEM.txt for several",
        )
    device = _device(args.device)
    from modeling_tagclip.retrieval.cli import load_model, load_reid

    model, processor = load_model(args.model, device)
    crops = Path(args.crops or f"{args.out or args.milvus_uri}.crops")
    model_name = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    target = GalleryTarget(
        Path(args.out) if args.out else None,
        args.milvus_uri,
        args.collection,
        batch_size=32,
        device=device,
        model_name=model_name,
    )
    options = IngestOptions(
        crops,
        target,
        Path(args.cameras) if args.cameras else None,
        fps=args.fps,
        frame_rate=args.frame_rate,
        crops_per_track=args.crops_per_track,
        min_track_frames=args.min_track_frames,
        min_track_score=args.min_track_score,
        batch_size=args.batch_size,
        max_boxes=args.max_boxes,
        reconnect=args.reconnect,
        backoff_s=args.backoff,
        duration=args.duration,
        max_frames=args.max_frames,
        flush_seconds=args.flush_seconds,
        stall_timeout=args.stall_timeout,
    )
    reid = load_reid(args.reid_model, device) if args.reid_model else None  # a bad ViSA folder fails first
    summary = Ingest(model, processor, _detector_for(args, device), options).run(sources)
    where = args.out or f"{args.milvus_uri} ({args.collection})"
    if reid is not None and summary.crops + summary.skipped and _gallery_exists(args):
        from modeling_tagclip.retrieval.reid import add_reid

        added = add_reid(*reid, args.out or args.milvus_uri, args.collection)
        print(f"tagclip ingest: reid embeddings of {added} crop(s) added ({args.reid_model})")
    print(
        f"tagclip ingest: {summary.sources} source(s) ingested ({summary.skipped} already in), {summary.tracks} "
        f"track(s), {summary.crops} crop(s) into {where}; crops and manifest.csv in {crops}"
    )
    return 2 if summary.failed else 0


def _gallery_exists(args: argparse.Namespace) -> bool:
    return bool(args.milvus_uri) or Path(args.out, "index.json").exists()


def run(args: argparse.Namespace) -> int:
    """``tagclip ingest`` with its parsed flags; a bad input is one ``tagclip ingest: error: ...`` line with exit
    status 2."""
    _defaults(args)
    _check(args)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _ingest(args)
        except ValueError as error:  # a bad source, camera file, detector or option: one line
            if os.environ.get("TAGCLIP_DEBUG"):
                raise
            _fail(str(error))
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``tagclip ingest ARGV`` from Python; the exit status."""
    from modeling_tagclip.cli import parse

    return run(parse("ingest", argv))
