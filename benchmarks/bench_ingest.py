"""Ingest benchmark: detection and tracking accuracy on the synthetic footage, and the throughput of each stage.

Accuracy (``--seeds``, default 0 1 2): for each seed the default synthetic footage is rendered and sampled at
``--fps`` (as ``tagclip ingest`` does). Detection recall and precision at IoU 0.5 of the embedded motion
detector; tracking IDF1, MOTA and ID switches of ``ByteTracker`` on the motion detector's boxes and on the
ground-truth boxes with noise (5% of the box size per coordinate) and dropped frames (10%, whole frames).
Every metric is computed by py-motmetrics over all cameras of a view together; rows give the mean and the
standard deviation over seeds. ``--trackers`` adds the Apache-2.0 ``trackers`` package's ByteTrack on the
same detections (install it yourself: ``pip install trackers``; it is not a dependency).

Throughput (``--heights``, default 720 1080): the seed-0 ground camera scaled to each height (16:9) and
encoded with H.264, then decode (PyAV, sampled at ``--fps``), detect (the motion detector, and an
RT-DETR-R18-sized detector with random weights: a real detector's FLOPs at 640x640), track, crop and embed
(the crops of the finished tracks through the TAG-CLIP image tower: ``--model``, else a random-weight model
of the main job's architecture) on ``--threads`` torch threads. Frames per second per stage from wall time,
CPU seconds beside it, and each stage's share of the motion-detector pipeline.

    python benchmarks/bench_ingest.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import RESULTS_DIR, add_allow_dirty, print_table, write_json  # noqa: E402
from modeling_tagclip.video.crops import TrackCrops  # noqa: E402
from modeling_tagclip.video.detect import load_detector  # noqa: E402
from modeling_tagclip.video.footage import render_footage  # noqa: E402
from modeling_tagclip.video.frames import iter_frames  # noqa: E402
from modeling_tagclip.video.mot_eval import (  # noqa: E402
    detection_scores,
    noisy_detections,
    read_gt,
    tracking_scores,
)
from modeling_tagclip.video.track import ByteTracker  # noqa: E402

NOISE, DROP = 0.05, 0.1
MAX_LOST = 8  # tagclip ingest's default, in sampled frames
VIEWS = ("ground", "aerial", "all")


# ----------------------------------------------------------------------------------------------- accuracy
def _frames(video: Path, fps: float) -> list:
    return list(iter_frames(str(video), fps, 0.0))


def _motion(frames: list) -> dict[int, np.ndarray]:
    detector = load_detector("motion")
    out = {}
    for start in range(0, len(frames), detector.batch_size):
        batch = frames[start : start + detector.batch_size]
        for frame, boxes in zip(batch, detector([f.image for f in batch]), strict=True):
            out[frame.index + 1] = boxes
    return out


def _ours(detections: dict[int, np.ndarray], frames: list[int]) -> dict[int, list]:
    tracker = ByteTracker(max_lost=MAX_LOST)
    return {f: [(i, box) for i, box, _ in tracker.update(detections[f])] for f in frames}


def _theirs(detections: dict[int, np.ndarray], frames: list[int]) -> dict[int, list]:
    """The ``trackers`` package's ByteTrack with ours' score thresholds and lost-track buffer (its IoU and
    state estimator defaults)."""
    import supervision as sv
    from trackers import ByteTrackTracker

    tracker = ByteTrackTracker(
        lost_track_buffer=MAX_LOST, track_activation_threshold=0.5, high_conf_det_threshold=0.5
    )
    out = {}
    for f in frames:
        d = np.asarray(detections[f], dtype=np.float32).reshape(-1, 5)
        result = tracker.update(sv.Detections(xyxy=d[:, :4], confidence=d[:, 4]))
        ids = np.asarray(result.tracker_id if result.tracker_id is not None else [], dtype=int)
        out[f] = [(int(i), box) for i, box in zip(ids, result.xyxy, strict=True) if i >= 0]
    return out


def _pool(parts: list[tuple[dict, dict, list[int]]]) -> tuple[dict, dict, list[int]]:
    """Cameras joined into one sequence (frames offset, ids kept apart), so motmetrics scores them together."""
    gt, hyp, frames = {}, {}, []
    for k, (g, h, fs) in enumerate(parts):
        offset = 100_000 * k
        for f in fs:
            ids, boxes = g.get(f, (np.zeros(0, dtype=int), np.zeros((0, 4))))
            gt[f + offset] = (ids + offset, boxes)
            hyp[f + offset] = h[f] if isinstance(h[f], np.ndarray) else [(i + offset, b) for i, b in h[f]]
            frames.append(f + offset)
    return gt, hyp, frames


def accuracy_seed(
    seed: int, root: Path, fps: float, trackers: bool
) -> dict[tuple[str, str], dict[str, float]]:
    """(mode, view) -> scores for one seed's footage."""
    footage = render_footage(root / f"seed{seed}", seed=seed)
    parts: dict[str, list] = {}  # mode -> [(view, gt, hyps, frames)]
    for k, (video, gt_path) in enumerate(zip(footage.videos, footage.gt, strict=True)):
        view = "aerial" if video.stem.startswith("aerial") else "ground"
        gt, frames = read_gt(gt_path), [f.index + 1 for f in _frames(video, fps)]
        motion = _motion(_frames(video, fps))
        noisy = noisy_detections(gt, frames, np.random.default_rng([seed, k]), noise=NOISE, drop=DROP)
        runs = {
            "detection: motion": motion,
            "tracking: motion": _ours(motion, frames),
            "tracking: ground truth + noise": _ours(noisy, frames),
        }
        if trackers:
            runs["tracking: motion, trackers ByteTrack"] = _theirs(motion, frames)
            runs["tracking: ground truth + noise, trackers ByteTrack"] = _theirs(noisy, frames)
        for mode, hyps in runs.items():
            parts.setdefault(mode, []).append((view, gt, hyps, frames))
    out = {}
    for mode, items in parts.items():
        for view in VIEWS:
            chosen = [(g, h, fs) for v, g, h, fs in items if view in ("all", v)]
            gt, hyps, frames = _pool(chosen)
            score = detection_scores if mode.startswith("detection") else tracking_scores
            out[(mode, view)] = score(gt, hyps, frames)
    return out


