"""The gallery verbs of ``tagclip`` (``modeling_tagclip.cli``): build, grow, search and serve a gallery index.

tagclip index  --model M --images DIR --output IDX [--batch-size N] [--dtype bf16|fp16|fp32] [--workers N]
               [--metadata crops.csv] [--overwrite] [--ann ivf|FAISS_FACTORY [--ann-param nprobe=256 ...]]
tagclip index  --add --model M --images DIR --output IDX [--metadata new.csv]   (only images not yet indexed)
tagclip remove --index IDX PATH...                 (immediate; survives reload)
tagclip search --index IDX [--model M] [-k 10] [--view aerial] [--camera 7] [--after T] [--before T]
               [--tag TAG] [--json] [--html hits.html] [--png sheet.png] "a woman in a red coat"
tagclip search --index IDX [--image CROP] [--like HIT_ID] [--track CAMERA:TRACK] [--set-rule mean|max]
               [--text-weight W] ["a description"]   (crops of the person; gallery crops by stored embeddings)
tagclip serve  --index IDX [--model M]            (one query per stdin line, plain or JSON; JSON lines out)

Several processes: ``torchrun --nproc_per_node N -m modeling_tagclip.cli index ...`` or
``accelerate launch --multi_gpu --num_processes N -m modeling_tagclip.cli index ...`` (both tested
with 2 CPU processes; accelerate 1.x's ``--cpu`` starts one process unless given an MPI hostfile): each rank
encodes its shards, rank 0 merges them into the index one process would write.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.atomic_io import output_folder
from modeling_tagclip.flags import (
    finite_float,
    fraction,
    nonnegative_int,
    positive_int,
)
from modeling_tagclip.retrieval.report import contact_sheet, html_report, predicted_view

__all__ = [
    "add_index_arguments",
    "add_remove_arguments",
    "add_search_arguments",
    "add_serve_arguments",
    "load_model",
    "main",
    "run",
]

INDEX_TYPES = ("diskann", "flat", "hnsw", "ivf_flat", "ivf_pq", "ivf_sq8")  # = milvus.INDEX_TYPES


def load_model(path: str, device: str = "cpu", trust_remote_code: bool = False):
    """(model, processor) of a TAG-CLIP folder or Hub id with this package's classes; other model types only
    with ``trust_remote_code`` (``modeling_tagclip.retrieval.loading.load_model``)."""
    from .loading import load_model as load

    return load(path, device, family="tagclip", trust_remote_code=trust_remote_code)


def _ann_params(items: list[str] | None) -> dict[str, float]:
    """``--ann-param NAME=VALUE`` pairs -> {name: value} (finite numbers)."""
    params = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or not name.strip() or not math.isfinite(number):
            raise SystemExit(f"tagclip index: --ann-param wants name=value (e.g. nprobe=256), got {item!r}")
        params[name.strip()] = number
    return params


def _device(name: str) -> str:
    """``auto``: this process's GPU (``LOCAL_RANK`` under torchrun/accelerate) if there is one, else CPU."""
    import torch

    if name != "auto":
        return name
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"


def _warning_printer(command: str):
    """``warnings.showwarning`` of the CLI: one ``tagclip COMMAND: warning: ...`` line on stderr."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"tagclip {command}: warning: {message}", file=sys.stderr)

    return show


CALIBRATION_TEXTS_MAX_BYTES = 4 << 20  # a --calibration-texts file: 4096 captions of up to ~1 KiB


def read_calibration_texts(path: str | None) -> list[str] | None:
    """The captions of ``--calibration-texts FILE`` (one a line, blank lines skipped); ``none``: ``[]`` (the
    gallery rows alone); not given: None (the built-in descriptions). Errors name the file and the problem."""
    if path is None:
        return None
    if path == "none":
        return []
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"tagclip index: --calibration-texts {path} is not a file")
    if file.stat().st_size > CALIBRATION_TEXTS_MAX_BYTES:
        raise SystemExit(
            f"tagclip index: --calibration-texts {path} is over {CALIBRATION_TEXTS_MAX_BYTES >> 20} MiB"
        )
    try:
        lines = [line.strip() for line in file.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as error:
        raise SystemExit(
            f"tagclip index: --calibration-texts {path} is not UTF-8 text ({error.reason})"
        ) from None
    texts = [line for line in lines if line]
    if not texts:
        raise SystemExit(f"tagclip index: --calibration-texts {path} holds no caption (use 'none' for none)")
    return texts


def _rows_in(out: str) -> int:
    """Rows committed to the index at ``out`` (0 if there is none yet)."""
    from .embedded.index_store import read_manifest

    manifest = read_manifest(Path(out)) if Path(out).is_dir() else None
    return manifest["num_rows"] if manifest else 0


def _request(args: argparse.Namespace, params: dict[str, float], device: str):
    """The ``IndexRequest`` of ``tagclip index``'s arguments (either backend)."""
    from .indexing import IndexRequest

    if args.milvus_uri:
        backend = {"milvus_uri": args.milvus_uri, "collection": args.collection}
        backend |= {"index_type": args.index_type, "index_params": params or None}
    else:
        backend = {
            "out": args.out,
            "overwrite": args.overwrite,
            "ann": args.ann,
            "ann_params": params or None,
        }
        backend |= {"ann_on": args.ann_on, "store_dtype": args.store_dtype}
        backend |= {"calibration_texts": read_calibration_texts(args.calibration_texts)}
    model_name = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    reid_model, reid_name = load_reid(args.reid_model, device)
    return IndexRequest(
        reid_model=reid_model,
        reid_model_name=reid_name,
        images=args.images,
        add=args.add,
        metadata=args.metadata,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        dtype=args.dtype,
        num_workers=args.workers,
        device=device,
        progress=not args.quiet,
        model_name=model_name,
        **backend,
    )


