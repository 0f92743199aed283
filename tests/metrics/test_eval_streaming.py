"""The streamed evaluator's fast path: blocked rank counting, reused TAG-PR Eq. 14 score block, chunk size from a
memory budget, progress log. Each must leave every number unchanged."""

import numpy as np
import pytest
import torch
from fixtures import argsort_reference, assert_metrics_close

from modeling_tagclip.evaluation.text_retrieval import RetrievalRun, summarize
from modeling_tagclip.metrics import retrieval as R
from modeling_tagclip.retrieval.encode import eq14_similarity


def stable_ranks(scores: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Rank of each candidate after a stable descending sort of its row (ties: lower index first)."""
    rank_of = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1, kind="stable")
    return np.take_along_axis(rank_of, candidates, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("num_candidates", [1, 3, 32])
def test_blocked_counting_equals_a_stable_sort_across_many_blocks_with_ties(
    monkeypatch, dtype, num_candidates
):
    """300 columns in blocks of 64 (last one partial), scores rounded to 1 decimal: nearly every candidate ties."""
    monkeypatch.setattr(R, "COMPARE_BYTES_CPU", 1)  # smallest block: 64 columns
    rng = np.random.default_rng(num_candidates)
    scores = np.round(rng.uniform(-1, 1, size=(11, 300)), 1).astype(dtype)
    scores[:, 250:] = np.where(rng.uniform(size=(11, 50)) < 0.5, -0.0, 0.0)  # -0.0 == 0.0 is a tie too
    candidates = rng.integers(0, 300, (11, num_candidates))
    candidates[0, 0] = 299  # the last column of the partial block
    ranks = R.positive_ranks(torch.from_numpy(scores), torch.from_numpy(candidates))
    assert ranks.dtype == torch.long
    np.testing.assert_array_equal(ranks.numpy(), stable_ranks(scores, candidates))


def test_blocked_counting_without_ties_and_one_row():
    rng = np.random.default_rng(0)
    scores = rng.permutation(5000).astype(np.float32)[None]  # distinct scores: no tie-break pass
    candidates = np.array([[0, 4999, 2500]])
    expected = 4999 - scores[0, candidates[0]]
    np.testing.assert_array_equal(
        R.positive_ranks(torch.from_numpy(scores), torch.from_numpy(candidates))[0], expected
    )


def test_eq14_into_a_reused_block_gives_the_same_bits():
    g = torch.Generator().manual_seed(0)
    t, v, tl, vl = (
        torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
        for n, d in ((5, 16), (40, 16), (5, 32), (40, 32))
    )
    block = torch.full((5, 40), float("nan"))
    for local in ((tl, vl), (None, None)):
        out = eq14_similarity(t, v, *local, out=block)
        assert out.data_ptr() == block.data_ptr()
        assert torch.equal(out, eq14_similarity(t, v, *local))
    assert torch.equal(eq14_similarity(t, v, tl, vl), 0.5 * (t @ v.t() + tl @ vl.t()))


def make_run(n_ids=15, per_id=3, captions=2, seed=0) -> RetrievalRun:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_ids, 24, generator=g)
    gallery_ids = torch.arange(n_ids * per_id) // per_id
    query_ids = gallery_ids.repeat_interleave(captions)

    def embed(ids):
        x = centres[ids] + 1.5 * torch.randn(len(ids), 24, generator=g)
        return {
            "global": torch.nn.functional.normalize(x[:, :8], dim=1),
            "local": torch.nn.functional.normalize(x[:, 8:], dim=1),
        }

    return RetrievalRun(
        text=embed(query_ids),
        image=embed(gallery_ids),
        query_ids=query_ids.numpy(),
        gallery_ids=gallery_ids.numpy(),
        gallery_views=torch.randint(0, 2, (len(gallery_ids),), generator=g).numpy(),
        captions=[],
        image_paths=[],
        query_image_index=np.arange(len(query_ids)) // captions,
    )


def test_chunk_scorer_reuses_one_block_and_scores_like_run_scores():
    run = make_run()
    scorer = run.chunk_scorer(8)
    first, second = scorer(0, 8), scorer(8, 13)
    assert first.data_ptr() == second.data_ptr()
    assert torch.equal(second, run.scores(8, 13))
    assert torch.equal(scorer(0, 8), run.scores(0, 8))


def test_chunk_rows_from_the_budget():
    assert R.chunk_rows(100_000) == 512 * 2**20 // (2 * 4 * 100_000) == 671
    assert R.chunk_rows(10**9) == 1  # a gallery too large for the budget still scores one query at a time
    assert R.chunk_rows(1000, budget_bytes=80_000) == 10


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 1000])
def test_summary_is_the_argsort_evaluators_for_every_chunk_size(monkeypatch, chunk_size):
    monkeypatch.setattr(R, "SCORE_BUDGET_BYTES", 2 * 4 * 45 * 4)  # None: 4 queries per chunk
    calls = []
    original = RetrievalRun.chunk_scorer
    monkeypatch.setattr(RetrievalRun, "chunk_scorer", lambda self, n: calls.append(n) or original(self, n))
    run = make_run()
    result = summarize(run, probe=False, chunk_size=chunk_size)
    assert calls == [min(chunk_size or 4, 90)]
    expected, breakdown = argsort_reference(
        run.similarity.numpy(), run.query_ids, run.gallery_ids, run.gallery_views
    )
    assert_metrics_close({k: result[k] for k in expected}, expected)
    assert result["match_view_breakdown"].keys() == breakdown.keys()
    for name, row in breakdown.items():
        assert_metrics_close(result["match_view_breakdown"][name], row)


def test_summary_rejects_a_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        summarize(make_run(), probe=False, chunk_size=0)


def test_progress_shows_the_queries_scored(capsys):
    summarize(make_run(), probe=False, chunk_size=50, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "scoring: 90 query captions against 45 gallery images"
    assert lines[-1].startswith("scoring: 90/90 captions in "), lines
    summarize(make_run(), probe=False, chunk_size=50)
    assert capsys.readouterr().err == ""


def test_check_finite_checks_in_bounded_pieces(monkeypatch):
    """Regression: one ``isfinite`` over all 200k x 1024 caption embeddings took 1.4 GB of temporaries."""
    sizes = []
    isfinite = torch.isfinite
    monkeypatch.setattr(R, "FINITE_CHECK_ELEMENTS", 100)
    monkeypatch.setattr(torch, "isfinite", lambda x: sizes.append(x.numel()) or isfinite(x))
    values = torch.zeros(30, 17)
    R.check_finite(values, "scores")
    assert max(sizes) == 100 and sum(sizes) == 510
    values[29, 16] = float("nan")  # in the last, partial piece
    with pytest.raises(ValueError, match="scores has NaN or infinite values"):
        R.check_finite(values, "scores")
