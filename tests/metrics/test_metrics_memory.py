"""Ranking by sorting (queries whose identity has more than COUNT_RANKS_MAX gallery images) stays within a fixed
memory budget: a [671, 100k] chunk used to take ~1.5 GiB of int64 temporaries at once."""

import numpy as np
import torch

from modeling_tagclip.metrics import retrieval as retrieval_module
from modeling_tagclip.metrics.retrieval import COUNT_RANKS_MAX, positive_ranks


def test_sorting_path_sorts_bounded_row_blocks_and_gives_the_stable_ranks(monkeypatch):
    rng = np.random.default_rng(7)
    width = 500
    scores = torch.from_numpy(np.round(rng.uniform(size=(23, width)), 2)).float()  # many exact ties
    candidates = torch.from_numpy(rng.integers(0, width, (23, COUNT_RANKS_MAX + 8)))
    rank_of = np.argsort(
        np.argsort(-scores.numpy(), axis=1, kind="stable"), axis=1
    )  # ties: lower index first
    expected = np.take_along_axis(rank_of, candidates.numpy(), 1)

    monkeypatch.setattr(retrieval_module, "SORT_BYTES", 3 * 8 * width * 4)  # room for 4 rows per sort
    sorted_rows, argsort = [], torch.argsort

    def spy(values, *args, **kwargs):
        sorted_rows.append(values.shape[0])
        return argsort(values, *args, **kwargs)

    monkeypatch.setattr(torch, "argsort", spy)
    ranks = positive_ranks(scores, candidates)
    np.testing.assert_array_equal(ranks.numpy(), expected)
    assert sorted_rows == [4, 4, 4, 4, 4, 3]


def test_sorting_path_handles_one_row_wider_than_the_budget(monkeypatch):
    monkeypatch.setattr(retrieval_module, "SORT_BYTES", 8)
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.9], [0.3, 0.2, 0.1, 0.0]])
    candidates = torch.tensor([[3, 1, 0] * 11 + [2], [0, 1, 2] * 11 + [3]])
    ranks = positive_ranks(scores, candidates)
    assert ranks[0, :3].tolist() == [1, 0, 3] and ranks[0, -1] == 2
    assert ranks[1, :3].tolist() == [0, 1, 2] and ranks[1, -1] == 3