@contextlib.contextmanager
def _storage_errors_name(out: str):
    """A full, read-only or unwritable index folder (OSError, SQLite, safetensors) as one error naming it."""
    from modeling_tagclip.failures import describe, storage_errors

    try:
        yield
    except storage_errors() as error:
        raise IndexStorageError(f"index {out}: {describe(error)}") from error


class IndexStorageError(OSError):
    """The index folder could not be read or written (full disk, read-only or unwritable)."""


def _cmd_index(args: argparse.Namespace) -> int:
    if args.add_embeddings:
        return _cmd_add_embeddings(args)
    missing = [flag for flag, value in (("--model", args.model), ("--images", args.images)) if not value]
    if missing:
        raise SystemExit(f"tagclip index: give {' and '.join(missing)} (or --add-embeddings reid)")
    if args.milvus_uri:
        return _cmd_index_milvus(args)
    if not args.out:
        raise SystemExit(
            "tagclip index: give --output DIR (embedded index) or --milvus-uri URI --collection NAME"
        )

    params = _ann_params(args.ann_param)
    if params and args.ann is None:
        raise SystemExit("tagclip index: --ann-param needs --ann")
    if args.calibration_texts is not None and args.ann is None and not args.add:
        raise SystemExit("tagclip index: --calibration-texts needs --ann")
    output_folder(args.out)  # a device node or a file there is named before any work
    from .embedded.index_store import read_header
    from .indexing import index_gallery

    device = _device(args.device)
    model, processor = load_model(args.model, device)
    with _storage_errors_name(args.out):
        added = index_gallery(model, processor, _request(args, params, device))
    if int(os.environ.get("RANK", "0")) == 0:
        ann, total = read_header(args.out).get("ann"), _rows_in(args.out)
        backend = f"faiss ANN {ann['factory']} {ann['params']}" if ann else "exact"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        ranks = f"; {world} processes" if world > 1 else ""
        if args.add:
            print(
                f"added {added} images from {args.images} to {args.out}, now {total} (search: {backend}{ranks})"
            )
        else:
            print(f"indexed {total} images from {args.images} into {args.out} (search: {backend}{ranks})")
    return 0


def _milvus_flags(parser: argparse.ArgumentParser) -> None:
    """``--milvus-uri`` / ``--collection``: a Milvus collection in place of an index folder."""
    parser.add_argument(
        "--milvus-uri",
        default=None,
        metavar="URI",
        help="Milvus gallery instead of an index folder: a Milvus Lite file (gallery.db) or a "
        "server (http://host:19530); credentials from the MILVUS_TOKEN environment variable",
    )
    parser.add_argument("--collection", default=None, help="Milvus collection of the gallery")


def _gallery_location(args: argparse.Namespace) -> tuple[str, str | None]:
    """(location, collection) from ``--index`` or ``--milvus-uri --collection`` (exactly one of them)."""
    if bool(args.index) == bool(args.milvus_uri):
        raise SystemExit(f"tagclip {args.command}: give --index DIR or --milvus-uri URI --collection NAME")
    if args.milvus_uri and not args.collection:
        raise SystemExit(f"tagclip {args.command}: --milvus-uri needs --collection NAME")
    if args.milvus_uri:
        from .milvus import check_collection_name, check_uri

        check_uri(args.milvus_uri), check_collection_name(args.collection)
    return (args.milvus_uri, args.collection) if args.milvus_uri else (args.index, None)


def load_reid(path: str | None, device: str) -> tuple[Any, str]:
    """(ViSA model, its name as recorded in the gallery) for ``--reid-model``, or (None, "")."""
    if not path:
        return None, ""
    from .loading import load_visa

    return load_visa(path, device), str(Path(path).resolve()) if Path(path).exists() else path


