"""TAG-CLIP's precision policy: under autocast, rows whose TSE token selection or argmax routing is within the
autocast dtype's rounding of a tie are re-run in fp32, so that bf16 serving selects the tokens and experts that
fp32 does.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import is_torchdynamo_compiling

__all__ = ["NearTieRerunMixin", "log_score_spread", "selection_margin"]


def selection_margin(scores: torch.Tensor, k: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Relative gap [B] between the n-th and (n+1)-th highest score of each row (n = `counts` capped at `k`,
    default `k`): how near `select_tokens` is to swapping a token of its first n; inf with no (n+1)-th."""
    if k >= scores.shape[-1]:
        return torch.full(scores.shape[:1], float("inf"), device=scores.device)
    top = scores.float().topk(k + 1, dim=-1).values
    n = torch.full_like(top[:, 0], k, dtype=torch.long) if counts is None else counts.clamp(min=1, max=k)
    last, after = top.gather(1, n[:, None] - 1)[:, 0], top.gather(1, n[:, None])[:, 0]
    return (last - after) / last.abs().clamp_min(torch.finfo(torch.float32).tiny)


def log_score_spread(scores: torch.Tensor) -> torch.Tensor:
    """ln(max / min) [B] of each row's positive scores (about the attention logits' range; 0 for a row with
    fewer than two): the scale of a low-precision forward's relative change of a score."""
    positive = scores > 0
    low = scores.float().masked_fill(~positive, float("inf")).amin(dim=-1)
    high = scores.float().amax(dim=-1)
    return torch.where(positive.any(dim=-1), (high / low).log(), torch.zeros_like(high))


class NearTieRerunMixin:
    """`TagClipModel`'s fp32 re-run of near-tied rows (`near_ties`, `rerun_near_ties_in_fp32`)."""

    tse_recheck_eps: float = 0.6
    """How conservative the TSE part of the fp32 re-run is (0 turns it off): under autocast at inference, rows
    whose `selection_margin` is below this many machine epsilons of the autocast dtype (bf16: 2^-7) times the
    row's `log_score_spread` are re-run in fp32 (`rerun_near_ties_in_fp32`)."""

    routing_recheck_eps: float = 2.0
    """How conservative the routing part of the fp32 re-run is (0 turns it off): images whose aerial / ground
    argmax decision has a `TagClipHRMoE.view_margin` below this many epsilons of the autocast dtype in any HR-MoE
    block are re-run in fp32 as well."""

    def recheck_active(self, device: str) -> bool:
        """Whether near ties are re-run in fp32: fp32 weights under autocast, in eval mode, eagerly."""
        if is_torchdynamo_compiling() or self.training or not torch.is_autocast_enabled(device):
            return False
        return self.logit_scale.dtype == torch.float32

    def near_ties(
        self, device: str, tse: tuple | None = None, routing: tuple | None = None
    ) -> torch.Tensor | None:
        """Bool [B]: rows whose TSE selection (`tse` = (scores, k, counts) of `select_tokens`) or argmax routing
        (`routing`: the vision tower's `router_logits`) is within the autocast dtype's rounding of a tie; None if
        neither is checked.

        Low-precision rounding anywhere in a tower perturbs the attention logits in proportion to their scale,
        so a score's relative change grows with the row's logit range (`log_score_spread`: on the main job's
        checkpoint a median 8 for images, 1.4 for captions, whose margins bf16 moves by up to 4.5 and 0.4
        epsilons): a TSE row is near a tie below `tse_recheck_eps` x eps x spread. A routing decision is near a
        tie when its `view_margin` (relative to its terms' magnitudes) is below `routing_recheck_eps` x eps in
        any block.
        """
        eps = torch.finfo(torch.get_autocast_dtype(device)).eps
        near = []
        if tse is not None and self.tse_recheck_eps > 0:
            scores, k, counts = tse
            near.append(
                selection_margin(scores, k, counts) < self.tse_recheck_eps * eps * log_score_spread(scores)
            )
        if self.routing_recheck_eps > 0:
            margins = [r.view_margin for r in routing or () if r.view_margin is not None]
            near += [margin < self.routing_recheck_eps * eps for margin in margins]
        return functools.reduce(torch.logical_or, near) if near else None

    def rerun_near_ties_in_fp32(
        self, fields: dict[str, Any], near: torch.Tensor | None, fp32_fields: Callable[[torch.Tensor], dict]
    ) -> dict[str, Any]:
        """`fields` with the `near` rows of every tensor (embeddings, dense tokens, TSE tokens and indices)
        replaced by those of `fp32_fields(rows)`, the same tower re-run in fp32 on those rows: near-tied rows get
        fp32's tokens and routing, hence its embeddings. Tuples (hidden states, attentions, view logits,
        routing) stay the autocast forward's. One host sync per batch; `near=None` returns `fields` as is."""
        if near is None:
            return fields
        rows = near.nonzero()[:, 0]
        if not rows.numel():
            return fields
        with torch.autocast(near.device.type, enabled=False):
            fp32 = fp32_fields(rows)
        return {
            key: value.index_put((rows,), fp32[key].to(value.dtype)) if torch.is_tensor(value) else value
            for key, value in fields.items()
        }
