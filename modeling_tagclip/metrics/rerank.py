"""k-reciprocal re-ranking (Zhong et al., "Re-ranking Person Re-identification with k-reciprocal Encoding",
CVPR 2017): the distance re-ranking re-ID users expect, as an option of re-ID evaluation and search.

Queries and gallery are pooled into one probe set; the distance between two items becomes a mix of their
original distance and the Jaccard distance of their (expanded, query-expanded) k-reciprocal neighbour sets.
The paper's equations live in the functions named after them. Memory is O(N^2) for N = queries + gallery
items, so N is capped (``max_items``) with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RerankConfig", "k_reciprocal_rerank"]

MAX_ITEMS = 20_000  # N^2 float32 distances: 1.6 GB at the cap


@dataclass(frozen=True)
class RerankConfig:
    """k1: neighbours of the k-reciprocal set; k2: neighbours of the local query expansion; lambda_value: the
    weight of the original distance in the final one (the paper's defaults 20, 6, 0.3)."""

    k1: int = 20
    k2: int = 6
    lambda_value: float = 0.3

    def __post_init__(self) -> None:
        if not (isinstance(self.k1, int) and self.k1 >= 2):
            raise ValueError(f"re-ranking k1 must be an integer >= 2, got {self.k1!r}")
        if not (isinstance(self.k2, int) and self.k2 >= 1):
            raise ValueError(f"re-ranking k2 must be an integer >= 1, got {self.k2!r}")
        if not 0.0 <= float(self.lambda_value) <= 1.0:
            raise ValueError(f"re-ranking lambda must lie in [0, 1], got {self.lambda_value!r}")


def _normalized_distances(features: torch.Tensor) -> torch.Tensor:
    """Cosine distances [N, N] of L2-normalised rows, each row divided by its maximum (the reference's
    scaling, which keeps exp(-d) of k-reciprocal Eq. 7 on one scale)."""
    rows = torch.nn.functional.normalize(features.float(), dim=-1)
    dist = (1.0 - rows @ rows.T).clamp_min_(0.0)
    return dist / dist.amax(dim=1, keepdim=True).clamp_min(1e-12)


def k_reciprocal_sets(ranks: torch.Tensor, k: int) -> torch.Tensor:
    """k-reciprocal Eq. 3: R(p, k) = {g in N(p, k) : p in N(g, k)} as a bool [N, N] (row p), N(p, k) = the first k + 1 of
    `ranks` (the item itself included, as the reference keeps it)."""
    n = ranks.shape[0]
    near = torch.zeros(n, n, dtype=torch.bool)
    near[torch.arange(n)[:, None], ranks[:, : k + 1]] = True
    return near & near.T


def expanded_sets(ranks: torch.Tensor, k1: int) -> torch.Tensor:
    """k-reciprocal Eq. 4: R*(p, k1) = R(p, k1) united with every R(q, k1/2), q in R(p, k1), that shares more than 2/3 of
    its members with R(p, k1)."""
    full, half_k = k_reciprocal_sets(ranks, k1), int(np.around(k1 / 2.0))
    half = k_reciprocal_sets(ranks, half_k)
    n, candidates = ranks.shape[0], ranks[:, : k1 + 1]  # R(p, k1) lies within N(p, k1)
    members = ranks[:, : half_k + 1][candidates]  # [N, k1+1, k/2+1]: N(q, k/2) of each candidate q
    in_half = half[candidates[..., None], members]  # ... and which of them are in R(q, k/2)
    in_full = full.gather(1, members.reshape(n, -1)).reshape(members.shape)  # ... and in R(p, k1)
    overlap, size = (in_half & in_full).sum(-1), in_half.sum(-1)
    accepted = full.gather(1, candidates) & (overlap > 2.0 / 3.0 * size)
    expanded = full.clone()
    adds = (accepted[..., None] & in_half).reshape(n, -1)
    expanded.view(torch.uint8).scatter_reduce_(1, members.reshape(n, -1), adds.to(torch.uint8), reduce="amax")
    return expanded


def reciprocal_vectors(dist: torch.Tensor, expanded: torch.Tensor) -> torch.Tensor:
    """k-reciprocal Eq. 7: V_p,g = exp(-d(p, g)) on R*(p, k1), 0 elsewhere; each row normalised to sum 1 (reference)."""
    weights = torch.exp(-dist) * expanded
    return weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-12)


def local_query_expansion(vectors: torch.Tensor, ranks: torch.Tensor, k2: int) -> torch.Tensor:
    """k-reciprocal Eq. 10: V_p = the mean of V over the k2 nearest neighbours of p (p itself first)."""
    if k2 == 1:
        return vectors
    return vectors[ranks[:, :k2]].mean(dim=1)


def jaccard_distances(vectors: torch.Tensor, num_query: int) -> torch.Tensor:
    """k-reciprocal Eq. 9 on the vectors: d_J(p, g) = 1 - sum min(V_p, V_g) / sum max(V_p, V_g), for query rows against
    gallery rows; rows sum to 1, so sum max = 2 - sum min. Computed over each query's non-zero columns."""
    gallery = vectors[num_query:]
    out = torch.empty(num_query, gallery.shape[0])
    for p in range(num_query):
        columns = vectors[p].nonzero()[:, 0]
        shared = torch.minimum(gallery[:, columns], vectors[p, columns]).sum(dim=1)
        out[p] = 1.0 - shared / (2.0 - shared)
    return out


def final_distance(jaccard: torch.Tensor, original: torch.Tensor, lambda_value: float) -> torch.Tensor:
    """k-reciprocal Eq. 11: d* = (1 - lambda) d_J + lambda d."""
    return (1.0 - lambda_value) * jaccard + lambda_value * original


def k_reciprocal_rerank(
    query_features: Any,
    gallery_features: Any,
    config: RerankConfig | None = None,
    max_items: int = MAX_ITEMS,
) -> np.ndarray:
    """Re-ranked distances [n_query, n_gallery] (float32; smaller = closer) of two feature sets."""
    config = config or RerankConfig()
    query, gallery = torch.as_tensor(query_features), torch.as_tensor(gallery_features)
    if query.ndim != 2 or gallery.ndim != 2 or query.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"re-ranking needs two [n, d] feature sets of one width, got {query.shape} and {gallery.shape}"
        )
    n_query, n = len(query), len(query) + len(gallery)
    if n > max_items:
        raise ValueError(
            f"re-ranking holds {n} x {n} distances (queries + gallery = {n}): the limit is {max_items} items"
        )
    if not (torch.isfinite(query).all() and torch.isfinite(gallery).all()):
        raise ValueError("re-ranking features contain NaN or inf values")
    k1 = min(config.k1, n - 1)
    dist = _normalized_distances(torch.cat([query, gallery]))
    ranks = dist.argsort(dim=1, stable=True)
    vectors = local_query_expansion(
        reciprocal_vectors(dist, expanded_sets(ranks, k1)), ranks, min(config.k2, n)
    )
    jaccard = jaccard_distances(vectors, n_query)
    return final_distance(jaccard, dist[:n_query, n_query:], config.lambda_value).numpy()