def _cmd_add_embeddings(args: argparse.Namespace) -> int:
    """``tagclip index --add-embeddings reid``: the reid embeddings of every crop of a gallery that lacks one."""
    if not args.reid_model:
        raise ValueError("--add-embeddings reid needs --reid-model VISA")
    if args.model or args.images or args.add or args.overwrite:
        raise ValueError(
            "--add-embeddings adds to an existing gallery: drop --model, --images, --add, --overwrite"
        )
    if bool(args.out) == bool(args.milvus_uri):
        raise SystemExit("tagclip index: give --output DIR or --milvus-uri URI --collection NAME")
    if args.milvus_uri:
        from .milvus import check_collection_name, check_uri

        check_uri(args.milvus_uri), check_collection_name(args.collection)
    from .reid import add_reid

    model, name = load_reid(args.reid_model, _device(args.device))
    location = args.milvus_uri or args.out
    where = f"{args.milvus_uri} collection {args.collection}" if args.milvus_uri else args.out
    added = add_reid(
        model,
        name,
        location,
        args.collection,
        shard_size=args.shard_size,
        batch_size=args.batch_size or 32,
        progress=not args.quiet,
    )
    if added:
        _report_line(f"added reid embeddings of {added} crops to {where} ({args.reid_model})")
    else:
        _report_line(f"every crop of {where} already has a reid embedding: nothing to do")
    return 0


def _cmd_index_milvus(args: argparse.Namespace) -> int:
    from .indexing import index_gallery
    from .milvus import check_collection_name, check_uri

    if not args.collection:
        raise SystemExit("tagclip index: --milvus-uri needs --collection NAME")
    check_uri(args.milvus_uri), check_collection_name(args.collection)
    if args.out or args.ann or args.overwrite or args.calibration_texts is not None:
        raise SystemExit(
            "tagclip index: --output, --ann, --calibration-texts and --overwrite are for the embedded index, "
            "not --milvus-uri"
        )
    device = _device(args.device)
    model, processor = load_model(args.model, device)
    added = index_gallery(model, processor, _request(args, _ann_params(args.index_param), device))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = f"rank {os.environ.get('RANK', '0')} of {world}: " if world > 1 else ""
    where = f"{args.milvus_uri} collection {args.collection} ({args.index_type})"
    _report_line(f"{rank}indexed {added} new images from {args.images} into {where}")
    return 0


