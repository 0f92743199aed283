"""Tests for modeling_tagclip.metrics.retrieval: retrieval metrics, breakdown by match views, linear view probe."""

import numpy as np
import pytest
import torch
from fixtures import argsort_reference, assert_metrics_close

from modeling_tagclip.metrics import retrieval as retrieval_module
from modeling_tagclip.metrics.retrieval import (
    match_view_breakdown,
    positive_ranks,
    retrieval_metrics,
    stream_retrieval_metrics,
    view_probe_accuracy,
)

# Two queries, four gallery images.
# q0 (id 1): ranking by score is g0 (.9, id 1), g1 (.8, id 2), g3 (.5, id 3), g2 (.1, id 1)
#   -> matches 1 0 0 1: R@1 = R@3 = R@5 = 1; AP = (1/1 + 2/4) / 2 = 0.75; INP = 2 relevant / last at rank 4 = 0.5
# q1 (id 2): ranking g3 (.9, id 3), g0 (.7, id 1), g2 (.6, id 1), g1 (.2, id 2)
#   -> matches 0 0 0 1: R@1 = R@3 = 0, R@5 = 1; AP = (1/4) / 1 = 0.25; INP = 1 / 4 = 0.25
# Means (percent): R@1 50, R@3 50, R@5 100, mAP 50, mINP 37.5
HAND_SIM = [[0.9, 0.8, 0.1, 0.5], [0.7, 0.2, 0.6, 0.9]]
HAND_Q = [1, 2]
HAND_G = [1, 2, 1, 3]
HAND_EXPECTED = {"R@1": 50.0, "R@3": 50.0, "R@5": 100.0, "mAP": 50.0, "mINP": 37.5}


def brute_force(sim, q_ids, g_ids, ks):
    """Per-query reference implementation; ties broken by lower gallery index."""
    sim = np.asarray(sim, dtype=np.float64)
    totals = {f"R@{k}": 0.0 for k in ks} | {"mAP": 0.0, "mINP": 0.0}
    for q, qid in enumerate(q_ids):
        order = sorted(range(len(g_ids)), key=lambda j, q=q: (-sim[q, j], j))
        matches = [int(g_ids[j] == qid) for j in order]
        for k in ks:
            totals[f"R@{k}"] += float(any(matches[:k]))
        hits, ap, last = 0, 0.0, 0
        for rank, m in enumerate(matches, start=1):
            if m:
                hits += 1
                ap += hits / rank
                last = rank
        totals["mAP"] += ap / hits
        totals["mINP"] += hits / last
    return {key: 100.0 * v / len(q_ids) for key, v in totals.items()}


def test_hand_computed():
    assert_metrics_close(retrieval_metrics(HAND_SIM, HAND_Q, HAND_G, ks=(1, 3, 5)), HAND_EXPECTED)


def test_default_keys_and_types():
    out = retrieval_metrics(HAND_SIM, HAND_Q, HAND_G)
    assert list(out) == ["R@1", "R@5", "R@10", "mAP", "mINP"]
    assert all(isinstance(v, float) for v in out.values())


def test_ties_lower_gallery_index_first():
    # All scores tied -> order g0, g1, g2 = ids 2, 1, 1 -> matches 0 1 1:
    # R@1 = 0, R@2 = 1; AP = (1/2 + 2/3) / 2 = 7/12; INP = 2 / 3.
    out = retrieval_metrics([[0.5, 0.5, 0.5]], [1], [2, 1, 1], ks=(1, 2))
    assert_metrics_close(out, {"R@1": 0.0, "R@2": 100.0, "mAP": 100 * 7 / 12, "mINP": 100 * 2 / 3})
    # Moving the relevant image to index 0 makes it rank first under the same tie.
    out = retrieval_metrics([[0.5, 0.5, 0.5]], [1], [1, 2, 1], ks=(1,))
    assert out["R@1"] == 100.0


