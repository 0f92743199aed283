"""Text-to-image retrieval metrics (R@K, mAP, mINP) computed exactly in bounded memory, the per-query breakdown
by the views of the true matches, and a linear view probe.

The definitions reproduce ``TAG-PR:misc/eval.py:metric_eval`` (R@K, mAP) and ``RDE:utils/metrics.py:rank``
(mINP). All values are percentages.

Ranking is by descending score with ties ordered by gallery index (lower first), i.e. a stable sort; the
reference uses an unstable ``argsort``, so exactly tied scores may be ordered differently there. Rows are
not sorted: the rank of each relevant gallery item is the number of items ranked before it (higher score,
or equal score and lower index), so a chunk of queries needs only its [chunk, n_gallery] scores, read once
for all of a row's relevant items (``positive_ranks``; a query with more than ``COUNT_RANKS_MAX`` relevant
items is ranked by a stable sort of its row instead, ``SORT_BYTES`` at a time); the chunk size follows a
memory budget (``chunk_rows``). From the ranks of a query's relevant items: R@K = [first rank < K], AP = mean over
relevant items of (hits so far / (rank + 1)), INP = num_relevant / (last rank + 1). ``RetrievalAccumulator``
takes score chunks one at a time (a query set of any size streams through in O(chunk x gallery) memory) and sums
per-query values per group, so the breakdown by match views comes from the same pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND, VIEW_NAMES
from modeling_tagclip.progress import Progress, main_process

__all__ = [
    "MATCH_VIEW_GROUPS",
    "RetrievalAccumulator",
    "check_finite",
    "chunk_rows",
    "match_view_breakdown",
    "positive_ranks",
    "rank_metrics",
    "retrieval_metrics",
    "stream_retrieval_metrics",
    "view_probe_accuracy",
]

ArrayLike = Any  # torch.Tensor | np.ndarray | Sequence
# Query groups by the views of the query's relevant gallery images (not the paper's Table 5, which trains
# and tests on aerial-only / ground-only / both-view data).
MATCH_VIEW_GROUPS = ("aerial-only", "ground-only", "aerial-and-ground")
COUNT_RANKS_MAX = 32  # up to this many candidates per query, count; beyond, rank by one sort per row
SORT_BYTES = 64 * 2**20  # int64 temporaries of the rows sorted at once when ranking by sorting
COMPARE_BYTES_CPU = 2**20  # size of one block of comparisons when counting ranks (fits in L2)
COMPARE_BYTES_ACCELERATOR = 2**28
SCORE_BUDGET_BYTES = 512 * 2**20  # score blocks of one query chunk when the chunk size is picked by memory
FINITE_CHECK_ELEMENTS = 2**22  # per isfinite call in check_finite (bounds its temporaries)


def _to_numpy(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _to_scores(x: ArrayLike) -> torch.Tensor:
    """A floating tensor (dtype kept; integers and lists become float64)."""
    if isinstance(x, torch.Tensor):
        return x.detach() if x.is_floating_point() else x.detach().double()
    array = np.asarray(x)
    return torch.from_numpy(array if np.issubdtype(array.dtype, np.floating) else array.astype(np.float64))


def check_finite(values: torch.Tensor, what: str) -> None:
    """``ValueError`` if ``values`` holds NaN or inf (comparisons with NaN would rank silently wrong). Checks
    ``FINITE_CHECK_ELEMENTS`` at a time: ``isfinite`` builds temporaries the size of its input."""
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), FINITE_CHECK_ELEMENTS):
        if not bool(torch.isfinite(flat[start : start + FINITE_CHECK_ELEMENTS]).all()):
            raise ValueError(f"{what} has NaN or infinite values")


class IdentityIndex:
    """Gallery indices grouped by identity (CSR layout) to look up the relevant items of each query."""

    def __init__(self, gallery_ids: ArrayLike):
        g_ids = _to_numpy(gallery_ids).reshape(-1)
        self.ids, inverse, counts = np.unique(g_ids, return_inverse=True, return_counts=True)
        self.items = torch.from_numpy(np.argsort(inverse, kind="stable"))  # ascending within an identity
        self.offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]))
        self.inverse = torch.from_numpy(inverse)

    def codes(self, query_ids: ArrayLike, strict: bool = True) -> torch.Tensor:
        """Identity code of each query; an id not in the gallery raises ``ValueError`` (``strict``) or gets -1."""
        q_ids = _to_numpy(query_ids).reshape(-1)
        pos = np.clip(np.searchsorted(self.ids, q_ids), 0, len(self.ids) - 1)
        missing = self.ids[pos] != q_ids
        if not strict:
            return torch.from_numpy(np.where(missing, -1, pos))
        if missing.any():
            bad = np.flatnonzero(missing)
            raise ValueError(
                f"{len(bad)} of {len(q_ids)} queries have no relevant gallery item "
                f"(e.g. query {bad[0]} with id {q_ids[bad[0]]!r}); every query id must occur in the gallery"
            )
        return torch.from_numpy(pos)

    def candidates(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gallery indices of each code's identity [c, m] (padded with 0) and their validity mask."""
        start, count = self.offsets[codes], self.offsets[codes + 1] - self.offsets[codes]
        slots = torch.arange(int(count.max()))
        valid = slots < count[:, None]
        items = self.items[torch.where(valid, start[:, None] + slots, 0)]
        return torch.where(valid, items, 0), valid


