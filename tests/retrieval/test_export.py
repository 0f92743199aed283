"""ONNX export (`modeling_tagclip.export`, `tagclip export onnx`): onnxruntime parity with PyTorch, dynamic batch,
clear errors for what has no ONNX form."""

import json

import numpy as np
import pytest
import torch
from fixtures import tiny_config, tiny_pixels, tiny_text

from modeling_tagclip import TagClipModel
from modeling_tagclip.export import ExportError, export_onnx

ort = pytest.importorskip("onnxruntime", reason="the `export` extra (onnx, onnxruntime, onnxscript)")


@pytest.fixture(scope="module")
def tagclip_export(tmp_path_factory):
    """A tiny model saved with its processor, exported with the CLI (`tagclip export onnx`)."""
    from modeling_tagclip import TagClipProcessor
    from modeling_tagclip.cli import main

    torch.manual_seed(0)
    model = TagClipModel(tiny_config()).eval()
    with torch.no_grad():  # spread the routers so images take different experts
        for name, param in model.named_parameters():
            if "router.weight" in name:
                param.normal_(std=0.5)
    out = tmp_path_factory.mktemp("onnx")
    model.save_pretrained(out / "model")
    TagClipProcessor.from_defaults(32, 16).save_pretrained(out / "model")
    assert main(["export", "onnx", str(out / "model"), str(out / "onnx")]) == 0
    manifest = json.loads((out / "onnx" / "onnx_export.json").read_text())
    return model, out, manifest


def _run(path, **inputs):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))


@pytest.mark.slow
def test_image_graph_matches_pytorch_at_another_batch_size(tagclip_export):
    model, out, manifest = tagclip_export
    assert manifest["graphs"]["image.onnx"]["outputs"] == [
        "image_embeds",
        "image_local_embeds",
        "view_logits",
        "image_tse_indices",
    ]
    pixels = tiny_pixels(16)  # exported with batch 2
    got = _run(out / "onnx" / "image.onnx", pixel_values=pixels.numpy())
    with torch.no_grad():
        ref = model.get_image_features(pixels)
    np.testing.assert_allclose(got["image_embeds"], ref.pooler_output.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["image_local_embeds"], ref.local_embeds.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(got["image_tse_indices"], ref.tse_indices.numpy())
    view = torch.stack(ref.view_logits, dim=1).numpy()
    np.testing.assert_allclose(got["view_logits"], view, atol=1e-4, rtol=0)
    assert set(view[:, -1].argmax(-1).tolist()) == {0, 1}  # both expert groups exercised


@pytest.mark.slow
def test_text_graph_matches_pytorch(tagclip_export):
    model, out, _ = tagclip_export
    ids = tiny_text(6)
    got = _run(out / "onnx" / "text.onnx", input_ids=ids.numpy())
    with torch.no_grad():
        ref = model.get_text_features(ids)
    np.testing.assert_allclose(got["text_embeds"], ref.pooler_output.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["text_local_embeds"], ref.local_embeds.numpy(), atol=1e-4, rtol=0)
    words = (ids != 0).sum(1) - 2  # TSE pools the first min(k, words) selections; the rest are tied zeros
    for row, n in enumerate(words.clamp(max=model.text_tse_k).tolist()):
        assert got["text_tse_indices"][row, :n].tolist() == ref.tse_indices[row, :n].tolist()


@pytest.mark.slow
def test_training_only_routing_refused(tagclip_export, tmp_path):
    model, out, manifest = tagclip_export
    assert {p.name for p in (out / "onnx").iterdir()} == {"image.onnx", "text.onnx", "onnx_export.json"}
    for routing, reason in (("gumbel", "training-only"), ("soft", "training-only"), ("label", "view labels")):
        model.config.vision_config.routing = routing
        try:
            with pytest.raises(ExportError, match=rf"routing='{routing}' cannot be exported: .*{reason}"):
                export_onnx(model, tmp_path / routing)
        finally:
            model.config.vision_config.routing = "argmax"
        assert not (tmp_path / routing / "image.onnx").exists()
    with pytest.raises(ExportError, match="cannot export a Linear"):
        export_onnx(torch.nn.Linear(2, 2), tmp_path / "linear")


@pytest.mark.slow
def test_visa_graph_matches_pytorch(tmp_path):
    from fixtures import VISA_VIEWS, perturb_, tiny_visa_config, visa_pixels

    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID

    torch.manual_seed(0)
    model = perturb_(ViSAForReID(tiny_visa_config())).eval()
    manifest = export_onnx(model, tmp_path)
    assert manifest["graphs"]["visa.onnx"]["inputs"] == ["pixel_values", "view_labels"]
    batch = visa_pixels(6)
    got = _run(tmp_path / "visa.onnx", pixel_values=batch.numpy(), view_labels=VISA_VIEWS.numpy())
    with torch.no_grad():
        ref = model.visa(batch, view_labels=VISA_VIEWS).pooler_output
    np.testing.assert_allclose(got["embeddings"], ref.numpy(), atol=1e-4, rtol=0)
