"""k-reciprocal re-ranking (Zhong et al. 2017): equal to a set-by-set reading of the paper's equations, fixes a
known rank-1 error, refuses what it cannot hold."""

import numpy as np
import pytest
import torch

from modeling_tagclip.metrics.rerank import RerankConfig, k_reciprocal_rerank


def naive_rerank(query: np.ndarray, gallery: np.ndarray, k1: int, k2: int, lam: float) -> np.ndarray:
    """The equations one item at a time, with Python sets (slow; for checking)."""
    feats = np.concatenate([query, gallery]).astype(np.float64)
    feats /= np.linalg.norm(feats, axis=1, keepdims=True)
    dist = np.clip(1 - feats @ feats.T, 0, None)
    dist = dist / dist.max(axis=1, keepdims=True)
    n, nq = len(feats), len(query)
    ranks = np.argsort(dist, axis=1, kind="stable")

    def reciprocal(p, k):  # k-reciprocal Eq. 3
        return {g for g in ranks[p, : k + 1] if p in ranks[g, : k + 1]}

    vectors = np.zeros((n, n))
    for p in range(n):
        r = reciprocal(p, k1)
        expanded = set(r)
        for q in r:  # k-reciprocal Eq. 4
            rq = reciprocal(q, int(np.around(k1 / 2)))
            if len(rq & r) > 2 / 3 * len(rq):
                expanded |= rq
        for g in expanded:  # k-reciprocal Eq. 7
            vectors[p, g] = np.exp(-dist[p, g])
        vectors[p] /= vectors[p].sum()
    if k2 > 1:  # k-reciprocal Eq. 10
        vectors = np.stack([vectors[ranks[p, :k2]].mean(axis=0) for p in range(n)])
    out = np.zeros((nq, n - nq))
    for p in range(nq):
        for j in range(n - nq):  # k-reciprocal Eq. 9, 11
            g = nq + j
            jac = 1 - np.minimum(vectors[p], vectors[g]).sum() / np.maximum(vectors[p], vectors[g]).sum()
            out[p, j] = (1 - lam) * jac + lam * dist[p, g]
    return out


@pytest.mark.parametrize("k1, k2, lam", [(4, 2, 0.3), (6, 1, 0.0), (3, 3, 1.0)])
def test_equals_the_equations_read_set_by_set(k1, k2, lam):
    rng = np.random.default_rng(k1)
    centers = rng.normal(size=(5, 8))
    query = centers[rng.integers(0, 5, 6)] + 0.6 * rng.normal(size=(6, 8))
    gallery = centers[rng.integers(0, 5, 20)] + 0.6 * rng.normal(size=(20, 8))
    got = k_reciprocal_rerank(query, gallery, RerankConfig(k1, k2, lam))
    np.testing.assert_allclose(got, naive_rerank(query, gallery, k1, k2, lam), atol=2e-5)


def test_a_one_sided_neighbour_drops_below_the_true_match():
    """The query's nearest gallery item d sits at the edge of a tight identity, whose members are d's nearest
    neighbours, so d does not take the query back; the query's own identity, a little further, does.
    Re-ranking puts the own identity first (features: a common base plus small offsets)."""
    rng = np.random.default_rng(0)
    base, x = 10 * np.eye(8)[0], np.eye(8)[1]
    own = np.stack([0.12 * np.eye(8)[i] for i in (2, 3, 4, 5)])  # around the query, in other directions
    d = 0.1 * x
    other = 0.17 * x + 0.02 * rng.normal(size=(5, 8))  # beyond d, tight
    query = base[None]
    gallery = base + np.concatenate([own, d[None], other])
    unit = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    assert (1 - unit @ (query[0] / np.linalg.norm(query[0]))).argmin() == 4  # plainly, d comes first
    reranked = k_reciprocal_rerank(query, gallery, RerankConfig(k1=4, k2=1, lambda_value=0.3))
    assert reranked[0].argmin() < 4 and (reranked[0, :4] < reranked[0, 4]).sum() == 3  # 3 of 4 ahead of d


def test_bad_input_is_refused_with_its_reason():
    ok = np.ones((2, 4))
    with pytest.raises(ValueError, match="limit is 3 items"):
        k_reciprocal_rerank(ok, ok, max_items=3)
    with pytest.raises(ValueError, match="NaN or inf"):
        k_reciprocal_rerank(np.full((2, 4), np.nan), ok)
    with pytest.raises(ValueError, match="of one width"):
        k_reciprocal_rerank(ok, np.ones((2, 5)))
    for bad, match in ((dict(k1=1), "k1"), (dict(k2=0), "k2"), (dict(lambda_value=1.5), "lambda")):
        with pytest.raises(ValueError, match=match):
            RerankConfig(**bad)


def test_tiny_sets_clamp_k_to_the_items_there_are():
    out = k_reciprocal_rerank(torch.eye(3)[:1], torch.eye(3)[1:])
    assert out.shape == (1, 2) and np.isfinite(out).all()
