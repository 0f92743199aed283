"""Inference Endpoints handler: text/image embeddings and ranking, as the Hub's toolkit calls it.

The handler running from a pulled Hub repository without this package is checked in test_hub.py.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from PIL import Image
from tagclip_tiny import save_tiny_model

from handler import EndpointHandler, decode_image

COLOURS = [(200, 30, 30), (20, 20, 20), (30, 160, 40)]


def _b64(image: Image.Image, uri: bool = False) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    text = base64.b64encode(buffer.getvalue()).decode()
    return f"data:image/png;base64,{text}" if uri else text


@pytest.fixture(scope="module")
def handler(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("endpoint") / "model")
    return EndpointHandler(str(folder))


@pytest.fixture(scope="module")
def images():
    return [Image.new("RGB", (24, 50), colour) for colour in COLOURS]


def test_text_embeddings(handler):
    out = handler({"inputs": "a man in a red jacket"})
    assert len(out) == 1 and out[0]["text"] == "a man in a red jacket"
    assert len(out[0]["embedding"]) == 16 and len(out[0]["local_embedding"]) == 24
    assert abs(torch.tensor(out[0]["embedding"]).norm() - 1) < 1e-5
    batch = handler({"inputs": {"text": ["a man", "a woman"]}})
    assert [row["text"] for row in batch] == ["a man", "a woman"]
    json.dumps(batch)  # JSON-serialisable


def test_image_embeddings_from_base64_and_pil(handler, images):
    from_b64 = handler({"inputs": {"images": [_b64(images[0]), _b64(images[1], uri=True)]}})
    from_pil = handler({"inputs": images[0]})
    single = handler({"inputs": {"image": _b64(images[0])}})
    assert len(from_b64) == 2 and from_b64[0]["view"] in ("aerial", "ground")
    assert 0.5 <= from_b64[0]["view_score"] <= 1
    torch.testing.assert_close(torch.tensor(from_pil[0]["embedding"]), torch.tensor(from_b64[0]["embedding"]))
    torch.testing.assert_close(torch.tensor(single[0]["embedding"]), torch.tensor(from_b64[0]["embedding"]))


def test_ranking_matches_model_similarity(handler, images):
    texts = ["a man in a red jacket", "a person in black"]
    out = handler(
        {"inputs": {"text": texts, "images": [_b64(i) for i in images]}, "parameters": {"top_k": 2}}
    )
    model, processor = handler.model, handler.processor
    with torch.inference_mode():
        sim = model.similarity(
            model.get_text_features(input_ids=processor(text=texts)["input_ids"]),
            model.get_image_features(pixel_values=processor(images=images)["pixel_values"]),
        )
    for row, result in enumerate(out):
        assert result["text"] == texts[row]
        top = sim[row].topk(2)
        assert [hit["index"] for hit in result["ranking"]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([h["score"] for h in result["ranking"]]), top.values)


def test_bad_requests_are_clear_errors(handler):
    with pytest.raises(ValueError, match="base64"):
        handler({"inputs": {"image": "not base64 !!"}})
    with pytest.raises(ValueError, match="cannot decode"):
        decode_image(base64.b64encode(b"not an image").decode())
    with pytest.raises(ValueError, match="needs 'text'"):
        handler({"inputs": {"other": 1}})
    with pytest.raises(ValueError, match="non-empty"):
        handler({"inputs": {"text": [""]}})
    with pytest.raises(ValueError, match="JSON object"):
        handler(["a list"])
