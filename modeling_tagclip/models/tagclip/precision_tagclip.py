"""TAG-CLIP's precision policy: under autocast, rows whose TSE token selection or argmax routing is within the
autocast dtype's rounding of a tie are re-run in fp32, so that bf16 serving selects the tokens and experts that
fp32 does.

The towers know nothing of it: a tower's feature function returns its fields with the evidence of its discrete
choices (``selection``: the TSE scores and the routing), and ``near_tie_rerun`` wraps it to apply the model's
``precision_policy`` (a ``NearTieRerun``; ``None`` runs the towers as they are).
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import is_torchdynamo_compiling

__all__ = ["NearTieRerun", "Selection", "log_score_spread", "near_tie_rerun", "selection_margin"]


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


@dataclass
class Selection:
    """What a tower chose discretely, for a precision policy: ``tse`` = (scores, k, counts) of `select_tokens`
    (None without TSE), ``routing`` = the vision tower's per-block routing (with `view_margin`), None for text."""

    tse: tuple | None = None
    routing: tuple | None = None


@dataclass
class NearTieRerun:
    """Re-run in fp32 the rows whose TSE selection or argmax routing is near a tie under autocast.

    tse_recheck_eps: how conservative the TSE part is (0 turns it off): under autocast at inference, rows whose
        `selection_margin` is below this many machine epsilons of the autocast dtype (bf16: 2^-7) times the
        row's `log_score_spread` are re-run in fp32.
    routing_recheck_eps: how conservative the routing part is (0 turns it off): images whose aerial / ground
        argmax decision has a `TagClipHRMoE.view_margin` below this many epsilons of the autocast dtype in any
        HR-MoE block are re-run in fp32 as well.
    """

    tse_recheck_eps: float = 0.6
    routing_recheck_eps: float = 2.0

    @staticmethod
    def active(model: torch.nn.Module, device: str) -> bool:
        """Whether near ties are re-run in fp32: fp32 weights under autocast, in eval mode, eagerly."""
        if is_torchdynamo_compiling() or model.training or not torch.is_autocast_enabled(device):
            return False
        return model.logit_scale.dtype == torch.float32

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

    @staticmethod
    def rerun(
        fields: dict[str, Any], near: torch.Tensor | None, fp32_fields: Callable[[torch.Tensor], dict]
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

    def __call__(
        self, model: torch.nn.Module, tower: Callable[..., dict], arguments: dict[str, Any]
    ) -> dict[str, Any]:
        """`tower(model, **arguments)`'s fields (without ``selection``), near-tied rows re-run in fp32 on their
        rows of the tensor arguments (floating ones in fp32; other arguments dropped) when `active`."""
        device = next(v for v in arguments.values() if torch.is_tensor(v)).device.type
        fields = tower(model, **arguments)
        selection = fields.pop("selection")
        if not self.active(model, device):
            return fields
        near = self.near_ties(device, selection.tse, selection.routing)

        def fp32_fields(rows: torch.Tensor) -> dict[str, Any]:
            inputs = {
                name: value[rows].float() if value.is_floating_point() else value[rows]
                for name, value in arguments.items()
                if torch.is_tensor(value)
            }
            return tower(model, **inputs)

        return self.rerun(fields, near, fp32_fields)


def near_tie_rerun(tower: Callable[..., dict]) -> Callable[..., dict]:
    """Wrap a tower feature method (returning its fields and their ``selection``) with the model's
    ``precision_policy``; the wrapped method returns the fields without ``selection``."""
    positional = [
        p.name for p in inspect.signature(tower).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD
    ][1:]

    @functools.wraps(tower)
    def run(model: torch.nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
        arguments = dict(zip(positional, args, strict=False)) | kwargs
        policy = getattr(model, "precision_policy", None)
        if policy is None:
            fields = tower(model, **arguments)
            fields.pop("selection")
            return fields
        return policy(model, tower, arguments)

    return run
