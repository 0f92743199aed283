"""Image re-ID metrics (CMC Rank-k, mAP, mINP) with fast-reid's same-camera filtering, and the evaluation
protocols of CARGO, AG-ReID.v2 and LAGPeR (spec ``visa.md`` §6).

For each query the gallery is ranked by distance (1 - cosine of L2-normalised features); gallery items with
the query's identity *and* camera id are removed; queries left without a match are skipped. On the rest:
CMC_k = [first match within k], AP = mean precision at the matches, INP = num_rel / (rank of the last match).
Values are percentages. Ties rank the lower gallery index first (stable sort; fast-reid's argsort is not
stable, which only matters for exactly tied distances).

Protocols (``Protocol``) select query/gallery subsets and the camera ids used for filtering: the actual
cameras, or the view (aerial 0 / ground 1) for the collapsed cross-view protocols.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from modeling_tagclip.metrics.retrieval import _to_numpy

__all__ = [
    "AERIAL",
    "GROUND",
    "Protocol",
    "cosine_distances",
    "evaluate_protocols",
    "reid_metrics",
    "view_protocols",
]

AERIAL, GROUND = 0, 1


def cosine_distances(query_features: Any, gallery_features: Any) -> np.ndarray:
    """1 - cos between L2-normalised rows, in float32 (fast-reid's evaluator)."""
    query = torch.nn.functional.normalize(torch.as_tensor(_to_numpy(query_features)).float(), dim=1)
    gallery = torch.nn.functional.normalize(torch.as_tensor(_to_numpy(gallery_features)).float(), dim=1)
    return (1.0 - query @ gallery.t()).numpy()


def _check(distances: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    n_query, n_gallery = distances.shape if distances.ndim == 2 else (-1, -1)
    expected = (n_query, n_gallery, n_query, n_gallery)
    sizes = tuple(len(a) for a in arrays)
    if distances.ndim != 2 or sizes != expected:
        raise ValueError(
            f"distances must be [n_query, n_gallery] matching (q_pids, g_pids, q_camids, g_camids) of sizes "
            f"{sizes}, got shape {distances.shape}"
        )
    if distances.size == 0:
        raise ValueError("empty query set or gallery")


def _chunk_scores(dist, q_pids, g_pids, q_cams, g_cams, ks) -> dict[str, np.ndarray]:
    """Per-query CMC hits, AP, INP and validity for one chunk, vectorised over queries."""
    order = np.argsort(dist, axis=1, kind="stable")
    same_id = g_pids[order] == q_pids[:, None]
    keep = ~(same_id & (g_cams[order] == q_cams[:, None]))  # drop same identity on the same camera
    matches = same_id & keep
    rank = np.maximum(np.cumsum(keep, axis=1) - 1, 0)  # position among the kept items
    num_rel = matches.sum(axis=1)
    valid = num_rel > 0
    hits = np.cumsum(matches, axis=1)
    first = matches.argmax(axis=1)
    last = matches.shape[1] - 1 - matches[:, ::-1].argmax(axis=1)
    rows = np.arange(len(order))
    first_rank, last_rank = rank[rows, first], rank[rows, last]
    safe_rel = np.maximum(num_rel, 1)
    scores = {f"R{k}": (first_rank < k) & valid for k in ks}
    scores["mAP"] = (matches * hits / (rank + 1.0)).sum(axis=1) / safe_rel
    scores["mINP"] = num_rel / (last_rank + 1.0)
    scores["valid"] = valid
    return scores


def reid_metrics(
    distances: Any,
    q_pids: Any,
    g_pids: Any,
    q_camids: Any,
    g_camids: Any,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 256,
) -> dict[str, float]:
    """CMC R@k, mAP, mINP (percent) with same-identity-same-camera removal (fast-reid `eval_market1501`).

    Also returns ``metric`` = (mAP + R1) / 2 (the reference's model-selection score) and the number of
    valid queries. Raises ``ValueError`` if no query has a match left after filtering.
    """
    dist = _to_numpy(distances).astype(np.float32, copy=False)
    arrays = [_to_numpy(a).reshape(-1) for a in (q_pids, g_pids, q_camids, g_camids)]
    _check(dist, arrays)
    q_pids, g_pids, q_cams, g_cams = arrays
    sums: dict[str, float] = {}
    for start in range(0, dist.shape[0], chunk_size):
        stop = start + chunk_size
        scores = _chunk_scores(dist[start:stop], q_pids[start:stop], g_pids, q_cams[start:stop], g_cams, ks)
        valid = scores.pop("valid")
        sums["valid"] = sums.get("valid", 0) + int(valid.sum())
        for key, values in scores.items():
            sums[key] = sums.get(key, 0.0) + float(values[valid].sum())
    num_valid = int(sums.pop("valid"))
    if num_valid == 0:
        raise ValueError("no query has a matching gallery item left after same-camera filtering")
    out = {key: 100.0 * total / num_valid for key, total in sums.items()}
    out["metric"] = (out["mAP"] + out["R1"]) / 2
    out["num_queries"] = num_valid
    return out


@dataclass(frozen=True)
class Protocol:
    """A query/gallery selection (indices; ``None`` = all) and the camera ids used for filtering.

    ``camera_ids="camera"`` filters same-identity items on the query's camera; ``"view"`` collapses the cameras
    to the view (aerial 0 / ground 1), as CARGO's cross-view protocols do.
    """

    query: np.ndarray | None = None
    gallery: np.ndarray | None = None
    camera_ids: str = "camera"
    description: str = ""


def view_protocols(query_views: Any, gallery_views: Any) -> dict[str, Protocol]:
    """CARGO's protocols (docs/visa-reference.md §6.2) from the views of a query set and a gallery; also for
    synthetic data.

    ``A<->G`` is ViSA's / SeCap's definition (aerial queries against the ground gallery); ``A<->G (VDT)`` is
    the original VDT one (everything, cameras collapsed to views, both directions pooled); ``G->A`` exists in
    ViSA's code but not in its configs.
    """
    q_views, g_views = _to_numpy(query_views).reshape(-1), _to_numpy(gallery_views).reshape(-1)
    q_aerial, q_ground = np.flatnonzero(q_views == AERIAL), np.flatnonzero(q_views == GROUND)
    g_aerial, g_ground = np.flatnonzero(g_views == AERIAL), np.flatnonzero(g_views == GROUND)
    return {
        "ALL": Protocol(description="all queries vs the whole gallery"),
        "A<->G": Protocol(q_aerial, g_ground, "view", "aerial queries vs ground gallery (ViSA / SeCap)"),
        "G<->G": Protocol(q_ground, g_ground, "camera", "ground queries vs ground gallery"),
        "A<->A": Protocol(q_aerial, g_aerial, "camera", "aerial queries vs aerial gallery"),
        "A<->G (VDT)": Protocol(None, None, "view", "all vs all, cameras collapsed to views (VDT, pooled)"),
        "G->A": Protocol(q_ground, g_aerial, "view", "ground queries vs aerial gallery"),
    }


def _column(table: Any, key: str) -> np.ndarray:
    """A column of a `datasets.Dataset`, a mapping of arrays, or a pandas-like table."""
    return _to_numpy(table[key]).reshape(-1)


def _select(array: np.ndarray, index: np.ndarray | None) -> np.ndarray:
    return array if index is None else array[index]


def evaluate_protocols(
    query_features: Any,
    gallery_features: Any,
    query: Mapping[str, Any] | Any,
    gallery: Mapping[str, Any] | Any,
    protocols: Mapping[str, Protocol],
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, dict[str, float]]:
    """Metrics for every protocol. ``query`` / ``gallery`` give ``person_id``, ``camera_id`` and ``view`` per
    row (a `datasets.Dataset` or a dict of arrays), aligned with the feature rows.

    A protocol with no valid query reports ``{"num_queries": 0}`` instead of raising.
    """
    distances = cosine_distances(query_features, gallery_features)
    columns = {
        side: {key: _column(table, key) for key in ("person_id", "camera_id", "view")}
        for side, table in (("query", query), ("gallery", gallery))
    }
    results = {}
    for name, protocol in protocols.items():
        q_index, g_index = protocol.query, protocol.gallery
        cam_key = "view" if protocol.camera_ids == "view" else "camera_id"
        sub = distances if q_index is None else distances[q_index]
        sub = sub if g_index is None else sub[:, g_index]
        q, g = columns["query"], columns["gallery"]
        try:
            results[name] = reid_metrics(
                sub,
                _select(q["person_id"], q_index),
                _select(g["person_id"], g_index),
                _select(q[cam_key], q_index),
                _select(g[cam_key], g_index),
                ks=ks,
            )
        except ValueError:
            results[name] = {"num_queries": 0}
    return results