def _report_line(line: str) -> None:
    """Write ``line`` and its newline in one call: every rank reports to the same stream, and ``print`` writes
    the text and the newline separately, so under ``PYTHONUNBUFFERED`` two ranks' lines could merge."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _flag_hint(error: Exception) -> str:
    """What to type next for an index error the library reports without naming CLI flags."""
    from .embedded import index_store as store

    hints = (
        (store.ModelMismatchError, "rebuild it with `tagclip index --model <this model> --overwrite`"),
        (store.IndexMismatchError, "pass --overwrite to rebuild it"),
        (
            store.FixedSettingError,
            "run --add without --ann/--ann-param/--store-dtype/--calibration-texts, or rebuild with --overwrite",
        ),
        (store.UnindexedImagesError, "use --add to add them, or --overwrite to rebuild"),
        (store.IncompleteIndexError, "run `tagclip index` again with the same arguments to resume it"),
        (
            store.IndexNotFoundError,
            "build one with `tagclip index --model MODEL --images DIR --output INDEX`",
        ),
    )
    return next((f"; {hint}" for kind, hint in hints if isinstance(error, kind)), "")


def _cmd_remove(args: argparse.Namespace) -> int:
    from .store import open_gallery

    location, collection = _gallery_location(args)
    gallery = open_gallery(location, collection, **({} if collection else {"cache": False}))
    removed = gallery.remove(paths=args.paths)
    print(f"removed {removed} of {len(args.paths)} crops from {location}")
    return 0


def _table(query: str, hits: list[dict[str, Any]]) -> str:
    """Ranked hits; a hit of a track shows the track, how many of its crops matched and its time span."""
    lines = [
        f"query: {query}",
        f"{'rank':>4}  {'score':>7}  {'id':<16}  {'view':<7} {'predicted':<12}  {'camera':<8}  {'track':<10}  "
        f"{'time (UTC)':<28}  path",
    ]
    for hit in hits:
        view, camera = hit["view"] or "-", hit["camera"] or "-"
        track = (
            f"{hit['track']} ({hit['crops']})"
            if hit.get("track") and "crops" in hit
            else hit.get("track") or "-"
        )
        per_track = "crops" in hit  # a track's span; a crop's own time
        start = hit.get("t_start") if per_track and hit.get("t_start") is not None else hit.get("timestamp")
        end = hit.get("t_end") if per_track else None
        when = _clock(start) + (f" - {_clock(end)[11:]}" if end is not None and end != start else "")
        lines.append(
            f"{hit['rank']:>4}  {hit['score']:>7.4f}  {hit.get('id') or '-':<16}  {view:<7} {predicted_view(hit):<12}  "
            f"{camera:<8}  "
            f"{track:<10}  {when:<28}  {hit['path']}"
        )
    return "\n".join(lines) if hits else lines[0] + "\n(no crop matches the filters)"


def _filters(args: argparse.Namespace) -> dict[str, Any] | None:
    keys = ("view", "camera", "after", "before", "tag")
    filters = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    return filters or None


def _searcher(args: argparse.Namespace, with_model: bool = True):
    """(gallery, model, processor) for ``--index`` or ``--milvus-uri`` with the model it was built with (or
    ``--model``); without ``with_model`` (a query of gallery crops only) no model is loaded: (gallery, None,
    None)."""
    from .store import open_gallery

    location, collection = _gallery_location(args)
    index = open_gallery(location, collection, image_root=args.image_root)
    if not with_model:
        return index, None, None
    model_path = args.model or index.meta.get("model")
    if not model_path:
        raise SystemExit(f"gallery {location} does not name its model; pass --model")
    model, processor = load_model(model_path, _device(args.device))
    index.check_model(model)
    return index, model, processor


def nonnegative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


PER_TRACK_FETCH = 8  # crops fetched per wanted track: a track matches with several of its crops


def _person_queries(args, index, model, processor) -> tuple[list[str], dict | None, dict | None]:
    """(labels, texts, crops) of ``tagclip search``: each description's embeddings, and the crops of the person
    (``--image`` files, ``--like`` hit ids and ``--track`` tracks of the gallery, in that order), or None."""
    from .encode import encode_texts
    from .queries import concat_sets, example_embeddings

    if not (args.query or args.image or args.like or args.track):
        raise SystemExit(
            "tagclip search: give a description, --image CROP, --like HIT_ID, --track CAMERA:TRACK"
        )
    images = [load_crop(path) for path in args.image or []]  # bad crops fail before the model runs
    stored = example_embeddings(index, args.like or [], args.track or [])
    crops = concat_sets([_encode_crops(args, model, processor, images) if images else None, stored])
    texts = encode_texts(model, processor, args.query) if args.query else None
    if crops is None:
        return list(args.query), texts, None
    names = [
        *(["crops " + ", ".join(Path(path).name for path in args.image)] if args.image else []),
        *(["like " + ", ".join(args.like)] if args.like else []),
        *(["track " + ", ".join(args.track)] if args.track else []),
    ]
    label = "; ".join(names) + (f" (set rule {args.set_rule})" if args.set_rule != "mean" else "")
    if texts is None:
        return [label], None, crops
    return [f"{query} + {label} (text weight {args.text_weight})" for query in args.query], texts, crops


def _encode_crops(args, model, processor, images: list) -> dict:
    """The query crops' embeddings: TAG-CLIP's, or with ``--reid-model`` ViSA's seen from ``--query-view``."""
    if args.reid_model:
        from .reid_encode import reid_embeddings

        return {"global": reid_embeddings(model, images, [args.query_view] * len(images))}
    from .encode import encode_images

    return encode_images(model, processor, images)


MIN_CROP_SIDE = 16  # a query crop smaller than this on a side shows no person
MAX_CROP_PIXELS = 16_000_000  # nor does one this large: a frame, a photo, not a crop
MAX_CROP_WIDE = 2.0  # a person crop is at most twice as wide as it is tall (a person seen from above)
MAX_CROP_TALL = 8.0  # and at most 8 times as tall as it is wide


def load_crop(path: str):
    """A query crop as RGB; one clear error for a missing file or an image that cannot be a person crop: under
    ``MIN_CROP_SIDE`` on a side, over ``MAX_CROP_PIXELS``, or wider or taller than a person's box can be."""
    from .encode import ImageTooLargeError, load_rgb

    try:
        image = load_rgb(path, max_pixels=MAX_CROP_PIXELS)
    except ImageTooLargeError as error:
        raise ValueError(f"query image {path}: {error} (a person crop, not a frame or a photo)") from None
    width, height = image.size
    if min(width, height) < MIN_CROP_SIDE:
        raise ValueError(
            f"query image {path} is {width}x{height} pixels: a person crop has at least "
            f"{MIN_CROP_SIDE} on each side"
        )
    if width > MAX_CROP_WIDE * height or height > MAX_CROP_TALL * width:
        raise ValueError(
            f"query image {path} is {width}x{height} pixels: a person crop is at most {MAX_CROP_WIDE:g} times as "
            f"wide as it is tall and {MAX_CROP_TALL:g} times as tall as it is wide"
        )
    return image


def _search_hits(args, index, model, processor) -> tuple[list[str], list[list[dict]]]:
    """Each query's hits: per track (default), per crop, or every fetched crop for a timeline."""
    from .embedded.gallery_index import SearchFilter
    from .queries import person_search
    from .timeline import per_track, with_seek

    filters = SearchFilter.of(_filters(args))  # bad filters fail before the model runs
    labels, texts, crops = _person_queries(args, index, model, processor)
    per_crop = args.per_crop and args.group_by is None
    fetch = args.top_k if per_crop else args.top_k * PER_TRACK_FETCH
    found = person_search(index, texts, crops, fetch, filters, args.text_weight, args.set_rule)
    results = [with_seek(hits) for hits in found]
    if args.min_score is not None:
        results = [[hit for hit in hits if hit["score"] >= args.min_score] for hits in results]
    if per_crop or args.group_by:
        return labels, results
    return labels, [per_track(hits, args.top_k) for hits in results]


