"""No host sync in the eager forward: a counting shim on the Python-level sync points (reading a tensor's value,
copying it to the host, data-dependent output shapes) sees none in the image and text forwards in eval, on the
code path a GPU runs (`on_host` False: on the CPU, reading values costs no sync and the checks read them)."""

import pytest
import torch
from fixtures import VISA_VIEWS, make_visa_model, tiny_config, tiny_pixels, visa_pixels

from modeling_tagclip import TagClipModel
from modeling_tagclip.models.tagclip import device_ops as tagclip_ops
from modeling_tagclip.models.tagclip import modeling_tagclip
from modeling_tagclip.models.visa import device_ops as visa_ops

TENSOR_SYNCS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "unique",
    "masked_select",
)
TORCH_SYNCS = ("nonzero", "unique", "masked_select")


@pytest.fixture
def syncs(monkeypatch) -> list[str]:
    """The sync points called (names, in order) while the test runs, on the device code path."""
    for module in (tagclip_ops, visa_ops, modeling_tagclip):
        monkeypatch.setattr(module, "on_host", lambda tensor: False)
    calls: list[str] = []

    def counting(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in TENSOR_SYNCS:
        counting(torch.Tensor, name)
    for name in TORCH_SYNCS:
        counting(torch, name)
    return calls


def text_ids(config, batch: int = 3) -> torch.Tensor:
    ids = torch.zeros(batch, config.max_position_embeddings, dtype=torch.long)
    ids[:, 0], ids[:, 1], ids[:, 2], ids[:, 3] = config.bos_token_id, 5, 7, config.eos_token_id
    return ids


@pytest.fixture(scope="module")
def tagclip_model() -> TagClipModel:
    torch.manual_seed(0)
    return TagClipModel(tiny_config()).eval()


def test_the_shim_counts_a_sync(syncs):
    assert bool(torch.ones(2).sum() > 1) and torch.arange(3).tolist() == [0, 1, 2]
    assert syncs == ["__bool__", "tolist"]


def test_tagclip_image_forward_has_no_host_sync(tagclip_model, syncs):
    pixel_values = tiny_pixels(4)
    with torch.no_grad():
        out = tagclip_model.get_image_features(pixel_values)
    assert syncs == []
    assert out.pooler_output.shape[0] == 4 and torch.isfinite(out.pooler_output).all()


def test_tagclip_text_forward_has_no_host_sync(tagclip_model, syncs):
    ids = text_ids(tagclip_model.config.text_config)
    with torch.no_grad():
        out = tagclip_model.get_text_features(ids)
    assert syncs == []
    assert out.pooler_output.shape[0] == 3 and torch.isfinite(out.pooler_output).all()


def test_tagclip_paired_forward_has_no_host_sync(tagclip_model, syncs):
    with torch.no_grad():
        out = tagclip_model(
            input_ids=text_ids(tagclip_model.config.text_config, 2), pixel_values=tiny_pixels(2)
        )
    assert syncs == []
    assert out.logits_per_text.shape == (2, 2)


@pytest.fixture(scope="module")
def visa_model():
    return make_visa_model().eval()


def test_visa_forward_has_no_host_sync(visa_model, syncs):
    with torch.no_grad():
        out = visa_model(visa_pixels(), view_labels=VISA_VIEWS)
    assert syncs == []
    assert torch.isfinite(out.pooler_output).all()


def test_device_path_bad_inputs_fail_on_the_device_assert(tagclip_model, syncs):
    """Off the host the checks are device-side asserts (`torch._assert_async`): on the CPU they raise at once."""
    bad = tiny_pixels(2)
    bad[1, 0, 0, 0] = float("nan")
    with torch.no_grad(), pytest.raises(RuntimeError, match="pixel_values contain NaN or inf values"):
        tagclip_model.get_image_features(bad)
    ids = text_ids(tagclip_model.config.text_config)
    ids[1, 3] = 0  # no EOS
    with torch.no_grad(), pytest.raises(RuntimeError, match="needs an EOS token"):
        tagclip_model.get_text_features(ids)
    assert syncs == []


def test_device_path_view_label_and_dtype_checks_add_no_sync(syncs):
    """`routing="label"` checks view_labels by a device-side assert, and raw uint8 pixels are refused from their
    dtype alone: neither reads a value on the device path."""
    torch.manual_seed(0)
    model = TagClipModel(tiny_config(vision=dict(routing="label"))).eval()
    with torch.no_grad():
        out = model.get_image_features(tiny_pixels(2), view_labels=torch.tensor([1, 0]))
        assert syncs == [] and out.pooler_output.shape == (2, 16)
        with pytest.raises(RuntimeError, match=r"view_labels must be 0 \(aerial\) or 1 \(ground\)"):
            model.get_image_features(tiny_pixels(2), view_labels=torch.tensor([0, 3]))
        with pytest.raises(ValueError, match="pixel_values are uint8"):
            model.get_image_features(tiny_pixels(2).to(torch.uint8))
    assert syncs == []


BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def test_bf16_autocast_syncs_once_per_tower_call_for_the_near_tie_rows(tagclip_model, syncs):
    """Under autocast (GPU indexing and serving) the one sync of a tower call is `nonzero` on the near-tie mask:
    which rows to re-run in fp32 (the model's `precision_policy`) is a data-dependent shape."""
    with torch.no_grad(), torch.autocast(**BF16):
        image = tagclip_model.get_image_features(tiny_pixels(4))
        assert syncs == ["nonzero"]
        text = tagclip_model.get_text_features(text_ids(tagclip_model.config.text_config))
        assert syncs == ["nonzero", "nonzero"]
        tagclip_model(input_ids=text_ids(tagclip_model.config.text_config, 2), pixel_values=tiny_pixels(2))
    assert syncs == ["nonzero"] * 4
    assert torch.isfinite(image.pooler_output).all() and torch.isfinite(text.pooler_output).all()


@pytest.mark.parametrize("off", ["zero thresholds", "no policy"])
def test_bf16_autocast_without_the_fp32_rerun_has_no_host_sync(syncs, off):
    torch.manual_seed(0)
    model = TagClipModel(tiny_config()).eval()
    if off == "no policy":
        model.precision_policy = None
    else:
        model.precision_policy.tse_recheck_eps = model.precision_policy.routing_recheck_eps = 0.0
    with torch.no_grad(), torch.autocast(**BF16):
        out = model(input_ids=text_ids(model.config.text_config, 2), pixel_values=tiny_pixels(2))
    assert syncs == []
    assert out.logits_per_text.shape == (2, 2)


def test_visa_bf16_autocast_has_no_host_sync(visa_model, syncs):
    with torch.no_grad(), torch.autocast(**BF16):
        out = visa_model(visa_pixels(), view_labels=VISA_VIEWS)
    assert syncs == []
    assert torch.isfinite(out.pooler_output.float()).all()