def test_numpy_torch_and_list_inputs_agree():
    rng = np.random.default_rng(0)
    sim = rng.standard_normal((7, 12)).astype(np.float32)
    g_ids = rng.integers(0, 4, 12)
    g_ids[:4] = np.arange(4)
    q_ids = rng.integers(0, 4, 7)
    ref = retrieval_metrics(sim, q_ids, g_ids)
    assert retrieval_metrics(torch.from_numpy(sim), torch.from_numpy(q_ids), torch.from_numpy(g_ids)) == ref
    assert retrieval_metrics(sim.tolist(), q_ids.tolist(), g_ids.tolist()) == ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_with_repeated_ids_and_ties(seed):
    rng = np.random.default_rng(seed)
    g_ids = rng.integers(0, 8, 40)
    q_ids = rng.choice(g_ids, 25)
    sim = np.round(rng.uniform(size=(25, 40)), 1)  # coarse values -> many ties
    ks = (1, 5, 10)
    assert_metrics_close(retrieval_metrics(sim, q_ids, g_ids, ks=ks), brute_force(sim, q_ids, g_ids, ks))


def test_string_ids():
    out = retrieval_metrics(HAND_SIM, ["a", "b"], ["a", "b", "a", "c"], ks=(1, 3, 5))
    assert_metrics_close(out, HAND_EXPECTED)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])
def test_chunked_equals_unchunked(chunk_size):
    rng = np.random.default_rng(3)
    g_ids = np.repeat(np.arange(10), 3)
    q_ids = rng.choice(g_ids, 17)
    sim = torch.from_numpy(rng.standard_normal((17, 30)))
    full = retrieval_metrics(sim, q_ids, g_ids, chunk_size=10_000)
    assert_metrics_close(retrieval_metrics(sim, q_ids, g_ids, chunk_size=chunk_size), full)


def test_query_without_relevant_item_raises():
    with pytest.raises(ValueError, match="1 of 2 queries have no relevant gallery item"):
        retrieval_metrics(HAND_SIM, [1, 7], HAND_G)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="similarity must be"):
        retrieval_metrics(HAND_SIM, [1, 2, 1], HAND_G)


def test_match_view_breakdown_groups():
    # id 1: aerial only, id 2: ground only, id 3: one aerial and one ground image.
    g_ids = [1, 1, 2, 3, 3]
    g_views = [0, 0, 1, 0, 1]
    q_ids = np.array([1, 2, 3, 3])
    rng = np.random.default_rng(0)
    sim = rng.standard_normal((4, 5))
    out = match_view_breakdown(sim, q_ids, g_ids, g_views)
    assert list(out) == ["aerial-only", "ground-only", "aerial-and-ground"]
    assert [out[k]["num_queries"] for k in out] == [1, 1, 2]
    for name, rows in [("aerial-only", [0]), ("ground-only", [1]), ("aerial-and-ground", [2, 3])]:
        expected = retrieval_metrics(sim[rows], q_ids[rows], g_ids)
        assert out[name] == {**expected, "num_queries": len(rows)}


def test_match_view_breakdown_skips_empty_groups_and_checks_views():
    out = match_view_breakdown(torch.tensor([[0.1, 0.9]]), [5], [5, 6], torch.tensor([1, 0]))
    assert list(out) == ["ground-only"]
    assert out["ground-only"]["R@1"] == 0.0
    with pytest.raises(ValueError, match="0 \\(aerial\\) or 1 \\(ground\\)"):
        match_view_breakdown([[0.1, 0.9]], [5], [5, 6], [1, 2])


def test_probe_separable_data():
    rng = np.random.default_rng(0)
    views = rng.integers(0, 2, 200)
    emb = rng.standard_normal((200, 6))
    emb[:, 2] += np.where(views == 1, 4.0, -4.0)
    out = view_probe_accuracy(torch.from_numpy(emb).float(), views)
    assert out["accuracy"] >= 98.0
    assert out["majority_baseline"] == pytest.approx(100 * np.bincount(views).max() / 200)
    assert view_probe_accuracy(emb, views) == view_probe_accuracy(emb, views)  # deterministic


def test_probe_random_labels_near_chance():
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((400, 4))
    views = rng.integers(0, 2, 400)
    out = view_probe_accuracy(emb, views, folds=5, seed=0)
    assert 38.0 <= out["accuracy"] <= 62.0
    assert 50.0 <= out["majority_baseline"] <= 56.0


