"""Cross-view following on the synthetic footage: image query -> the same person's tracks in the other view,
and description -> first sighting -> that track as the query -> the person's timeline.

For each footage seed (``--seeds``, default 0 1 2) the synthetic footage is rendered (``--footage``: a larger
cast than ``tagclip ingest``'s default, so that the top 20 is a small part of the gallery) and ingested by
``tagclip ingest`` with ``--model`` (motion detector, ``--fps`` frames a second, 3 crops a track) into an
embedded gallery index. Each track gets the identity that its crops' boxes overlap in the MOT ground truth
(IoU >= 0.5, majority of its crops; -1 when none: a distractor).

- **Image query -> other view.** ground->aerial: each ground track of a person who also has an aerial track is
  a query (the mean of its crops' embeddings: ``retrieval.queries.set_query``, the ``mean`` rule); every
  aerial track is the gallery, scored by its best crop (as ``tagclip search`` ranks tracks). R@1 and mAP over
  the queries; aerial->ground the other way round. Embeddings: TAG-CLIP's image embeddings from the gallery
  index (global + TSE, each L2-normalised, scored by TAG-PR Eq. 14 through ``combined_vectors``), and ViSA's test
  embedding (``--reid-models``, one per seed, paired with the footage seed in order; each crop with its
  camera's view), each plain and with k-reciprocal re-ranking (``metrics.rerank``; query tracks and gallery
  crops pooled).
- **Description -> timeline.** Each caption of each identity the footage shows ranks the tracks (TAG-CLIP
  text, a track scored by its best crop); the top track is the first sighting; that track (its crops' mean
  embedding, TAG-CLIP or ViSA) ranks every track; the share of the person's true tracks in the top
  ``--top`` (20) is the figure. By the first sighting's view: ground->aerial counts the person's aerial
  tracks, aerial->ground the ground ones, ``all`` every true track of the person.

Cells are mean ± 95% CI half-width (Student t) over the seeds.

    python benchmarks/bench_crossview.py --model outputs/tagclip-synthetic/best \\
        --reid-models runs/visa-s0/best runs/visa-s1/best runs/visa-s2/best
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import RESULTS_DIR, add_allow_dirty, check_publishable, print_table, write_json  # noqa: E402

FOOTAGE = {"ground_cameras": 6, "aerial_cameras": 3, "people": 24, "people_per_camera": 8, "seconds": 24.0}
DIRECTIONS = {"ground->aerial": ("ground", "aerial"), "aerial->ground": ("aerial", "ground")}
MIN_IOU = 0.5
TOP = 20


@dataclass(frozen=True)
class Track:
    """One ingested track: its camera and track id, view, true identity (-1: none) and gallery rows."""

    camera: str
    track: str
    view: str
    identity: int
    rows: tuple[int, ...]


# ----------------------------------------------------------------------------------------------- the gallery
def ingest(footage: Any, model: str, out: Path, fps: float) -> Path:
    """``tagclip ingest VIDEOS --cameras cameras.yaml --model MODEL --out OUT --fps FPS``; returns OUT."""
    from modeling_tagclip.video.cli import main as ingest_main

    argv = [str(footage.root / "videos"), "--cameras", str(footage.cameras), "--model", model,
            "--out", str(out), "--fps", f"{fps:g}"]  # fmt: skip
    if ingest_main(argv) != 0:
        raise RuntimeError(f"tagclip ingest {' '.join(argv)} failed")
    return out


def identity_of(crops: Sequence[dict[str, str]], gt: dict[str, dict]) -> int:
    """The ground-truth id most of a track's crops overlap (IoU >= ``MIN_IOU`` with the detection box in the
    crop's frame; the best-overlapping true box per crop), -1 when none does."""
    from modeling_tagclip.video.track import iou

    votes: Counter[int] = Counter()
    for crop in crops:
        ids, boxes = gt[crop["camera"]].get(int(crop["frame"]) + 1, (np.zeros(0, int), np.zeros((0, 4))))
        if not len(boxes):
            continue
        overlap = iou(np.array([[float(v) for v in crop["box"].split()]]), boxes)[0]
        if overlap.max() >= MIN_IOU:
            votes[int(ids[int(overlap.argmax())])] += 1
    return votes.most_common(1)[0][0] if votes else -1