def accuracy(seeds: list[int], fps: float, trackers: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        per_seed = [accuracy_seed(seed, Path(tmp), fps, trackers) for seed in seeds]
    rows = []
    for key in per_seed[0]:
        row: dict[str, Any] = {"mode": key[0], "view": key[1]}
        for metric in per_seed[0][key]:
            values = [s[key][metric] for s in per_seed]
            row[metric] = statistics.mean(values)
            row[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- end to end
def _tracks_with_identity(video: Path, gt_path: Path, fps: float) -> list[tuple[int, list[np.ndarray]]]:
    """The kept tracks of one camera as (identity, crop images): the identity is the ground-truth id its boxes
    overlap (IoU >= 0.5) most often, -1 for a track that matches no one."""
    from modeling_tagclip.video.track import iou

    frames, gt = _frames(video, fps), read_gt(gt_path)
    detections = _motion(frames)
    tracker = ByteTracker(max_lost=MAX_LOST)
    keeper = TrackCrops(k=3, min_frames=3, min_score=0.3, max_lost=MAX_LOST)
    votes: dict[int, dict[int, int]] = {}
    kept = []
    for frame in frames:
        tracks = tracker.update(detections[frame.index + 1])
        ids, boxes = gt.get(frame.index + 1, (np.zeros(0, dtype=int), np.zeros((0, 4))))
        for track_id, box, _ in tracks:
            overlap = iou(box[None, :4], boxes)[0] if len(boxes) else np.zeros(0)
            if len(overlap) and overlap.max() >= 0.5:
                who = int(ids[int(overlap.argmax())])
                votes.setdefault(track_id, {}).setdefault(who, 0)
                votes[track_id][who] += 1
        kept += keeper.update(frame, tracks)
    kept += keeper.flush()
    best = {t: max(v, key=v.get) for t, v in votes.items()}
    return [(best.get(t.id, -1), [c.image for c in t.crops]) for t in kept]


def _same_identity_crops(model, processor, captions: list, shown: list[int], crop_set: Path | None) -> dict:
    """The crop-level figure on the same identities: the same captions rank the test crops of the identities
    the footage shows (the crop set the main job renders, ``crop_set/test_reid.json``); {} without it."""
    import json

    from modeling_tagclip.metrics.retrieval import retrieval_metrics
    from modeling_tagclip.retrieval.encode import embedding_scores, encode_images, encode_texts

    if crop_set is None or not (crop_set / "test_reid.json").is_file():
        return {}
    entries = [e for e in json.loads((crop_set / "test_reid.json").read_text()) if e["id"] in set(shown)]
    paths = [crop_set / "images" / e["file_path"] for e in entries]
    with torch.inference_mode():
        scores = embedding_scores(
            encode_texts(model, processor, [c for _, c in captions]), encode_images(model, processor, paths)
        )
    metrics = retrieval_metrics(scores.numpy(), [w for w, _ in captions], [e["id"] for e in entries])
    return {"crops": len(entries), "crop_R@1": metrics["R@1"], "crop_mAP": metrics["mAP"]}


def end_to_end(
    model_path: str, seeds: list[int], sample_fps: float, crop_set: Path | None = None, **footage_options: Any
) -> dict[str, Any]:
    """Text -> track R@1 and mAP: each caption of each identity the footage shows ranks every kept track of
    that seed's footage (a track scores as its best crop, TAG-CLIP's TAG-PR Eq. 14 score); beside it, the same
    captions over the test crops of the same identities (``crop_set``). ``footage_options`` go to
    ``render_footage`` (default: the default footage)."""
    import json

    from PIL import Image

    from modeling_tagclip.evaluation.text_retrieval import load_model
    from modeling_tagclip.metrics.retrieval import retrieval_metrics
    from modeling_tagclip.retrieval.encode import embedding_scores, encode_images, encode_texts

    model, processor = load_model(model_path)
    per_seed = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            footage = render_footage(Path(tmp) / f"seed{seed}", seed=seed, **footage_options)
            tracks = [
                t
                for v, g in zip(footage.videos, footage.gt, strict=True)
                for t in _tracks_with_identity(v, g, sample_fps)
            ]
            owner = np.array([k for k, (_, crops) in enumerate(tracks) for _ in crops])
            images = [Image.fromarray(c) for _, crops in tracks for c in crops]
            identities = json.loads(footage.identities.read_text())
            shown = sorted({who for who, _ in tracks if who >= 0})
            captions = [(who, c) for who in shown for c in identities[str(who)]["captions"]]
            with torch.inference_mode():
                crop_scores = embedding_scores(
                    encode_texts(model, processor, [c for _, c in captions]),
                    encode_images(model, processor, images),
                )
            scores = torch.stack([crop_scores[:, owner == k].amax(dim=1) for k in range(len(tracks))], dim=1)
            metrics = retrieval_metrics(scores.numpy(), [w for w, _ in captions], [w for w, _ in tracks])
            per_seed.append(
                {
                    "seed": seed,
                    "tracks": len(tracks),
                    "identities": len(shown),
                    "queries": len(captions),
                    "R@1": metrics["R@1"],
                    "mAP": metrics["mAP"],
                    **_same_identity_crops(model, processor, captions, shown, crop_set),
                }
            )
    crop_level = Path(model_path).parent / "eval_results.json"
    return {
        "model": model_path,
        "per_seed": per_seed,
        "R@1": statistics.mean(r["R@1"] for r in per_seed),
        "mAP": statistics.mean(r["mAP"] for r in per_seed),
        "crop_level": json.loads(crop_level.read_text()) if crop_level.is_file() else None,
        **(
            {"crop_R@1": statistics.mean(r["crop_R@1"] for r in per_seed)}
            if "crop_R@1" in per_seed[0]
            else {}
        ),
    }


# ----------------------------------------------------------------------------------------------- throughput
def _scaled_video(source: Path, out: Path, height: int) -> Path:
    """``source`` scaled to ``height`` (16:9) and encoded with H.264."""
    import av
    from PIL import Image

    width = height * 16 // 9
    with av.open(str(source)) as src, av.open(str(out), "w") as dst:
        rate = src.streams.video[0].average_rate
        stream = dst.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in src.decode(video=0):
            image = frame.to_image().resize((width, height), Image.BILINEAR)
            dst.mux(stream.encode(av.VideoFrame.from_image(image)))
        dst.mux(stream.encode())
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def rtdetr_r18(folder: Path) -> str:
    """An RT-DETR with the R18-vd layout (ResNet-18 backbone, 256-d hybrid encoder, 3 decoder layers, 300
    queries, 80 classes with 'person'), random weights, saved in ``folder``."""
    from transformers import ResNetConfig, RTDetrConfig, RTDetrForObjectDetection, RTDetrImageProcessor

    backbone = ResNetConfig(
        embedding_size=64,
        hidden_sizes=[64, 128, 256, 512],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        out_features=["stage2", "stage3", "stage4"],
    )
    labels = {0: "person", **{i: f"class {i}" for i in range(1, 80)}}
    config = RTDetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        encoder_in_channels=[128, 256, 512],
        decoder_layers=3,
        num_labels=80,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    torch.manual_seed(0)
    RTDetrForObjectDetection(config).eval().save_pretrained(folder)
    RTDetrImageProcessor(size={"height": 640, "width": 640}).save_pretrained(folder)
    return str(folder)


def _embedder(model_path: str | None):
    """(model, processor, name): ``--model``, else the main job's architecture with random weights."""
    from modeling_tagclip import TagClipModel, TagClipProcessor

    if model_path:
        return (
            TagClipModel.from_pretrained(model_path).eval(),
            TagClipProcessor.from_pretrained(model_path),
            model_path,
        )
    from modeling_tagclip.engine.config import read_recipe
    from modeling_tagclip.models.tagclip.configuration_tagclip import TagClipConfig

    recipe = read_recipe("default")
    model = dict(recipe["model"])
    model["vision_config"] = {**model["vision_config"], "image_size": list(recipe["image_size"])}
    torch.manual_seed(0)
    name = "main job architecture, random weights"
    return (
        TagClipModel(TagClipConfig(**model)).eval(),
        TagClipProcessor.from_defaults(*recipe["image_size"]),
        name,
    )


def _embed(model, processor, images: list[np.ndarray]) -> int:
    with torch.inference_mode():
        for start in range(0, len(images), 32):
            pixels = processor(images=images[start : start + 32], return_tensors="pt")["pixel_values"]
            model.get_image_features(pixel_values=pixels)
    return len(images)


def _detect_all(detector, frames: list) -> list[np.ndarray]:
    return [b for s in range(0, len(frames), 8) for b in detector([f.image for f in frames[s : s + 8]])]


def _track_all(detections: list[np.ndarray]) -> list:
    tracker = ByteTracker(max_lost=MAX_LOST)
    return [tracker.update(d) for d in detections]


def _crop_all(frames: list, tracks: list) -> list:
    keeper = TrackCrops(k=3, min_frames=3, min_score=0.3, max_lost=MAX_LOST)
    return [t for f, ts in zip(frames, tracks, strict=True) for t in keeper.update(f, ts)] + keeper.flush()


def _stages(video: Path, fps: float, rtdetr, rtdetr_frames: int, embedder) -> list[dict[str, Any]]:
    """One video through every stage: a row per stage (wall and CPU seconds, frames per second, share)."""
    frames, *decode = _timed(lambda: _frames(video, fps))
    dets, *detect = _timed(lambda: _detect_all(load_detector("motion"), frames))
    sub = frames[:rtdetr_frames]
    _, *detect_rtdetr = _timed(lambda: _detect_all(rtdetr, sub))
    tracks, *track = _timed(lambda: _track_all(dets))
    done, *crop = _timed(lambda: _crop_all(frames, tracks))
    crops = [c.image for t in done for c in t.crops]
    _, *embed = _timed(lambda: _embed(*embedder, crops))
    n = len(frames)
    stages = {
        "decode": (decode, n),
        "detect (motion)": (detect, n),
        "track": (track, n),
        "crop": (crop, n),
        "embed": (embed, n),
    }
    total = sum(t[0] for t, _ in stages.values())
    stages["detect (RT-DETR-R18 size)"] = (detect_rtdetr, len(sub))
    return [
        {
            "stage": stage,
            "frames": count,
            "wall_s": wall,
            "cpu_s": cpu,
            "fps": count / wall,
            "share": wall / total
            if stage in ("decode", "detect (motion)", "track", "crop", "embed")
            else None,
            "crops": len(crops) if stage == "embed" else None,
        }
        for stage, ((wall, cpu), count) in stages.items()
    ]


def throughput(
    heights: list[int], fps: float, model_path: str | None, rtdetr_frames: int
) -> tuple[list, str]:
    rows = []
    model, processor, model_name = _embedder(model_path)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = render_footage(tmp / "footage", seed=0, aerial_cameras=0, ground_cameras=1).videos[0]
        rtdetr = load_detector(rtdetr_r18(tmp / "rtdetr"), threshold=0.5, batch_size=8)
        for height in heights:
            video = _scaled_video(source, tmp / f"{height}.mp4", height)
            rows += [
                {"height": height, **row}
                for row in _stages(video, fps, rtdetr, rtdetr_frames, (model, processor))
            ]
    return rows, model_name


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--fps", type=float, default=4.0, help="frames taken per second (tagclip ingest's default)"
    )
    parser.add_argument("--heights", type=int, nargs="*", default=[720, 1080])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rtdetr-frames", type=int, default=8, help="frames the RT-DETR-sized detector is timed on"
    )
    parser.add_argument("--model", default=None, help="TAG-CLIP folder for the embed stage")
    parser.add_argument("--trackers", action="store_true", help="also run the trackers package's ByteTrack")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the detection and tracking scores")
    parser.add_argument(
        "--crop-set",
        type=Path,
        default=Path("data/synthetic"),
        help="with --model: the rendered crop set whose test crops of the same identities give "
        "the crop-level figure beside text -> track",
    )
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "ingest_cpu.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    acc = [] if args.no_accuracy else accuracy(args.seeds, args.fps, args.trackers)
    print_table(acc, ["mode", "view", "recall", "precision", "idf1", "mota", "num_switches"])
    speed, model_name = (
        throughput(args.heights, args.fps, args.model, args.rtdetr_frames) if args.heights else ([], None)
    )
    print_table(speed, ["height", "stage", "frames", "fps", "cpu_s", "share"])
    if args.model:
        payload_e2e = end_to_end(args.model, args.seeds, args.fps, crop_set=args.crop_set)
        print(f"text -> track: R@1 {payload_e2e['R@1']:.2f}, mAP {payload_e2e['mAP']:.2f}")
    payload = {
        "seeds": args.seeds,
        "fps": args.fps,
        "noise": NOISE,
        "drop": DROP,
        "max_lost": MAX_LOST,
        "threads": args.threads,
        "embed_model": model_name,
        "load_average_1m_before": load,
        "accuracy": acc,
        "throughput": speed,
        "end_to_end": payload_e2e if args.model else None,
    }
    write_json(args.output, payload)
    print(f"wrote {args.output}")
    return payload


if __name__ == "__main__":
    main()