def _reid_searcher(args: argparse.Namespace):
    """(the gallery searched by its reid embeddings, the ViSA model, None) for ``--reid-model``."""
    from .reid import reid_gallery
    from .store import open_gallery

    if args.query:
        raise ValueError(
            "a description cannot be a --reid-model query (ViSA embeds images only); "
            "query by --image, --like or --track"
        )
    if not (args.image or args.like or args.track):
        raise ValueError("--reid-model needs --image CROP, --like HIT_ID or --track CAMERA:TRACK")
    location, collection = _gallery_location(args)
    gallery = reid_gallery(open_gallery(location, collection, image_root=args.image_root))
    model, _ = load_reid(args.reid_model, _device(args.device))
    gallery.check_model(model)
    return gallery, model, None


def _cmd_search(args: argparse.Namespace) -> int:
    if args.reid_model:
        index, model, processor = _reid_searcher(args)
    else:
        index, model, processor = _searcher(args, with_model=bool(args.query or args.image))
    labels, results = _search_hits(args, index, model, processor)
    lines = None
    if args.group_by:
        from .timeline import timeline

        lines = [timeline(hits, args.min_score, args.gap) for hits in results]
    if args.json:
        if lines is not None:
            answer = [{"query": q, "timeline": line.as_dict()} for q, line in zip(labels, lines, strict=True)]
        else:
            answer = [{"query": q, "hits": h} for q, h in zip(labels, results, strict=True)]
        print(json.dumps(answer, indent=1, allow_nan=False, default=str))
    elif lines is not None:
        print("\n\n".join(_timeline_text(q, line) for q, line in zip(labels, lines, strict=True)))
    else:
        print("\n\n".join(_table(q, h) for q, h in zip(labels, results, strict=True)))
    if args.html or args.png:  # thumbnails only of regular image files inside the gallery's image root
        from .embedded.gallery_index import image_file

        root = getattr(index, "root", None) or args.image_root or index.meta.get("image_root")
        results = [
            [{**hit, "image": image_file(hit["path"], root, f"row {hit['index']}")} for hit in hits]
            for hits in results
        ]

    from modeling_tagclip.atomic_io import write_with

    if args.html:
        if lines is not None:  # beside the timeline, each track once (its best crop)
            from .timeline import per_track

            results = [per_track(hits) for hits in results]
        page = html_report(labels, results, lines)
        write_with(args.html, lambda tmp: tmp.write_text(page, encoding="utf-8"))
        print(f"wrote {args.html}", file=sys.stderr if args.json else sys.stdout)
    if args.png:
        sheet = contact_sheet(labels, results)
        write_with(args.png, lambda tmp: sheet.save(tmp, format="PNG"))
        print(f"wrote {args.png}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _clock(seconds: float | None) -> str:
    from datetime import datetime, timezone

    if seconds is None:
        return "-"
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _timeline_text(query: str, line) -> str:
    """The timeline as text: per camera, its sightings in time order, with the pauses between them."""
    out = [f"query: {query}", f"timeline (UTC; pauses over {line.gap_seconds:g} s marked)"]
    for camera, row in line.cameras.items():
        out.append(f"camera {camera}:")
        pauses = dict(line.gaps.get(camera, []))
        for s in row:
            seek = f"  {s.hit['source']} at {s.hit['seek']:.1f} s" if s.hit.get("seek") is not None else ""
            track = s.hit.get("track") or s.hit["path"]
            out.append(
                f"  {_clock(s.t_start)} - {_clock(s.t_end)[11:]}  score {s.score:.4f}  track {track}{seek}"
            )
            if s.t_end in pauses:
                out.append(f"  ... no sighting for {pauses[s.t_end] - s.t_end:.0f} s")
    if line.undated:
        out.append(f"{len(line.undated)} match(es) without a time")
    if not line.cameras and not line.undated:
        out.append("(no match above the score threshold)")
    return "\n".join(out)


MAX_LINE_CHARS = 100_000  # a longer serve line is answered with an error, never held in memory whole
REQUEST_KEYS = ("query", "like", "track", "set_rule", "text_weight", "top_k", "filters")


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # stdin's surrogateescape stand-ins for bytes that are not UTF-8
_JSON_SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|null|true|false|NaN|-?Infinity")


def _looks_like_json(line: str) -> bool:
    """Whether a serve line is JSON rather than a query: an object, array or string, or a bare JSON scalar."""
    text = line.strip()
    return text[:1] in ("{", "[", '"') or _JSON_SCALAR.fullmatch(text) is not None


def _serve_request(line: str) -> dict[str, Any]:
    """A serve line as a request: a JSON object (``REQUEST_KEYS``) when it is JSON, else the query; JSON
    that is not an object (an array, ``null``, a number) is refused rather than searched for as text."""
    bad = _NOT_UTF8.search(line)
    if bad:
        byte = ord(bad.group()) - 0xDC00
        raise ValueError(f"the line is not valid UTF-8 (byte 0x{byte:02x} at character {bad.start()})")
    if not _looks_like_json(line):
        return {"query": line}
    try:
        request = json.loads(line)
    except RecursionError:
        raise ValueError("the JSON request is nested too deeply") from None
    except ValueError as error:
        raise ValueError(f"the line is not valid JSON ({error})") from None
    if not isinstance(request, dict):
        raise ValueError('a JSON request must be an object {"query": ..., "top_k": ..., "filters": ...}')
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(f"unknown request key(s) {unknown}: use {', '.join(REQUEST_KEYS)}")
    return request


def _serve_line(line: str, args, model, processor, gallery=None) -> dict[str, Any]:
    """One stdin line (a query, or JSON ``{"query", "like", "track", "set_rule", "text_weight", "top_k",
    "filters"}``) -> one JSON-ready answer."""
    from .embedded.gallery_index import GalleryIndex, SearchFilter
    from .encode import encode_texts
    from .queries import example_embeddings, person_search

    request = _serve_request(line)
    text, like, track = request.get("query"), _id_list(request, "like"), _id_list(request, "track")
    if (text is not None and (not isinstance(text, str) or not text.strip())) or not (text or like or track):
        raise ValueError(
            'a request needs a non-empty "query" string, "like" (hit ids) or "track" (CAMERA:TRACK)'
        )
    top_k = request.get("top_k", args.top_k)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r:.60}")
    weight = request.get("text_weight", 0.5)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"text_weight must be a number in [0, 1], got {weight!r:.60}")
    filters = SearchFilter.of(request.get("filters", _filters(args)))  # checked before any work
    if args.milvus_uri:
        index = gallery  # the collection answers with its current content
    else:
        index = GalleryIndex.load(args.index, image_root=args.image_root)  # cached; reloaded after an --add
    crops = example_embeddings(index, like, track)
    texts = encode_texts(model, processor, [text]) if text is not None else None
    top_k = min(top_k, max(1, len(index)))
    hits = person_search(index, texts, crops, top_k, filters, float(weight), request.get("set_rule", "mean"))
    return {"query": _serve_label(text, like, track), "hits": hits[0]}