def gallery_tracks(index: Any, crops_root: Path, gt_folder: Path) -> list[Track]:
    """The tracks of an ingested gallery (its crops' manifest), each with its true identity and index rows."""
    from modeling_tagclip.video.manifest import read_manifest
    from modeling_tagclip.video.mot_eval import read_gt

    row_of = {str(Path(path).resolve()): i for i, path in enumerate(index.paths)}
    grouped: dict[tuple[str, str], list[dict[str, str]]] = {}
    for crop in read_manifest(crops_root):
        grouped.setdefault((crop["camera"], crop["track"]), []).append(crop)
    gt = {camera: read_gt(gt_folder / f"{camera}.txt") for camera in {c for c, _ in grouped}}
    return [
        Track(
            camera,
            track,
            crops[0]["view"],
            identity_of(crops, gt),
            tuple(row_of[str((crops_root / c["path"]).resolve())] for c in crops),
        )
        for (camera, track), crops in sorted(grouped.items())
    ]


def tagclip_vectors(embeds: dict[str, torch.Tensor]) -> torch.Tensor:
    """The gallery's TAG-CLIP rows as vectors whose inner product is TAG-PR Eq. 14 (global + TSE, each normalised)."""
    from modeling_tagclip.retrieval.encode import combined_vectors

    return combined_vectors({key: embeds[key].float() for key in ("global", "local") if key in embeds})


def visa_vectors(model_path: str, paths: Sequence[Path], views: Sequence[str]) -> torch.Tensor:
    """L2-normalised ViSA test embeddings of crop files, each encoded with its view label."""
    from modeling_tagclip.evaluation.reid import encode, load_visa
    from modeling_tagclip.models.tagclip.configuration_tagclip import VIEW_NAMES

    table = {"image_path": [str(p) for p in paths], "view": [VIEW_NAMES.index(v) for v in views]}
    return torch.nn.functional.normalize(encode(load_visa(model_path), table), dim=1)


# ----------------------------------------------------------------------------------------------- scoring
def track_query(vectors: torch.Tensor, track: Track) -> torch.Tensor:
    """A track as a query [d]: the mean of its crops' vectors (``set_query``, the ``mean`` rule)."""
    from modeling_tagclip.retrieval.queries import set_query

    return set_query({"global": vectors[list(track.rows)]})["global"][0]


def track_scores(
    queries: torch.Tensor, vectors: torch.Tensor, gallery: Sequence[Track], rerank: Any = None
) -> torch.Tensor:
    """[n_queries, n_tracks]: each gallery track scored by its best crop; ``rerank`` (a ``RerankConfig``):
    by the negated k-reciprocal distance of the pooled query tracks and gallery crops."""
    rows = [r for t in gallery for r in t.rows]
    owner = torch.tensor([j for j, t in enumerate(gallery) for _ in t.rows])
    if rerank is None:
        crops = queries @ vectors[rows].T
    else:
        from modeling_tagclip.metrics.rerank import k_reciprocal_rerank

        crops = -torch.from_numpy(k_reciprocal_rerank(queries, vectors[rows], rerank))
    return torch.stack([crops[:, owner == j].amax(dim=1) for j in range(len(gallery))], dim=1)


def cross_view(vectors: torch.Tensor, tracks: Sequence[Track], direction: str, rerank: Any = None) -> dict:
    """R@1 and mAP (percent) of the ``direction`` protocol; None with no query (no person in both views)."""
    from modeling_tagclip.metrics.retrieval import retrieval_metrics

    source, target = DIRECTIONS[direction]
    gallery = [t for t in tracks if t.view == target]
    wanted = {t.identity for t in gallery if t.identity >= 0}
    queries = [t for t in tracks if t.view == source and t.identity in wanted]
    out = {"queries": len(queries), "gallery_tracks": len(gallery)}
    if not queries:
        return {**out, "R@1": None, "mAP": None}
    scores = track_scores(torch.stack([track_query(vectors, q) for q in queries]), vectors, gallery, rerank)
    metrics = retrieval_metrics(scores.numpy(), [q.identity for q in queries], [t.identity for t in gallery])
    return {**out, "R@1": metrics["R@1"], "mAP": metrics["mAP"]}


