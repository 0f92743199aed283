"""Text-to-image retrieval metrics (R@K, mAP, mINP), view breakdown and a linear view probe.

The definitions reproduce ``TAG-PR:misc/eval.py:metric_eval`` (R@K, mAP) and ``RDE:utils/metrics.py:rank``
(mINP); see spec ``tag-clip.md`` §6. All values are percentages.

Ranking is by descending similarity with a *stable* sort: on ties, the gallery item with the lower index
ranks first. The reference uses an unstable ``argsort``, so tied scores may be ordered differently there;
with continuous scores ties do not occur in practice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["retrieval_metrics", "view_breakdown", "view_probe_accuracy", "VIEW_GROUPS"]

ArrayLike = Any  # torch.Tensor | np.ndarray | Sequence
VIEW_GROUPS = ("aerial-only", "ground-only", "mixed")
AERIAL, GROUND = 0, 1


def _to_numpy(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _check_inputs(similarity: ArrayLike, query_ids: ArrayLike, gallery_ids: ArrayLike):
    sim = _to_numpy(similarity)
    if not np.issubdtype(sim.dtype, np.floating):
        sim = sim.astype(np.float64)
    q_ids, g_ids = _to_numpy(query_ids).reshape(-1), _to_numpy(gallery_ids).reshape(-1)
    if sim.ndim != 2 or sim.shape != (len(q_ids), len(g_ids)):
        raise ValueError(
            f"similarity must be [n_queries, n_gallery] = [{len(q_ids)}, {len(g_ids)}], got {sim.shape}"
        )
    if sim.shape[0] == 0 or sim.shape[1] == 0:
        raise ValueError("empty query set or gallery")
    missing = ~np.isin(q_ids, g_ids)
    if missing.any():
        bad = np.flatnonzero(missing)
        raise ValueError(
            f"{len(bad)} of {len(q_ids)} queries have no relevant gallery item "
            f"(e.g. query {bad[0]} with id {q_ids[bad[0]]!r}); every query id must occur in the gallery"
        )
    return sim, q_ids, g_ids


def _chunk_scores(sim: np.ndarray, q_ids: np.ndarray, g_ids: np.ndarray, ks: Sequence[int]) -> dict:
    """Per-query hits@K, AP and INP for one chunk of queries."""
    order = np.argsort(-sim, axis=1, kind="stable")
    matches = g_ids[order] == q_ids[:, None]
    n_gallery = matches.shape[1]
    num_rel = matches.sum(axis=1)
    first_hit = matches.argmax(axis=1)
    last_hit = n_gallery - 1 - matches[:, ::-1].argmax(axis=1)
    precision = matches.cumsum(axis=1) / np.arange(1, n_gallery + 1, dtype=np.float64)
    scores = {f"R@{k}": first_hit < k for k in ks}
    scores["mAP"] = (precision * matches).sum(axis=1) / num_rel
    scores["mINP"] = num_rel / (last_hit + 1.0)
    return scores


def retrieval_metrics(
    similarity: ArrayLike,
    query_ids: ArrayLike,
    gallery_ids: ArrayLike,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 512,
) -> dict[str, float]:
    """R@K, mAP and mINP (percent) for a [n_queries, n_gallery] similarity matrix.

    Queries are processed ``chunk_size`` rows at a time. Raises ``ValueError`` if a query has no relevant
    gallery item. Ties rank the lower gallery index first (stable sort).
    """
    sim, q_ids, g_ids = _check_inputs(similarity, query_ids, gallery_ids)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    sums: dict[str, float] = {}
    for start in range(0, len(q_ids), chunk_size):
        stop = start + chunk_size
        for key, values in _chunk_scores(sim[start:stop], q_ids[start:stop], g_ids, ks).items():
            sums[key] = sums.get(key, 0.0) + float(values.sum())
    return {key: 100.0 * total / len(q_ids) for key, total in sums.items()}


def _query_view_groups(q_ids: np.ndarray, g_ids: np.ndarray, g_views: np.ndarray) -> np.ndarray:
    """Group index (into VIEW_GROUPS) of each query from the views of its relevant gallery items."""
    has_aerial = {i.item() for i in np.unique(g_ids[g_views == AERIAL])}
    has_ground = {i.item() for i in np.unique(g_ids[g_views == GROUND])}
    groups = []
    for q in q_ids.tolist():
        a, g = q in has_aerial, q in has_ground
        groups.append(2 if (a and g) else 0 if a else 1)
    return np.asarray(groups)


def view_breakdown(
    similarity: ArrayLike,
    query_ids: ArrayLike,
    gallery_ids: ArrayLike,
    gallery_views: ArrayLike,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 512,
) -> dict[str, dict[str, float]]:
    """Metrics per query group: relevant gallery images all aerial, all ground, or both (paper Table 5).

    Views: 0 = aerial, 1 = ground. The gallery is always the full gallery. Each entry is the
    ``retrieval_metrics`` dict plus ``num_queries``; empty groups are omitted.
    """
    sim, q_ids, g_ids = _check_inputs(similarity, query_ids, gallery_ids)
    g_views = _to_numpy(gallery_views).reshape(-1)
    if len(g_views) != len(g_ids):
        raise ValueError(f"gallery_views has {len(g_views)} entries, gallery has {len(g_ids)}")
    if not np.isin(g_views, (AERIAL, GROUND)).all():
        raise ValueError(f"gallery_views must be 0 (aerial) or 1 (ground), got {np.unique(g_views)}")
    groups = _query_view_groups(q_ids, g_ids, g_views)
    out = {}
    for index, name in enumerate(VIEW_GROUPS):
        mask = groups == index
        if mask.any():
            metrics = retrieval_metrics(sim[mask], q_ids[mask], g_ids, ks=ks, chunk_size=chunk_size)
            out[name] = {**metrics, "num_queries": int(mask.sum())}
    return out


def _stratified_folds(labels: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Fold index per sample: each class is shuffled and dealt round-robin over the folds."""
    rng = np.random.default_rng(seed)
    fold_of = np.empty(len(labels), dtype=np.int64)
    offset = 0
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        fold_of[idx] = (np.arange(len(idx)) + offset) % folds
        offset += len(idx)
    return fold_of