def _count_at_least(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``scores`` [c, G] and each of its ``values`` [c, m]: how many entries are > the value and how
    many are >= it ([c, m] each, int32), in one pass over ``scores`` in column blocks (the [c, 2m, block]
    comparisons stay in cache on CPU)."""
    rows, m = values.shape
    budget = COMPARE_BYTES_CPU if scores.device.type == "cpu" else COMPARE_BYTES_ACCELERATOR
    block = min(scores.shape[1], max(64, budget // max(1, 2 * m * rows)))
    compared = torch.empty(rows, 2 * m, block, dtype=torch.bool, device=scores.device)
    counts = torch.zeros(rows, 2 * m, dtype=torch.int32, device=scores.device)
    thresholds = values[:, :, None]
    for start in range(0, scores.shape[1], block):
        part = scores[:, None, start : start + block]
        width = part.shape[2]
        torch.gt(part, thresholds, out=compared[:, :m, :width])
        torch.ge(part, thresholds, out=compared[:, m:, :width])
        counts += compared[:, :, :width].view(torch.uint8).sum(2, dtype=torch.int32)
    return counts[:, :m], counts[:, m:]


def positive_ranks(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """0-based rank of each candidate [c, m] in its row of ``scores`` [c, G], sorted by descending score, ties
    by lower gallery index: the number of items with a higher score or an equal score and a lower index.

    One counting pass over ``scores`` for all candidates (> and >=, ``_count_at_least``); the index tie-break
    is computed only for the (row, candidate) pairs that another item ties with. Scores must be finite (see
    ``check_finite``)."""
    candidates = candidates.to(scores.device)
    if candidates.shape[1] > COUNT_RANKS_MAX:
        return _ranks_by_sorting(scores, candidates)
    values = scores.gather(1, candidates)
    above, at_least = _count_at_least(scores, values)
    ranks = above.long()
    tied = at_least - above > 1  # another item has exactly the candidate's score
    if bool(tied.any()):
        index = torch.arange(scores.shape[1], device=scores.device)
        for j in range(candidates.shape[1]):
            rows = tied[:, j].nonzero()[:, 0]
            if len(rows):
                before = (scores[rows] == values[rows, j : j + 1]) & (index < candidates[rows, j : j + 1])
                ranks[rows, j] += before.sum(1)
    return ranks


def _ranks_by_sorting(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``positive_ranks`` by one stable sort per row (many candidates per query), a block of rows at a time so
    that the int64 order, ranks and positions stay within ``SORT_BYTES`` whatever the chunk size."""
    rows, width = scores.shape
    block = max(1, min(rows, SORT_BYTES // (3 * 8 * max(1, width))))
    positions = torch.arange(width, device=scores.device).expand(block, width).contiguous()
    ranks = candidates.new_empty(candidates.shape)
    for start in range(0, rows, block):
        order = torch.argsort(scores[start : start + block], dim=1, descending=True, stable=True)
        rank_of = torch.empty_like(order).scatter_(1, order, positions[: len(order)])
        ranks[start : start + block] = rank_of.gather(1, candidates[start : start + block])
    return ranks


def rank_metrics(ranks: torch.Tensor, relevant: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Per-query [hit@k for k in ks, AP, INP] (float64, [c, len(ks) + 2]) from the ranks [c, m] of candidates and
    which of them are relevant (at least one per row)."""
    big = torch.iinfo(torch.long).max // 2
    sorted_ranks = torch.where(relevant, ranks, big).sort(dim=1).values.double()
    num_rel = relevant.sum(1)
    hit = torch.arange(1, ranks.shape[1] + 1, device=ranks.device)
    counted = hit <= num_rel[:, None]
    first, last = sorted_ranks[:, 0], sorted_ranks.gather(1, (num_rel - 1).clamp(min=0)[:, None])[:, 0]
    ap = torch.where(counted, hit / (sorted_ranks + 1.0), 0.0).sum(1) / num_rel.clamp(min=1)
    columns = [(first < k).double() for k in ks] + [ap, num_rel / (last + 1.0)]
    return torch.stack(columns, dim=1)


class RetrievalAccumulator:
    """Exact R@K / mAP / mINP over score chunks, overall and per ``MATCH_VIEW_GROUPS`` group.

    ``add(scores, query_ids)`` takes a [chunk, n_gallery] block of scores; ``compute()`` the overall metrics,
    ``breakdown()`` the per-group ones (needs ``gallery_views``). Sums can be all-reduced across ranks
    (``all_reduce``) when each rank scored a different share of the queries.
    """

    def __init__(
        self, gallery_ids: ArrayLike, gallery_views: ArrayLike | None = None, ks: Sequence[int] = (1, 5, 10)
    ):
        self.ks = tuple(int(k) for k in ks)
        self.identities = IdentityIndex(gallery_ids)
        self.num_gallery = len(self.identities.inverse)
        self.group_of = torch.zeros(len(self.identities.ids), dtype=torch.long)
        if gallery_views is not None:
            self.group_of = self._groups(_to_numpy(gallery_views).reshape(-1))
        self.sums = torch.zeros(len(MATCH_VIEW_GROUPS), len(self.ks) + 3, dtype=torch.float64)

    def _groups(self, views: np.ndarray) -> torch.Tensor:
        """Group of each identity: its gallery images are all aerial (0), all ground (1) or both (2)."""
        if len(views) != self.num_gallery:
            raise ValueError(f"gallery_views has {len(views)} entries, gallery has {self.num_gallery}")
        if not np.isin(views, (AERIAL, GROUND)).all():
            raise ValueError(
                f"gallery_views must be {AERIAL} ({VIEW_NAMES[AERIAL]}) or {GROUND} ({VIEW_NAMES[GROUND]}), "
                f"got {np.unique(views)}"
            )
        n = len(self.identities.ids)
        inverse = self.identities.inverse
        has = [
            torch.zeros(n, dtype=torch.bool).index_fill_(0, inverse[torch.from_numpy(views == v)], True)
            for v in (AERIAL, GROUND)
        ]
        return torch.where(has[0] & has[1], 2, torch.where(has[0], 0, 1))

    def add(self, scores: ArrayLike, query_ids: ArrayLike) -> None:
        """Accumulate a chunk: ``scores`` [n, n_gallery] of queries with ids ``query_ids`` [n]."""
        scores = _to_scores(scores)
        codes = self.identities.codes(query_ids)
        if scores.ndim != 2 or scores.shape != (len(codes), self.num_gallery):
            raise ValueError(
                f"similarity must be [n_queries, n_gallery] = [{len(codes)}, {self.num_gallery}], "
                f"got {tuple(scores.shape)}"
            )
        candidates, relevant = self.identities.candidates(codes)
        values = rank_metrics(positive_ranks(scores, candidates), relevant.to(scores.device), self.ks).cpu()
        self.sums.index_add_(0, self.group_of[codes], torch.cat([values, torch.ones(len(codes), 1)], dim=1))

    def all_reduce(self) -> None:
        """Sum the accumulated values over the ranks of the default process group (no-op without one)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.sums)

    def _metrics(self, sums: torch.Tensor) -> dict[str, float]:
        names = [f"R@{k}" for k in self.ks] + ["mAP", "mINP"]
        count = float(sums[-1])
        return {name: 100.0 * float(sums[i]) / count for i, name in enumerate(names)}

    def compute(self) -> dict[str, float]:
        """Overall metrics (percent); ``ValueError`` if nothing was added."""
        total = self.sums.sum(0)
        if total[-1] == 0:
            raise ValueError("empty query set or gallery")
        return self._metrics(total)

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Metrics and ``num_queries`` per non-empty group of ``MATCH_VIEW_GROUPS``."""
        return {
            name: {**self._metrics(self.sums[g]), "num_queries": int(self.sums[g, -1])}
            for g, name in enumerate(MATCH_VIEW_GROUPS)
            if self.sums[g, -1] > 0
        }


def chunk_rows(num_gallery: int, budget_bytes: int | None = None, blocks: int = 2, itemsize: int = 4) -> int:
    """Query rows per chunk such that ``blocks`` [rows, num_gallery] score blocks (TAG-PR Eq. 14: the result and the
    TSE product) of ``itemsize`` bytes fit in ``budget_bytes`` (default ``SCORE_BUDGET_BYTES``)."""
    budget_bytes = SCORE_BUDGET_BYTES if budget_bytes is None else budget_bytes
    return max(1, budget_bytes // (blocks * itemsize * max(1, num_gallery)))


def stream_retrieval_metrics(
    scores: Callable[[int, int], torch.Tensor],
    query_ids: ArrayLike,
    gallery_ids: ArrayLike,
    gallery_views: ArrayLike | None = None,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int | None = None,
    queries: range | None = None,
    progress: bool = False,
) -> RetrievalAccumulator:
    """Accumulate ``scores(start, stop)`` ([stop - start, n_gallery], queries ``start:stop``) chunk by chunk
    over ``queries`` (default: all; a rank's share when sharded, then ``all_reduce``). ``chunk_size`` None:
    ``chunk_rows`` of the gallery size. ``progress``: show the queries scored (``modeling_tagclip.progress``)."""
    q_ids = _to_numpy(query_ids).reshape(-1)
    accumulator = RetrievalAccumulator(gallery_ids, gallery_views, ks)
    chunk_size = chunk_rows(accumulator.num_gallery) if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if len(q_ids) == 0 or accumulator.num_gallery == 0:
        raise ValueError("empty query set or gallery")
    accumulator.identities.codes(q_ids)  # every query must have a relevant item: fail before any scoring
    queries = queries if queries is not None else range(len(q_ids))
    with Progress("scoring", len(queries), "caption", enabled=progress and main_process()) as bar:
        bar.write(f"{len(queries)} query captions against {accumulator.num_gallery} gallery images")
        for start in range(queries.start, queries.stop, chunk_size):
            stop = min(start + chunk_size, queries.stop)
            accumulator.add(scores(start, stop), q_ids[start:stop])
            bar.update(stop - start)
    return accumulator


def _matrix_accumulator(similarity, query_ids, gallery_ids, gallery_views, ks, chunk_size):
    sim = _to_scores(similarity)
    q_ids, g_ids = _to_numpy(query_ids).reshape(-1), _to_numpy(gallery_ids).reshape(-1)
    if sim.ndim != 2 or tuple(sim.shape) != (len(q_ids), len(g_ids)):
        raise ValueError(
            f"similarity must be [n_queries, n_gallery] = [{len(q_ids)}, {len(g_ids)}], got {tuple(sim.shape)}"
        )
    check_finite(sim, "similarity")
    return stream_retrieval_metrics(
        lambda start, stop: sim[start:stop], q_ids, g_ids, gallery_views, ks, chunk_size
    )


def retrieval_metrics(
    similarity: ArrayLike,
    query_ids: ArrayLike,
    gallery_ids: ArrayLike,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 512,
) -> dict[str, float]:
    """R@K, mAP and mINP (percent) for a [n_queries, n_gallery] similarity matrix, ``chunk_size`` rows at a time.

    Raises ``ValueError`` if a query has no relevant gallery item. Ties rank the lower gallery index first.
    """
    return _matrix_accumulator(similarity, query_ids, gallery_ids, None, ks, chunk_size).compute()


def match_view_breakdown(
    similarity: ArrayLike,
    query_ids: ArrayLike,
    gallery_ids: ArrayLike,
    gallery_views: ArrayLike,
    ks: Sequence[int] = (1, 5, 10),
    chunk_size: int = 512,
) -> dict[str, dict[str, float]]:
    """Metrics per query group by the views of the query's relevant gallery images: all aerial, all ground, or
    both (``MATCH_VIEW_GROUPS``). Views: 0 = aerial, 1 = ground. The gallery is always the full gallery. Each
    entry is the ``retrieval_metrics`` dict plus ``num_queries``; empty groups are omitted.
    """
    return _matrix_accumulator(similarity, query_ids, gallery_ids, gallery_views, ks, chunk_size).breakdown()


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
