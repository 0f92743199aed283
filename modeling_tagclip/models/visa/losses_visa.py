"""ViSA training losses, one function per equation of the paper (reference `Baseline_multiview_ViSA.losses`).

Where the paper's formula and the reference code differ, the code is implemented and the difference named:
the triplet loss is the soft-margin batch-hard form (ViSA Eq. 15 writes a hinge on squared distances), and the
load-balancing importances are renormalised before ViSA Eq. 18.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visa_id_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ViSA Eq. 14: identity cross-entropy, mean over the batch, no label smoothing (reference `EPSILON: 0`)."""
    return F.cross_entropy(logits.float(), labels)


def euclidean_distances(features: torch.Tensor) -> torch.Tensor:
    """Pairwise Euclidean distances sqrt(clamp(|x|^2 + |y|^2 - 2xy, 1e-12)) (fast-reid `euclidean_dist`)."""
    features = features.float()
    squared = features.pow(2).sum(dim=1, keepdim=True)
    return (squared + squared.t() - 2 * features @ features.t()).clamp(min=1e-12).sqrt()


def hard_example_mining(distances: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-hard mining: hardest positive (self included) and hardest negative distance per anchor."""
    positive = (labels[:, None] == labels[None, :]).float()
    negative = 1.0 - positive
    hardest_positive = (distances * positive).max(dim=1).values
    hardest_negative = (distances * negative + positive * 1e9).min(dim=1).values
    return hardest_positive, hardest_negative


def triplet_loss(features: torch.Tensor, labels: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """ViSA Eq. 15 as the reference codes it: batch-hard triplet on unnormalised Euclidean distances.

    `margin == 0`: soft margin, mean(log(1 + exp(-(d_an - d_ap)))); falls back to a 0.3 hinge if that is
    infinite (reference). `margin > 0`: mean(max(d_ap - d_an + margin, 0)).
    """
    d_ap, d_an = hard_example_mining(euclidean_distances(features), labels)
    ones = torch.ones_like(d_an)
    if margin > 0:
        return F.margin_ranking_loss(d_an, d_ap, ones, margin=margin)
    loss = F.soft_margin_loss(d_an - d_ap, ones)
    if torch.isinf(loss):
        loss = F.margin_ranking_loss(d_an, d_ap, ones, margin=0.3)
    return loss


def view_loss(view_logits: torch.Tensor, view_targets: torch.Tensor) -> torch.Tensor:
    """ViSA Eq. 16: cross-entropy of the 2-way view classifier on z_spe (targets in the head's class order)."""
    return F.cross_entropy(view_logits.float(), view_targets)


def orthogonal_loss(invariant: torch.Tensor, specific: torch.Tensor) -> torch.Tensor:
    """ViSA Eq. 17: mean_i |cos(z_inv_i, z_spe_i)| on the pre-BNNeck features."""
    return F.cosine_similarity(invariant.float(), specific.float(), dim=-1).abs().mean()


def load_balance_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ViSA Eq. 18-19 for one router: E * sum_j pbar_j^2 with pbar = mean softmax probability.

    As the reference, pbar is renormalised to sum 1 (pbar / (sum + 1e-6)): 1 at perfect balance, E when
    collapsed onto one expert. Logits [n, E].
    """
    importance = F.softmax(router_logits.float(), dim=-1).mean(dim=0)
    importance = importance / (importance.sum() + 1e-6)
    return router_logits.shape[-1] * importance.pow(2).sum()


def etgm_balance_loss(
    shared_logits: torch.Tensor | None,
    aerial_logits: torch.Tensor | None,
    ground_logits: torch.Tensor | None,
    batch_size: int,
) -> torch.Tensor | None:
    """Load balance over ETGM's three routers (`Router`): LB_shared + LB_aerial n_a/B + LB_ground n_g/B.

    A view router's term is present only if that view occurs in the batch; `None` if no router ran.
    """
    terms = []
    if shared_logits is not None and shared_logits.shape[0] > 0:
        terms.append(load_balance_loss(shared_logits))
    for logits in (aerial_logits, ground_logits):
        if logits is not None and logits.shape[0] > 0:
            terms.append(load_balance_loss(logits) * (logits.shape[0] / batch_size))
    return torch.stack(terms).sum() if terms else None


def total_loss(terms: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """ViSA Eq. 20: the sum of the (already weighted) terms that are present."""
    present = [value for value in terms.values() if value is not None]
    if not present:
        raise ValueError("no loss term is enabled: pass labels, or check the lambda_* weights and switches.")
    return torch.stack(present).sum()


__all__ = [
    "etgm_balance_loss",
    "euclidean_distances",
    "hard_example_mining",
    "visa_id_loss",
    "load_balance_loss",
    "orthogonal_loss",
    "total_loss",
    "triplet_loss",
    "view_loss",
]