def _id_list(request: dict[str, Any], key: str) -> list[str]:
    """A request's ``like`` or ``track``: one string or a list of them."""
    value = request.get(key, [])
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise ValueError(f"{key} must be a string or a list of strings, got {value!r:.60}")
    return values


def _serve_label(text: str | None, like: list[str], track: list[str]) -> str:
    """What a serve answer's ``query`` says: the description, and the crops of the gallery it used."""
    parts = [text] if text else []
    parts += ["like " + ", ".join(like)] if like else []
    parts += ["track " + ", ".join(track)] if track else []
    return " + ".join(parts)


def serve_answer(line: str, args, model, processor, gallery=None) -> str:
    """The JSON answer line to one serve line; never raises (a failed request is ``{"error": ...}``)."""
    try:
        return json.dumps(_serve_line(line, args, model, processor, gallery), allow_nan=False)
    except (ValueError, TypeError, LookupError) as error:  # GalleryIndexError and JSON errors are ValueErrors
        return json.dumps({"error": str(error)})
    except Exception as error:  # noqa: BLE001  (one request never takes the server down)
        return json.dumps({"error": f"{type(error).__name__}: {error}"})


def serve_lines(stream, max_chars: int = MAX_LINE_CHARS):
    """Lines of ``stream`` without their newline, at most ``max_chars`` held at a time; a longer line is read
    to its end, dropped, and yielded as ``None``."""
    while True:
        line = stream.readline(max_chars + 1)
        if not line:
            return
        if len(line) > max_chars and not line.endswith("\n"):
            while line and not line.endswith("\n"):
                line = stream.readline(max_chars)
            yield None
        else:
            yield line.rstrip("\n")


def _cmd_serve(args: argparse.Namespace) -> int:
    index, model, processor = _searcher(args)
    print(json.dumps({"ready": True, "images": len(index)}), flush=True)
    if hasattr(sys.stdin, "reconfigure"):
        # bytes that are not UTF-8 reach _serve_request as surrogates and get an error line, never end the server
        sys.stdin.reconfigure(errors="surrogateescape")
    for line in serve_lines(sys.stdin):
        if line is None:
            answer = json.dumps({"error": f"line over {MAX_LINE_CHARS} characters"})
        else:  # an empty line too: every line gets exactly one answer line
            answer = serve_answer(line, args, model, processor, index)
        print(answer, flush=True)
    return 0


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--view", choices=("aerial", "ground"), default=None, help="only crops of this view")
    parser.add_argument("--camera", action="append", default=None, help="only these cameras (repeatable)")
    parser.add_argument(
        "--after", default=None, help="only crops at or after this time (ISO 8601 or epoch s)"
    )
    parser.add_argument("--before", default=None, help="only crops before this time")
    parser.add_argument("--tag", default=None, help="only crops with this tag")


