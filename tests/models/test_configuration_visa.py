"""ViSAConfig: the reference geometry, presets, and clear errors for a bad config."""

import pytest
from fixtures import (
    VISA_LABELS,
    VISA_VIEWS,
    make_visa_model,
    tiny_visa_config,
    visa_pixels,
)

from modeling_tagclip.models.visa.configuration_visa import ViSAConfig

VIEWS, LABELS, pixels, make_model = VISA_VIEWS, VISA_LABELS, visa_pixels, make_visa_model


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_reference_config_geometry():
    config = ViSAConfig()
    assert config.grid_size == (21, 10) and config.num_patches == 210 and config.embedding_dim == 1536
    assert ViSAConfig.from_preset("lagper").num_patches == 252
    vdt = ViSAConfig.from_preset("vdt")
    assert vdt.num_patches == 128 and vdt.embedding_dim == 768 and vdt.view_tokens == "shared"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden_size=30), "multiple of num_attention_heads"),
        (dict(view_tokens="triple"), "view_tokens must be one of"),
        (dict(dlfm_gcn="none"), "dlfm_gcn must be one of"),
        (dict(graph_top_k=22), "graph_top_k"),
        (dict(expert_top_k=4), "expert_top_k"),
        (dict(image_size=[4, 16]), "smaller than patch_size"),
        (dict(patch_stride=[0, 4]), "positive"),
        (dict(view_tokens="none", subtract_last_block=True), "subtract_last_block"),
        (dict(num_identities=-1), "num_identities"),
        (dict(image_size=[32, 16, 3]), "pair"),
    ],
)
def test_bad_config_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_visa_config(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        ViSAConfig.from_preset("market")