def follow(
    text: torch.Tensor, captions: Sequence[int], text_vectors: torch.Tensor, vectors: torch.Tensor,
    tracks: Sequence[Track], top: int = TOP,
) -> dict[str, dict]:  # fmt: skip
    """Description -> first sighting -> that track as the query -> its top ``top`` tracks: per direction (the
    first sighting's view) the mean share of the person's true tracks of the other view found there (``all``:
    of all the person's tracks) and how often the first sighting is the person. ``text``: caption vectors
    (TAG-PR Eq. 14 against ``text_vectors``), ``captions``: their identities; ``vectors``: the image query's space."""
    first = track_scores(text, text_vectors, tracks).argmax(dim=1)
    shares: dict[str, list[float]] = {name: [] for name in (*DIRECTIONS, "all")}
    right: dict[str, list[bool]] = {name: [] for name in shares}
    for who, start in zip(captions, first.tolist(), strict=True):
        sighting = tracks[start]
        scores = track_scores(track_query(vectors, sighting)[None], vectors, tracks)[0]
        order = scores.argsort(descending=True, stable=True)
        found = {tracks[j] for j in order[:top].tolist()}
        for name, (source, target) in [*DIRECTIONS.items(), ("all", (None, None))]:
            if source is not None and sighting.view != source:
                continue
            true = [t for t in tracks if t.identity == who and (target is None or t.view == target)]
            if true:
                shares[name].append(100.0 * sum(t in found for t in true) / len(true))
                right[name].append(sighting.identity == who)
    return {
        name: {"queries": len(shares[name]),
               "share": float(np.mean(shares[name])) if shares[name] else None,
               "first_right": 100.0 * float(np.mean(right[name])) if right[name] else None}
        for name in shares
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------- one seed
def measure_seed(seed: int, args: argparse.Namespace, reid_model: str | None, work: Path) -> dict[str, Any]:
    """One footage seed: render, ingest, then every protocol for every embedding."""
    from modeling_tagclip.metrics.rerank import RerankConfig
    from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
    from modeling_tagclip.retrieval.encode import encode_texts
    from modeling_tagclip.retrieval.loading import load_model
    from modeling_tagclip.video.footage import render_footage

    footage = render_footage(work / f"footage-{seed}", seed=seed, **args.footage)
    out = ingest(footage, args.model, work / f"gallery-{seed}.idx", args.fps)
    index = GalleryIndex.load(out)
    crops_root = Path(f"{out}.crops")
    tracks = gallery_tracks(index, crops_root, footage.root / "gt")
    spaces = {"TAG-CLIP": tagclip_vectors(index.embeds)}
    if reid_model:
        views = [""] * len(index)
        for t in tracks:
            for r in t.rows:
                views[r] = t.view
        spaces["ViSA"] = visa_vectors(reid_model, [Path(p) for p in index.paths], views)
    rerank = RerankConfig(args.k1, args.k2, args.lambda_value)
    image = {f"{name}{suffix}": {d: cross_view(v, tracks, d, config) for d in DIRECTIONS}
             for name, v in spaces.items() for suffix, config in (("", None), (" + re-ranking", rerank))}  # fmt: skip
    identities = json.loads(footage.identities.read_text())
    shown = sorted({t.identity for t in tracks if t.identity >= 0})
    captions = [(who, c) for who in shown for c in identities[str(who)]["captions"]]
    model, processor = load_model(args.model)
    text = tagclip_vectors(encode_texts(model, processor, [c for _, c in captions]))
    chain = {name: follow(text, [w for w, _ in captions], spaces["TAG-CLIP"], v, tracks, args.top)
             for name, v in spaces.items()}  # fmt: skip
    return {"seed": seed, "reid_model": reid_model, "tracks": len(tracks), "identities": len(shown),
            "distractor_tracks": sum(t.identity < 0 for t in tracks), "captions": len(captions),
            "views": dict(Counter(t.view for t in tracks)), "image": image, "timeline": chain}  # fmt: skip


# ----------------------------------------------------------------------------------------------- summary
def _cell(values: list[float | None]) -> str | None:
    """``mean ± CI`` over the seeds that measured it (None when none did)."""
    from modeling_tagclip.ablation import mean_ci

    values = [v for v in values if v is not None]
    if not values:
        return None
    stats = mean_ci(values)
    return f"{stats['mean']:.2f}" if stats["n"] == 1 else f"{stats['mean']:.2f} ± {stats['ci95']:.2f}"


def summary_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Image query -> other view: one row per embedding and direction."""
    return [
        {"embedding": name, "direction": d, "seeds": len(runs),
         "queries": sum(r["image"][name][d]["queries"] for r in runs),
         "gallery_tracks": sum(r["image"][name][d]["gallery_tracks"] for r in runs),
         "R@1": _cell([r["image"][name][d]["R@1"] for r in runs]),
         "mAP": _cell([r["image"][name][d]["mAP"] for r in runs])}
        for name in runs[0]["image"] for d in DIRECTIONS
    ]  # fmt: skip


def timeline_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Description -> timeline: one row per image-query embedding and direction (and all)."""
    return [
        {"embedding": name, "direction": d, "seeds": len(runs),
         "queries": sum(r["timeline"][name][d]["queries"] for r in runs),
         "first_right": _cell([r["timeline"][name][d]["first_right"] for r in runs]),
         "share": _cell([r["timeline"][name][d]["share"] for r in runs])}
        for name in runs[0]["timeline"] for d in (*DIRECTIONS, "all")
    ]  # fmt: skip


def _footage(text: str) -> dict[str, Any]:
    """``--footage`` JSON: ``render_footage`` options over ``FOOTAGE``."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of render_footage options, got {text!r}")
    return {**FOOTAGE, **options}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from modeling_tagclip.metrics.rerank import RerankConfig

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="outputs/tagclip-synthetic/best", help="TAG-CLIP folder")
    parser.add_argument("--reid-models", nargs="*", default=[],
                        help="ViSA folders, one per seed (paired in order; fewer are reused cyclically)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="footage seeds")
    parser.add_argument("--footage", type=_footage, default=dict(FOOTAGE),
                        help=f"render_footage options as JSON, over {json.dumps(FOOTAGE)}")  # fmt: skip
    parser.add_argument("--fps", type=float, default=4.0, help="frames taken per second (ingest's default)")
    parser.add_argument("--top", type=int, default=TOP, help="tracks of the timeline (default %(default)s)")
    parser.add_argument("--k1", type=int, default=RerankConfig.k1)
    parser.add_argument("--k2", type=int, default=RerankConfig.k2)
    parser.add_argument("--lambda-value", type=float, default=RerankConfig.lambda_value)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "crossview_cpu.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    check_publishable(args.output)  # before the measurement, not after it
    RerankConfig(args.k1, args.k2, args.lambda_value)  # bad settings fail now
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model} is not a saved TAG-CLIP folder")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            measure_seed(seed, args, args.reid_models[k % len(args.reid_models)] if args.reid_models else None,
                         Path(tmp))
            for k, seed in enumerate(args.seeds)
        ]  # fmt: skip
    payload = {"benchmark": "crossview", "model": args.model, "reid_models": args.reid_models,
               "seeds": args.seeds, "footage": args.footage, "fps": args.fps, "top": args.top,
               "rerank": {"k1": args.k1, "k2": args.k2, "lambda_value": args.lambda_value},
               "rows": summary_rows(runs), "timeline_rows": timeline_rows(runs), "runs": runs}  # fmt: skip
    print_table(payload["rows"], ["embedding", "direction", "queries", "R@1", "mAP"])
    print_table(payload["timeline_rows"], ["embedding", "direction", "queries", "first_right", "share"])
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