def _add_search_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", default=None, help="index directory from `tagclip index`")
    _milvus_flags(parser)
    parser.add_argument("--model", default=None, help="default: the model the index was built with")
    parser.add_argument("-k", "--top-k", type=positive_int, default=10, metavar="N", help="hits per query")
    parser.add_argument("--image-root", default=None, help="where the indexed images live now, if moved")
    parser.add_argument("--device", default="auto", help="auto: the GPU if there is one, else cpu")
    _add_filters(parser)


def add_index_arguments(index: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip index``."""
    index.description = "Encode a folder of person images into a gallery index (or add to one)."
    index.set_defaults(command="index")
    index.add_argument("--model", default=None, help="saved model folder or Hub repo id (required to index)")
    index.add_argument(
        "--images", default=None, help="folder of images (searched recursively; required to index)"
    )
    index.add_argument(
        "--output",
        dest="out",
        default=None,
        metavar="DIR",
        help="index directory (resumed if a partial build is there)",
    )
    _milvus_flags(index)
    index.add_argument(
        "--index-type",
        choices=sorted(INDEX_TYPES),
        default="flat",
        help="vector index of a new Milvus collection: flat (exact TAG-PR Eq. 14), hnsw, ivf_flat, "
        "ivf_sq8; ivf_pq and diskann on a Milvus server",
    )
    index.add_argument(
        "--index-param",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="Milvus index build parameter (nlist, M, efConstruction, ...); repeatable",
    )
    index.add_argument("--add", action="store_true", help="add the images not yet in the index (no rebuild)")
    index.add_argument(
        "--reid-model",
        default=None,
        metavar="VISA",
        help="a ViSA re-ID model: store its embedding of every crop beside TAG-CLIP's, for "
        "`tagclip search --reid-model`",
    )
    index.add_argument(
        "--add-embeddings",
        choices=("reid",),
        default=None,
        help="add the --reid-model embeddings to an existing gallery (--output or --milvus-uri): "
        "no rebuild, no TAG-CLIP encoding; each crop image is read once, for ViSA; resumable, "
        "and a second run does nothing",
    )
    index.add_argument(
        "--metadata",
        default=None,
        help="CSV/JSON sidecar: path, view, camera, timestamp, tags, track, source, frame, box, t_start, t_end",
    )
    index.add_argument("--batch-size", type=positive_int, default=None, help="default 256 on GPU, 32 on CPU")
    index.add_argument("--shard-size", type=positive_int, default=512, help="images per resumable shard")
    index.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="autocast dtype")
    index.add_argument(
        "--store-dtype",
        choices=("fp32", "fp16", "int8"),
        default=None,
        help="stored vectors (default fp32; fp16 with --ann; int8: 1 byte a dim, a scale a row); fixed when the "
        "index is built",
    )
    index.add_argument(
        "--workers",
        type=nonnegative_int,
        default=min(8, max(0, (os.cpu_count() or 1) - 1)),
        help="DataLoader workers decoding and resizing images",
    )
    index.add_argument("--overwrite", action="store_true", help="rebuild an existing index from scratch")
    index.add_argument(
        "--ann",
        default=None,
        metavar="ivf|ivf-full|FACTORY",
        help="approximate faiss index over the TAG-PR Eq. 14 vector (--ann-on), candidates re-ranked exactly: 'ivf' "
        "(PCA to 128-d + IVF + 4-bit PQ FastScan), 'ivf-full' (no PCA) or a faiss index_factory string; built "
        "once the gallery has 2048 images (a warning says so before)",
    )
    index.add_argument(
        "--ann-param",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="ANN search parameter kept in the index (nprobe, efSearch, k_factor); repeatable",
    )
    index.add_argument(
        "--ann-on",
        choices=("global", "combined"),
        default="combined",
        help="vectors the ANN proposes candidates from: the global embedding, or global + TSE "
        "(the TAG-PR Eq. 14 inner product); candidates are re-ranked exactly either way",
    )
    index.add_argument(
        "--calibration-texts",
        default=None,
        metavar="FILE|none",
        help="captions (a UTF-8 text file, one a line) whose text embeddings a new --ann index calibrates its "
        "search on, beside held-out gallery rows; default: 256 built-in person descriptions; 'none': the "
        "rows alone",
    )
    index.add_argument("--device", default="auto", help="auto: this rank's GPU if any, else cpu")
    index.add_argument("--quiet", action="store_true", help="no progress bar")


def add_remove_arguments(remove: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip remove``."""
    remove.description = "Remove crops from a gallery index (immediate; survives reload)."
    remove.set_defaults(command="remove")
    remove.add_argument("--index", default=None, help="index directory from `tagclip index`")
    _milvus_flags(remove)
    remove.add_argument("paths", nargs="+", help="image paths (relative to the image root, or absolute)")


def add_search_arguments(search: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip search``."""
    search.description = "Rank the indexed gallery for one or more descriptions (or crops) of a person."
    search.set_defaults(command="search")
    search.add_argument("query", nargs="*", help="description(s) of the person")
    _add_search_source(search)
    person = search.add_argument_group("the person: crops of them, results per track, a timeline")
    person.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="CROP",
        help="a crop of the person (repeatable: their mean embedding is the query; with a "
        "description: score fusion, --text-weight); at least 16 pixels a side, at most 16 "
        "megapixels, at most 2 x as wide as tall and 8 x as tall as wide",
    )
    person.add_argument(
        "--like",
        action="append",
        default=None,
        metavar="HIT_ID",
        help="a crop of the gallery as the query, by the 'id' a hit shows (repeatable); its "
        "stored embeddings are the query: no image is read",
    )
    person.add_argument(
        "--track",
        action="append",
        default=None,
        metavar="CAMERA:TRACK",
        help="every crop of a track of the gallery as the query (repeatable; split at the "
        "last colon), from the stored embeddings",
    )
    person.add_argument(
        "--reid-model",
        default=None,
        metavar="VISA",
        help="rank by the gallery's ViSA re-ID embeddings (cosine) with this ViSA model: for "
        "--image, --like and --track, not a description",
    )
    person.add_argument(
        "--query-view",
        choices=("aerial", "ground"),
        default="ground",
        help="with --reid-model: the view the --image crops were taken from",
    )
    person.add_argument(
        "--set-rule",
        choices=("mean", "max"),
        default="mean",
        help="several crops (--image, --like, --track): mean = their mean embedding, max = "
        "each gallery crop's best score against any of them",
    )
    person.add_argument(
        "--text-weight",
        type=fraction,
        default=0.5,
        help="with a description and crops: score = w text score + (1 - w) crops' score",
    )
    person.add_argument("--per-crop", action="store_true", help="one hit per crop, not one per track")
    person.add_argument(
        "--group-by",
        choices=("camera",),
        default=None,
        help="a per-camera timeline of the matching tracks, sorted by time, pauses marked",
    )
    person.add_argument(
        "--min-score", type=finite_float, default=None, help="timeline: only matches scoring at least this"
    )
    person.add_argument(
        "--gap",
        type=nonnegative_seconds,
        default=60.0,
        help="timeline: a pause longer than this many seconds is marked",
    )
    search.add_argument("--html", default=None, help="write a self-contained HTML page of the hits")
    search.add_argument("--png", default=None, help="write a PNG contact sheet of the hits")
    search.add_argument("--json", action="store_true", help="print the hits as JSON")


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip serve``."""
    serve.description = (
        "Keep the index loaded; answer one query per stdin line (plain or JSON; JSON lines out)."
    )
    serve.set_defaults(command="serve")
    _add_search_source(serve)


COMMANDS = {"index": _cmd_index, "remove": _cmd_remove, "search": _cmd_search, "serve": _cmd_serve}


def _quiet_milvus_logs() -> None:
    """pymilvus and Milvus Lite log a failed call as a traceback; the command reports it as one line instead."""
    try:
        import pymilvus  # noqa: F401  (its import configures its loggers: set their level after it)
    except ImportError:
        return  # the command names the missing package
    for name in ("pymilvus", "milvus_lite"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    """``tagclip index|search|serve|remove ...`` from Python (``argv`` starts with the verb): the same as
    ``modeling_tagclip.cli.main``; the exit status."""
    from modeling_tagclip.cli import main as tagclip

    return tagclip(list(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace) -> int:
    """Run the gallery verb ``args.command`` with its parsed flags; the exit status."""
    from modeling_tagclip.failures import describe, storage_errors

    from .milvus import describe_milvus_error, milvus_errors

    if getattr(args, "milvus_uri", None) and not os.environ.get("TAGCLIP_DEBUG"):
        _quiet_milvus_logs()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(args.command)
            return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, ImportError) as error:  # GalleryIndexError is a ValueError
        print(f"tagclip {args.command}: error: {error}{_flag_hint(error)}", file=sys.stderr)
        return 2
    except storage_errors() as error:  # a full, read-only or unwritable disk
        print(f"tagclip {args.command}: error: {describe(error)}", file=sys.stderr)
        return 1
    except milvus_errors() as error:  # a full disk or a lost server under Milvus
        print(
            f"tagclip {args.command}: error: {describe_milvus_error(error, args.milvus_uri)}", file=sys.stderr
        )
        return 1
