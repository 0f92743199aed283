"""Image re-ID metrics (CMC Rank-k, mAP, mINP) with fast-reid's same-camera filtering, computed exactly in
bounded memory, and the evaluation protocols of CARGO, AG-ReID.v2 and LAGPeR.

For each query the gallery is ranked by distance (1 - cosine of L2-normalised features); gallery items with
the query's identity *and* camera id are removed; queries left without a match are skipped. On the rest:
CMC_k = [first match within k], AP = mean precision at the matches, INP = num_rel / (rank of the last match).
Values are percentages. Ties rank the lower gallery index first (a stable sort; fast-reid's argsort is not
stable, which only matters for exactly tied distances).

As for text retrieval (``modeling_tagclip.metrics.retrieval``), no row is sorted: the rank of each item of the
query's identity is counted, and a match's rank after filtering is its rank minus the removed items ranked
before it. Queries stream through in chunks of [chunk, n_gallery] distances.

Protocols (``Protocol``) select query/gallery subsets and the camera ids used for filtering: the actual
cameras, or the view (aerial 0 / ground 1) for the collapsed cross-view protocols.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from modeling_tagclip.metrics.rerank import RerankConfig, k_reciprocal_rerank
from modeling_tagclip.metrics.retrieval import IdentityIndex, _to_numpy, positive_ranks, rank_metrics
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND

__all__ = [
    "AERIAL",
    "GROUND",
    "Protocol",
    "cosine_distances",
    "evaluate_protocols",
    "reid_metrics",
    "stream_reid_metrics",
    "view_protocols",
]


def _normalized(features: Any) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.as_tensor(_to_numpy(features)).float(), dim=1)


def cosine_distances(query_features: Any, gallery_features: Any) -> np.ndarray:
    """1 - cos between L2-normalised rows, in float32 (fast-reid's evaluator)."""
    return (1.0 - _normalized(query_features) @ _normalized(gallery_features).t()).numpy()


def _chunk_values(dist, codes, q_cams, identities, g_cams, ks) -> torch.Tensor:
    """[hit@k..., AP, INP] of the queries of one chunk that keep a match after same-camera filtering."""
    present = codes >= 0
    dist, codes, q_cams = dist[present], codes[present], q_cams[present]
    if len(codes) == 0:
        return torch.zeros(0, len(ks) + 2, dtype=torch.float64)
    candidates, same_id = identities.candidates(codes)
    junk = same_id & (g_cams[candidates] == q_cams[:, None])  # same identity on the same camera: removed
    ranks = positive_ranks(-dist, candidates)
    junk_before = (junk[:, None, :] & (ranks[:, None, :] < ranks[:, :, None])).sum(2)
    relevant = same_id & ~junk
    valid = relevant.any(1)
    return rank_metrics((ranks - junk_before)[valid], relevant[valid], ks)


def _reduce(sums: torch.Tensor, count: int, ks: Sequence[int]) -> dict[str, float]:
    if count == 0:
        raise ValueError("no query has a matching gallery item left after same-camera filtering")
    names = [f"R{k}" for k in ks] + ["mAP", "mINP"]
    out = {name: 100.0 * float(sums[i]) / count for i, name in enumerate(names)}
    out["metric"] = (out["mAP"] + out["R1"]) / 2
    out["num_queries"] = count
    return out


def _stream(distances, q_pids, g_pids, q_cams, g_cams, ks, chunk_size) -> dict[str, float]:
    """Metrics over queries, ``distances(start, stop)`` giving the [stop - start, n_gallery] block."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    identities = IdentityIndex(g_pids)
    codes, q_cams, g_cams = (
        identities.codes(q_pids, strict=False),
        torch.as_tensor(q_cams),
        torch.as_tensor(g_cams),
    )
    sums, count = torch.zeros(len(ks) + 2, dtype=torch.float64), 0
    for start in range(0, len(codes), chunk_size):
        stop = start + chunk_size
        values = _chunk_values(
            distances(start, stop), codes[start:stop], q_cams[start:stop], identities, g_cams, ks
        )
        sums, count = sums + values.sum(0), count + len(values)
    return _reduce(sums, count, ks)


def _check(n_query: int, n_gallery: int, arrays: Sequence[np.ndarray], shape: tuple) -> None:
    sizes = tuple(len(a) for a in arrays)
    if len(shape) != 2 or sizes != (n_query, n_gallery, n_query, n_gallery):
        raise ValueError(
            f"distances must be [n_query, n_gallery] matching (q_pids, g_pids, q_camids, g_camids) of sizes "
            f"{sizes}, got shape {shape}"
        )
    if n_query == 0 or n_gallery == 0:
        raise ValueError("empty query set or gallery")


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
    dist = torch.from_numpy(_to_numpy(distances).astype(np.float32, copy=False))
    arrays = [_to_numpy(a).reshape(-1) for a in (q_pids, g_pids, q_camids, g_camids)]
    n_query, n_gallery = dist.shape if dist.ndim == 2 else (-1, -1)
    _check(n_query, n_gallery, arrays, tuple(dist.shape))
    return _stream(lambda start, stop: dist[start:stop], *arrays, ks, chunk_size)


def stream_reid_metrics(
    query_features: Any,
    gallery_features: Any,
    q_pids: Any,
    g_pids: Any,
    q_camids: Any,
    g_camids: Any,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 256,
) -> dict[str, float]:
    """``reid_metrics`` from features, computing the cosine distances ``chunk_size`` queries at a time."""
    query, gallery = _normalized(query_features), _normalized(gallery_features)
    arrays = [_to_numpy(a).reshape(-1) for a in (q_pids, g_pids, q_camids, g_camids)]
    _check(len(query), len(gallery), arrays, (len(query), len(gallery)))
    return _stream(lambda start, stop: 1.0 - query[start:stop] @ gallery.t(), *arrays, ks, chunk_size)


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


def _select(array: Any, index: np.ndarray | None) -> Any:
    return (
        array
        if index is None
        else array[torch.as_tensor(index) if isinstance(array, torch.Tensor) else index]
    )


def evaluate_protocols(
    query_features: Any,
    gallery_features: Any,
    query: Mapping[str, Any] | Any,
    gallery: Mapping[str, Any] | Any,
    protocols: Mapping[str, Protocol],
    ks: Sequence[int] = (1, 5, 10),
    rerank: RerankConfig | None = None,
) -> dict[str, dict[str, float]]:
    """Metrics for every protocol. ``query`` / ``gallery`` give ``person_id``, ``camera_id`` and ``view`` per
    row (a `datasets.Dataset` or a dict of arrays), aligned with the feature rows. ``rerank``: rank each
    protocol by k-reciprocal re-ranked distances (``metrics.rerank``) of its own queries and gallery.

    A protocol with no valid query reports ``{"num_queries": 0}`` instead of raising.
    """
    query_features = torch.as_tensor(_to_numpy(query_features)).float()  # normalised per protocol (row-wise)
    gallery_features = torch.as_tensor(_to_numpy(gallery_features)).float()
    columns = {
        side: {key: _column(table, key) for key in ("person_id", "camera_id", "view")}
        for side, table in (("query", query), ("gallery", gallery))
    }
    results = {}
    for name, protocol in protocols.items():
        q_index, g_index = protocol.query, protocol.gallery
        cam_key = "view" if protocol.camera_ids == "view" else "camera_id"
        q, g = columns["query"], columns["gallery"]
        metric = stream_reid_metrics if rerank is None else _reranked_metrics(rerank)
        try:
            results[name] = metric(
                _select(query_features, q_index),
                _select(gallery_features, g_index),
                _select(q["person_id"], q_index),
                _select(g["person_id"], g_index),
                _select(q[cam_key], q_index),
                _select(g[cam_key], g_index),
                ks=ks,
            )
        except ValueError:
            results[name] = {"num_queries": 0}
    return results


def _reranked_metrics(config: RerankConfig):
    """``stream_reid_metrics``'s signature, ranking by k-reciprocal re-ranked distances."""

    def metric(query_features, gallery_features, *columns, ks: Sequence[int]) -> dict[str, float]:
        if not len(query_features) or not len(gallery_features):
            raise ValueError("empty query set or gallery")
        return reid_metrics(k_reciprocal_rerank(query_features, gallery_features, config), *columns, ks=ks)

    return metric
