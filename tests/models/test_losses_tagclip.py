"""Known-answer checks of the loss equations (modeling_tagclip/models/tagclip/losses_tagclip.py)."""

import math

import torch
import torch.nn.functional as F

from modeling_tagclip.models.tagclip.losses_tagclip import (
    ContrastiveLoss,
    clamped_scale,
    id_loss,
    identity_targets,
    nitc_loss,
    ortho_loss_paper,
    ortho_loss_reference,
    ritc_loss,
    total_loss,
    view_accuracy,
    view_loss,
)


def unit(*rows):
    return F.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_identity_targets_are_row_normalised_multi_positive():
    y = identity_targets(torch.tensor([3, 5, 3]), torch.tensor([3, 5, 3]))
    assert y.tolist() == [[0.5, 0.0, 0.5], [0.0, 1.0, 0.0], [0.5, 0.0, 0.5]]


def test_nitc_with_alpha_zero_is_cross_entropy_on_identity_targets():
    img, txt = unit([1, 0], [0, 1]), unit([1, 0], [1, 1])
    scale = torch.tensor(10.0)
    y = identity_targets(torch.tensor([0, 1]), torch.tensor([0, 1]))
    loss = nitc_loss(img, txt, img, txt, y, scale, alpha=0.0)
    s = 10 * img @ txt.t()
    expected = 0.5 * (F.cross_entropy(s, torch.arange(2)) + F.cross_entropy(s.t(), torch.arange(2)))
    torch.testing.assert_close(loss, expected)


def test_nitc_soft_targets_are_detached_predictions():
    img, txt = unit([1, 0], [0.6, 0.8]), unit([0.8, 0.6], [0, 1])
    img.requires_grad_(True)
    y = torch.eye(2)
    loss = nitc_loss(img, txt, img, txt, y, torch.tensor(5.0), alpha=0.5)
    logits_i2t, logits_t2i = 5 * img @ txt.t(), 5 * txt @ img.t()
    q_i2t = 0.5 * logits_i2t.softmax(1).detach() + 0.5 * y
    q_t2i = 0.5 * logits_t2i.softmax(1).detach() + 0.5 * y
    expected = 0.5 * (
        -(q_i2t * logits_i2t.log_softmax(1)).sum(1).mean() - (q_t2i * logits_t2i.log_softmax(1)).sum(1).mean()
    )
    torch.testing.assert_close(loss, expected)


def test_ritc_is_kl_of_predictions_against_unnormalised_targets():
    img, txt = unit([1, 0], [0, 1]), unit([1, 0.2], [0.1, 1])
    y = torch.eye(2)
    loss = ritc_loss(img, txt, img, txt, y, torch.tensor(4.0), eps=0.01)
    total = 0.0
    for logits in (4 * img @ txt.t(), 4 * txt @ img.t()):
        p = logits.softmax(1)
        total += (p * (p.log() - (y + 0.01).log())).sum() / 2
    torch.testing.assert_close(loss, 0.5 * total)


def test_clamped_scale_clamps_value_keeps_gradient():
    logit_scale = torch.tensor(math.log(200.0), requires_grad=True)
    scale = clamped_scale(logit_scale, 100.0)
    assert math.isclose(scale.item(), 100.0, rel_tol=1e-6)
    scale.backward()
    assert math.isclose(logit_scale.grad.item(), 200.0, rel_tol=1e-5)  # d exp(x)/dx, as if unclamped


def test_reference_ortho_hinge():
    cos = (torch.tensor([0.5, -0.0005]), torch.tensor([0.0, -0.2]))
    # block 1: 100 * mean(0.499, 0) = 24.95; block 2: 100 * mean(0, 0.199) = 9.95
    torch.testing.assert_close(ortho_loss_reference(cos), torch.tensor((24.95 + 9.95) / 2))


def test_paper_ortho_is_thresholded_abs_cosine():
    cls = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    view = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    # |cos| = 0 and 0.707 -> min(., 0.1) = 0 and 0.1
    torch.testing.assert_close(ortho_loss_paper(cls, view, alpha=0.1), torch.tensor(0.05))


def test_id_view_and_total():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([0, 1])
    torch.testing.assert_close(id_loss(logits, logits, labels), F.cross_entropy(logits, labels))
    view_logits = (logits, -logits)
    expected = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(-logits, labels))
    torch.testing.assert_close(view_loss(view_logits, labels), expected)
    assert view_accuracy(view_logits, labels).item() == 0.5
    torch.testing.assert_close(
        total_loss({"a": torch.tensor(1.0), "b": None, "c": torch.tensor(2.0)}), torch.tensor(3.0)
    )


def test_contrastive_loss_sums_nitc_and_ritc_over_pairs_on_one_process():
    """TAG-PR Eq. 11's alignment terms: without torch.distributed the global batch is the local one."""
    torch.manual_seed(0)
    pairs = [
        (F.normalize(torch.randn(4, 8), dim=-1), F.normalize(torch.randn(4, 8), dim=-1)) for _ in range(2)
    ]
    ids, scale = torch.tensor([0, 1, 0, 2]), torch.tensor(20.0)
    y = identity_targets(ids, ids)
    nitc, ritc = ContrastiveLoss()(pairs, ids, scale, 0.4, 0.01)
    torch.testing.assert_close(nitc, sum(nitc_loss(i, t, i, t, y, scale, 0.4) for i, t in pairs))
    torch.testing.assert_close(ritc, sum(ritc_loss(i, t, i, t, y, scale, 0.01) for i, t in pairs))
    own, _ = ContrastiveLoss()(pairs, None, scale, 0.0, 0.01)  # no ids: each pair its own identity
    eye = identity_targets(torch.arange(4), torch.arange(4))
    torch.testing.assert_close(own, sum(nitc_loss(i, t, i, t, eye, scale, 0.0) for i, t in pairs))
