"""Inference Endpoints handler: text/image embeddings and ranking, as the Hub's toolkit calls it.

The handler running from a pulled Hub repository without this package is checked in test_hub.py.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from fixtures import save_tiny_model
from PIL import Image

from handler import EndpointHandler, Limits, PayloadTooLargeError, RequestError, decode_image

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
    assert len(from_b64) == 2 and from_b64[0]["predicted_view"] in ("aerial", "ground")
    assert 0.5 <= from_b64[0]["predicted_view_score"] <= 1
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
    with pytest.raises(ValueError, match="needs 'text'.*unknown keys \\['other'\\]"):
        handler({"inputs": {"other": 1}})
    with pytest.raises(ValueError, match="non-empty"):
        handler({"inputs": {"text": [""]}})
    with pytest.raises(ValueError, match="JSON object"):
        handler(["a list"])


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("top_k", [0, -3, 2.5, "3", True])
def test_bad_top_k_is_a_400(handler, images, top_k):
    request = {
        "inputs": {"text": "a man", "images": [_b64(i) for i in images]},
        "parameters": {"top_k": top_k},
    }
    with pytest.raises(RequestError, match="'top_k' must be a positive integer") as info:
        handler(request)
    assert info.value.status == 400


def test_top_k_over_gallery_returns_all(handler, images):
    out = handler(
        {"inputs": {"text": "a man", "images": [_b64(i) for i in images]}, "parameters": {"top_k": 99}}
    )
    assert sorted(hit["index"] for hit in out[0]["ranking"]) == [0, 1, 2]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [([5], "'parameters' must be an object, got list"), ({"topk": 3}, r"unknown parameters \['topk'\]")],
)
def test_bad_parameters(handler, parameters, message):
    with pytest.raises(RequestError, match=message):
        handler({"inputs": {"text": "a man"}, "parameters": parameters})


def test_limits_give_413(tmp_path_factory, images):
    small = EndpointHandler(
        str(save_tiny_model(tmp_path_factory.mktemp("limits") / "m")),
        limits=Limits(max_images=2, max_texts=2, max_pixels=1000, max_image_bytes=10_000, max_text_chars=20),
    )
    cases = [
        ({"images": [_b64(i) for i in images]}, "3 images in one request; the limit is 2"),
        ({"text": ["a", "b", "c"]}, "3 texts in one request; the limit is 2"),
        ({"image": _b64(Image.new("RGB", (50, 50)))}, "2500 pixels exceeds the limit of 1000"),
        ({"image": "A" * 20_000}, "over 10000 bytes"),
        ({"text": "a man " * 10}, "60 characters; the limit is 20"),
    ]
    for inputs, message in cases:
        with pytest.raises(PayloadTooLargeError, match=message) as info:
            small({"inputs": inputs})
        assert info.value.status == 413


def test_decompression_bomb_is_a_413_not_a_crash():
    bomb = _png(Image.new("1", (20000, 20000)))  # 400 Mpx in a few KB
    assert len(bomb) < 200_000
    with pytest.raises(PayloadTooLargeError, match="400000000 pixels"):
        decode_image(base64.b64encode(bomb).decode())


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_16_bit_image_is_not_white(mode):
    image = Image.new(mode, (4, 4), 40000)
    decoded = decode_image(
        _png(image) if mode == "I;16" else image
    )  # a 16-bit PNG, or what a toolkit decoded
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (156, 156, 156)


def test_alpha_is_composited_on_white():
    assert decode_image(_png(Image.new("RGBA", (4, 4), (0, 0, 0, 0)))).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("module_name", ["handler", "modeling_tagclip.retrieval.encode"])
def test_load_rgb_copies_match_processor(module_name):
    """The handler and the Hub-shipped encoder carry the generated copy of the processor's image loading."""
    import importlib
    import inspect

    from modeling_tagclip.models.tagclip import processing_tagclip, serving_common

    module = importlib.import_module(module_name)
    assert processing_tagclip.load_rgb is serving_common.load_rgb
    for name in (
        "ImageTooLargeError",
        "load_rgb",
        "_name",
        "_check_size",
        "_high_depth_to_l",
        "eq14_similarity",
    ):
        assert getattr(module, name) is not getattr(serving_common, name)
        assert inspect.getsource(getattr(module, name)) == inspect.getsource(getattr(serving_common, name))


def test_bf16_serving_close_to_fp32(tmp_path_factory, handler, images):
    low = EndpointHandler(str(save_tiny_model(tmp_path_factory.mktemp("bf16") / "m")), dtype="bf16")
    assert next(low.model.parameters()).dtype == torch.bfloat16
    request = {"inputs": {"text": ["a man"], "images": [_b64(i) for i in images]}}
    full, half = handler(request)[0]["ranking"], low(request)[0]["ranking"]
    torch.testing.assert_close(
        torch.tensor(sorted(h["score"] for h in half)),
        torch.tensor(sorted(h["score"] for h in full)),
        atol=3e-2,
        rtol=0,
    )
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        EndpointHandler(str(save_tiny_model(tmp_path_factory.mktemp("fp8") / "m")), dtype="fp8")


def test_remote_code_trusted_only_for_own_type(tmp_path, monkeypatch):
    from handler import trust_remote_code_for

    monkeypatch.delenv("TAGCLIP_TRUST_REMOTE_CODE", raising=False)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "evil", "auto_map": {"AutoModel": "x.Y"}})
    )
    assert trust_remote_code_for(str(tmp_path)) is False
    assert trust_remote_code_for(str(tmp_path), opt_in=True) is True
    monkeypatch.setenv("TAGCLIP_TRUST_REMOTE_CODE", "1")
    assert trust_remote_code_for(str(tmp_path)) is True
    monkeypatch.delenv("TAGCLIP_TRUST_REMOTE_CODE")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tagclip"}))
    assert trust_remote_code_for(str(tmp_path)) is False  # installed here: the local classes are used
    with pytest.raises(FileNotFoundError, match="no config.json"):
        trust_remote_code_for(str(tmp_path / "sub" if (tmp_path / "sub").mkdir() is None else ""))


def test_limits_from_environment():
    assert Limits.from_env({"TAGCLIP_MAX_IMAGES": "3"}).max_images == 3
    with pytest.raises(ValueError, match="TAGCLIP_MAX_PIXELS must be a positive integer, got '-1'"):
        Limits.from_env({"TAGCLIP_MAX_PIXELS": "-1"})


def test_handler_module_loads_outside_sys_modules():
    """The Hub toolkit imports handler.py from a file without registering it in sys.modules."""
    import importlib.util

    import handler as module

    spec = importlib.util.spec_from_file_location("endpoint_handler_copy", module.__file__)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)  # a dataclass here raised AttributeError on sys.modules lookup
    assert loaded.Limits().max_images == 64