def _fit_logreg(
    x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float, max_iter: int
) -> torch.nn.Linear:
    """Multinomial logistic regression with L2 penalty, full-batch L-BFGS (deterministic)."""
    linear = torch.nn.Linear(x.shape[1], n_classes, dtype=x.dtype)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    opt = torch.optim.LBFGS(linear.parameters(), max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x), y) + l2 * linear.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return linear


def view_probe_accuracy(
    embeddings: ArrayLike,
    views: ArrayLike,
    folds: int = 5,
    seed: int = 0,
    l2: float = 1e-3,
    max_iter: int = 200,
) -> dict[str, float]:
    """Stratified k-fold cross-validated linear (logistic-regression) probe of the view from embeddings.

    Features are standardised with the training-fold statistics. Returns ``{"accuracy", "majority_baseline"}``
    in percent: accuracy pooled over all held-out folds, and the share of the most frequent view.
    """
    x_all = torch.as_tensor(_to_numpy(embeddings), dtype=torch.float64)
    labels = _to_numpy(views).reshape(-1).astype(np.int64)
    if x_all.ndim != 2 or x_all.shape[0] != len(labels):
        raise ValueError(f"embeddings must be [n, d] with n = {len(labels)}, got {tuple(x_all.shape)}")
    if folds < 2 or len(labels) < folds:
        raise ValueError(f"need 2 <= folds <= n_samples, got folds={folds}, n={len(labels)}")
    classes, y_np = np.unique(labels, return_inverse=True)
    majority = 100.0 * np.bincount(y_np).max() / len(y_np)
    if len(classes) < 2:
        return {"accuracy": 100.0, "majority_baseline": majority}
    y_all = torch.as_tensor(y_np)
    fold_of = _stratified_folds(y_np, folds, seed)
    correct = 0
    for fold in range(folds):
        test = torch.as_tensor(fold_of == fold)
        mean, std = x_all[~test].mean(0), x_all[~test].std(0, correction=0).clamp_min(1e-8)
        x = (x_all - mean) / std
        probe = _fit_logreg(x[~test], y_all[~test], len(classes), l2, max_iter)
        with torch.no_grad():
            correct += int((probe(x[test]).argmax(1) == y_all[test]).sum())
    return {"accuracy": 100.0 * correct / len(y_np), "majority_baseline": majority}
