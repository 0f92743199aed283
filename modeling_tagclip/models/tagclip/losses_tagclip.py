"""TAG-CLIP training losses, one function per equation of the paper (reference `CLIP.forward`).

Rows of the similarity matrices are the local batch, columns the (optionally all-gathered) global batch;
pass the same tensors twice on one process. `ContrastiveLoss` is the one place that gathers: it computes the
alignment terms of TAG-PR Eq. 11 for `TagClipModel.forward(return_loss=True)`, on one process or several.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def clamped_scale(logit_scale: torch.Tensor, max_value: float = 100.0) -> torch.Tensor:
    """exp(logit_scale) clamped to `max_value` in value only: the gradient flows as if unclamped (reference)."""
    scale = logit_scale.exp()
    return scale + (scale.clamp(max=max_value) - scale).detach()


def identity_targets(row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
    """Row-normalised multi-positive targets y = [id_i == id_j] / sum_j [id_i == id_j] (reference)."""
    positives = (row_ids[:, None] == col_ids[None, :]).float()
    return positives / positives.sum(dim=1, keepdim=True)


def _soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -(targets * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def nitc_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    image_embeds_all: torch.Tensor,
    text_embeds_all: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    alpha: float,
) -> torch.Tensor:
    """N-ITC of TBPS-CLIP, the first term of TAG-PR Eq. 1 and TAG-PR Eq. 2 (reference `calc_contrastive`).

    Embeddings are L2-normalised. Targets mix the identity targets with the model's own detached
    predictions: q = alpha * softmax(s * v t^T) + (1 - alpha) * y.
    """
    logits_i2t = scale * image_embeds @ text_embeds_all.t()
    logits_t2i = scale * text_embeds @ image_embeds_all.t()
    with torch.no_grad():
        soft_i2t = F.softmax(logits_i2t.detach(), dim=1)
        soft_t2i = F.softmax(logits_t2i.detach(), dim=1)
        q_i2t = alpha * soft_i2t + (1 - alpha) * targets
        q_t2i = alpha * soft_t2i + (1 - alpha) * targets
    return 0.5 * (_soft_cross_entropy(logits_i2t, q_i2t) + _soft_cross_entropy(logits_t2i, q_t2i))


def ritc_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    image_embeds_all: torch.Tensor,
    text_embeds_all: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 0.01,
) -> torch.Tensor:
    """R-ITC, the second term of TAG-PR Eq. 1 and TAG-PR Eq. 2: 1/2 [KL(P_i2t || y+eps) + KL(P_t2i || y+eps)].

    KL is summed over columns and divided by the number of rows (`batchmean`); y + eps is not
    renormalised, exactly as the reference `compute_ritc`.
    """
    log_q = torch.log(targets + eps)
    kls = []
    for logits in (scale * image_embeds @ text_embeds_all.t(), scale * text_embeds @ image_embeds_all.t()):
        log_p = F.log_softmax(logits, dim=1)
        kls.append(F.kl_div(log_q, log_p, log_target=True, reduction="batchmean"))
    return 0.5 * (kls[0] + kls[1])


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """All-gather along dim 0 across the ranks of the default process group, keeping gradients (open_clip
    `gather_features`); the tensor itself when torch.distributed is not initialised or has one rank."""
    if not _distributed():
        return tensor
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cat(all_gather(tensor.contiguous()))


@dataclass
class ContrastiveLoss:
    """The alignment terms of TAG-PR Eq. 11, L_GA (global pair) + L_LA (TSE pair): N-ITC and R-ITC (TAG-PR Eq. 1, 2) per
    (image, text) embedding pair, the local rows against the global batch.

    With `gather` (default) and torch.distributed initialised with several ranks, the embeddings and identities
    of every rank are all-gathered with gradients (open_clip `ClipLoss`), so N processes with batch B train as
    one process with batch N x B. `gather=False` keeps each rank's negatives local.
    """

    gather: bool = True

    def __call__(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        person_ids: torch.Tensor | None,
        scale: torch.Tensor,
        alpha: float | torch.Tensor,
        ritc_eps: float = 0.01,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of N-ITC, sum of R-ITC) over `pairs` of L2-normalised embeddings (unweighted).

        Without `person_ids` every pair is its own identity (ids offset by rank when gathering)."""
        gather = gather_with_grad if self.gather and _distributed() else (lambda t: t)
        if person_ids is None:
            n, device = pairs[0][0].shape[0], pairs[0][0].device
            rank = dist.get_rank() if self.gather and _distributed() else 0
            person_ids = torch.arange(n, device=device) + rank * n
        targets = identity_targets(person_ids, gather(person_ids))
        pairs = [(image.float(), text.float()) for image, text in pairs]
        everything = [(image, text, gather(image), gather(text)) for image, text in pairs]
        nitc = sum(nitc_loss(i, t, i_all, t_all, targets, scale, alpha) for i, t, i_all, t_all in everything)
        ritc = sum(
            ritc_loss(i, t, i_all, t_all, targets, scale, ritc_eps) for i, t, i_all, t_all in everything
        )
        return nitc, ritc


def id_loss(image_logits: torch.Tensor, text_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ID loss L_id: 1/2 (CE(classifier(v_cls)) + CE(classifier(t_eos))) on unnormalised features (TAG-PR Eq. 12)."""
    return 0.5 * (F.cross_entropy(image_logits, labels) + F.cross_entropy(text_logits, labels))


def view_loss(view_logits: tuple[torch.Tensor, ...], view_labels: torch.Tensor) -> torch.Tensor:
    """View loss, TAG-PR Eq. 9: CE(g_img, z_gt), averaged over the image-level routers of all MoE blocks (reference)."""
    return torch.stack([F.cross_entropy(logits, view_labels) for logits in view_logits]).mean()


def view_accuracy(view_logits: tuple[torch.Tensor, ...], view_labels: torch.Tensor) -> torch.Tensor:
    """Accuracy of the image-level routers (Fig. 6 left), averaged over MoE blocks, in [0, 1]."""
    return torch.stack([(logits.argmax(-1) == view_labels).float().mean() for logits in view_logits]).mean()


def ortho_loss_reference(cls_view_cos: tuple[torch.Tensor, ...], scale: float = 100.0, margin: float = 0.001):
    """Orthogonal loss as the reference codes it: scale * mean(max(|cos(h_cls, h_view)| - margin, 0)).

    `cls_view_cos` holds, per MoE block, the cosine between the ln_2 CLS and view states ([B]); the
    result is averaged over blocks. The paper's TAG-PR Eq. 10 is `ortho_loss_paper`.
    """
    per_block = [scale * (cos.abs() - margin).clamp(min=0).mean() for cos in cls_view_cos]
    return torch.stack(per_block).mean()


def ortho_loss_paper(cls_embeds: torch.Tensor, view_embeds: torch.Tensor, alpha: float = 0.1) -> torch.Tensor:
    """Orthogonal loss of the paper, TAG-PR Eq. 10: min(|cos(v_cls, v_view)|, alpha), averaged over the batch."""
    cos = F.cosine_similarity(cls_embeds, view_embeds, dim=-1)
    return cos.abs().clamp(max=alpha).mean()


def total_loss(terms: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """TAG-PR Eq. 11-13: L = L_GA + L_LA + l_id L_id + l_view L_view + l_ortho L_ortho (terms already weighted)."""
    present = [value for value in terms.values() if value is not None]
    if not present:
        raise ValueError("no loss term is enabled: check the use_*_loss switches and the inputs given.")
    return torch.stack(present).sum()