def test_probe_rejects_bad_folds():
    with pytest.raises(ValueError, match="folds"):
        view_probe_accuracy(np.zeros((3, 2)), [0, 1, 0], folds=1)


# ------------------------------------------------------------------------- exact streaming (no row sort)


def random_split(seed, n_gallery=60, n_queries=45, n_ids=12, decimals=1):
    rng = np.random.default_rng(seed)
    g_ids = rng.integers(0, n_ids, n_gallery)
    g_views = rng.integers(0, 2, n_gallery)
    q_ids = rng.choice(g_ids, n_queries)
    sim = np.round(rng.uniform(-1, 1, size=(n_queries, n_gallery)), decimals).astype(np.float32)  # many ties
    return sim, q_ids, g_ids, g_views


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("chunk_size", [1, 7, 512])
def test_streamed_metrics_and_breakdown_equal_the_argsort_evaluator_with_ties(seed, chunk_size):
    sim, q_ids, g_ids, g_views = random_split(seed)
    expected, expected_breakdown = argsort_reference(sim, q_ids, g_ids, g_views)
    accumulator = stream_retrieval_metrics(
        lambda a, b: torch.from_numpy(sim[a:b]), q_ids, g_ids, g_views, chunk_size=chunk_size
    )
    assert_metrics_close(accumulator.compute(), expected)
    breakdown = accumulator.breakdown()
    assert list(breakdown) == list(expected_breakdown)
    for name, row in expected_breakdown.items():
        assert_metrics_close(breakdown[name], row)


def test_counting_and_sorting_ranks_agree(monkeypatch):
    """Identities with more than COUNT_RANKS_MAX images are ranked by one sort per row: same ranks."""
    rng = np.random.default_rng(5)
    scores = torch.from_numpy(np.round(rng.uniform(size=(9, 80)), 1))
    candidates = torch.from_numpy(rng.integers(0, 80, (9, 40)))
    counted = positive_ranks(scores, candidates[:, :30])
    order = np.argsort(-scores.numpy(), axis=1, kind="stable")
    rank_of = np.argsort(order, axis=1)
    np.testing.assert_array_equal(counted.numpy(), np.take_along_axis(rank_of, candidates[:, :30].numpy(), 1))
    np.testing.assert_array_equal(
        positive_ranks(scores, candidates).numpy(), np.take_along_axis(rank_of, candidates.numpy(), 1)
    )
    monkeypatch.setattr(retrieval_module, "COUNT_RANKS_MAX", 0)
    torch.testing.assert_close(positive_ranks(scores, candidates[:, :30]), counted)


def test_large_identities_use_the_sorting_path_and_match_brute_force():
    rng = np.random.default_rng(6)
    g_ids = np.concatenate([np.zeros(50, dtype=int), rng.integers(1, 5, 30)])  # identity 0 has 50 images
    q_ids = rng.choice(g_ids, 20)
    sim = np.round(rng.uniform(size=(20, 80)), 1)
    ks = (1, 5, 10)
    assert_metrics_close(retrieval_metrics(sim, q_ids, g_ids, ks=ks), brute_force(sim, q_ids, g_ids, ks))


def test_sharded_sums_add_up_to_the_whole():
    sim, q_ids, g_ids, g_views = random_split(7)
    whole = stream_retrieval_metrics(lambda a, b: torch.from_numpy(sim[a:b]), q_ids, g_ids, g_views)
    parts = [
        stream_retrieval_metrics(lambda a, b: torch.from_numpy(sim[a:b]), q_ids, g_ids, g_views, queries=r)
        for r in (range(0, 20), range(20, 45))
    ]
    parts[0].sums += parts[1].sums  # what all_reduce does across ranks
    assert_metrics_close(parts[0].compute(), whole.compute())
    for name, row in whole.breakdown().items():
        assert_metrics_close(parts[0].breakdown()[name], row)  # equal up to the order of summation


def test_non_finite_scores_raise():
    with pytest.raises(ValueError, match="NaN or infinite"):
        retrieval_metrics([[0.5, float("nan")]], [1], [1, 2])
