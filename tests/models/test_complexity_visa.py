"""ViSA's parameter and FLOP accounting (complexity_visa.py) against the paper and an instantiated model."""

import pytest
from fixtures import (
    VISA_LABELS,
    VISA_VIEWS,
    make_visa_model,
    tiny_visa_config,
    visa_pixels,
)

from modeling_tagclip.models.visa.complexity_visa import visa_complexity
from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
from modeling_tagclip.models.visa.modeling_visa import (
    ViSAForReID,
    ViSAModel,
)

VIEWS, LABELS, pixels, make_model = VISA_VIEWS, VISA_LABELS, visa_pixels, make_visa_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_paper_params_and_gflops_at_reference_configs():
    cargo = visa_complexity(ViSAConfig())
    assert cargo["params_reference"] == 271_772_184  # 271.77 M (paper Table 5)
    assert cargo["gflops"] == pytest.approx(37.50, abs=0.02)  # paper 37.53 ≈ 2 x Linear/Conv MACs
    full = visa_complexity(ViSAConfig(num_identities=2500))
    assert full["params_reference"] + full["params_for_reid"] - full["params_model"] == pytest.approx(
        275.62e6, abs=0.01e6
    )
    lagper = visa_complexity(ViSAConfig.from_preset("lagper"))
    assert round(lagper["params_reference"] / 1e6, 2) == 271.69 and round(lagper["gflops"], 2) == 44.27
    assert round(visa_complexity(ViSAConfig.from_preset("vdt"))["params_reference"] / 1e6, 2) == 85.75


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(dlfm_gcn="per_branch"), dict(view_tokens="none"), dict(view_tokens="shared", use_dlfm=False)],
)
def test_analytic_count_matches_instantiated_tiny_model(kwargs):
    config = tiny_visa_config(**kwargs)
    report = visa_complexity(config)
    assert report["params_model"] == sum(p.numel() for p in ViSAModel(config).parameters())
    assert report["params_for_reid"] == sum(p.numel() for p in ViSAForReID(config).parameters())
