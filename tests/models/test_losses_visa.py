"""Known-answer checks of ViSA's losses (modeling_tagclip/models/visa/losses_visa.py)."""

import pytest
import torch
import torch.nn.functional as F
from fixtures import (
    VISA_LABELS,
    VISA_VIEWS,
    make_visa_model,
    visa_pixels,
)

from modeling_tagclip.models.visa.losses_visa import (
    etgm_balance_loss,
    load_balance_loss,
    orthogonal_loss,
    triplet_loss,
)

VIEWS, LABELS, pixels, make_model = VISA_VIEWS, VISA_LABELS, visa_pixels, make_visa_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_load_balance_known_answers():
    assert load_balance_loss(torch.zeros(5, 8)).item() == pytest.approx(1.0, abs=1e-5)
    collapsed = torch.full((5, 8), -1e4)
    collapsed[:, 3] = 0
    assert load_balance_loss(collapsed).item() == pytest.approx(8.0, abs=1e-4)
    total = etgm_balance_loss(torch.zeros(4, 8), collapsed[:1], None, batch_size=4)
    assert total.item() == pytest.approx(1.0 + 8.0 / 4, abs=1e-4)
    assert etgm_balance_loss(None, None, None, 4) is None


def test_soft_margin_batch_hard_triplet_known_answer():
    features = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 1.0], [0.0, 5.0]])
    labels = torch.tensor([0, 0, 1, 1])
    # anchor 0: d_ap = 3 (to 1), d_an = 1 (to 2); anchor 1: 3 / sqrt(10); anchor 2: 4 / 1; anchor 3: 4 / 5
    d_ap = torch.tensor([3.0, 3.0, 4.0, 4.0])
    d_an = torch.tensor([1.0, 10**0.5, 1.0, 5.0])
    expected = F.softplus(-(d_an - d_ap)).mean()
    torch.testing.assert_close(triplet_loss(features, labels), expected, atol=1e-4, rtol=1e-4)
    hinge = F.relu(d_ap - d_an + 0.3).mean()
    torch.testing.assert_close(triplet_loss(features, labels, margin=0.3), hinge, atol=1e-4, rtol=1e-4)


def test_orthogonal_loss_known_answer():
    inv = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    spe = torch.tensor([[0.0, 2.0], [-1.0, -1.0]])
    assert orthogonal_loss(inv, spe).item() == pytest.approx(0.5)
