"""Bad input at the processor, the model calls and ``from_pretrained``: each case asserts the error type and that the message names the problem
(the suite's shared part is ``bad_input.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from bad_input import (
    Context,
    case_id,
    check,
    check_table,
    corrupt_model,
    label_routed_model,
    raw_pixels,
    replaced,
    tampered,
    tiny_visa,
    token_ids,
)
from fixtures import tiny_pixels
from PIL import Image

from modeling_tagclip import TagClipModel
from modeling_tagclip.models.tagclip.processing_tagclip import ImageTooLargeError


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, Any]:
    return Context(tmp_path_factory.mktemp("bad_input"))


CASES: list[Any] = [
    # ---- processor
    ("processor", lambda c: c["processor"](), ValueError, "needs `images` and/or `text`"),
    ("processor", lambda c: c["processor"](text=[]), ValueError, "`text` is an empty list"),
    (
        "processor",
        lambda c: c["processor"](text=123),
        TypeError,
        "`text` must be a str or a list of str, got int",
    ),
    ("processor", lambda c: c["processor"](text=["ok", 5]), TypeError, "caption must be a str, got int"),
    ("processor", lambda c: c["processor"](text="...!! ;;"), ValueError, "caption is empty after cleaning"),
    (
        "processor",
        lambda c: c["processor"](text={"a": 1}),
        TypeError,
        "must be a str or a list of str, got dict",
    ),
    (
        "processor",
        lambda c: c["processor"](text="a man", views=["aerial"]),
        ValueError,
        "no `images` were given",
    ),
    (
        "processor",
        lambda c: c["processor"](images=[Image.new("RGB", (8, 8))] * 2, views=["aerial"]),
        ValueError,
        "got 1 views for 2 images",
    ),
    (
        "processor",
        lambda c: c["processor"](images=Image.new("RGB", (8, 8)), views=["sky"]),
        ValueError,
        "unknown view 'sky'",
    ),
    (
        "processor",
        lambda c: c["processor"](images=Image.new("RGB", (8, 8)), views=[2]),
        ValueError,
        "unknown view 2",
    ),
    ("processor", lambda c: c["processor"](images=[]), ValueError, "`images` is an empty list"),
    ("processor", lambda c: c["processor"](images=[object()]), TypeError, "image 0 must be a PIL image"),
    (
        "processor",
        lambda c: c["processor"](
            images=[np.zeros((8, 8, 3), np.float32), np.full((8, 8, 3), np.nan, np.float32)]
        ),
        ValueError,
        "image 1 contains NaN or inf",
    ),
    (
        "processor",
        lambda c: c["processor"](images=Image.new("F", (8, 8), 7.5)),
        ValueError,
        r"mode F\) values must lie in \[0.0, 1.0\]",
    ),
    (
        "processor",
        lambda c: c["processor"](images=Image.new("F", (8, 8), float("inf"))),
        ValueError,
        "mode F\\) contains NaN or inf",
    ),
    (
        "processor",
        lambda c: c["processor"](images=Image.new("I", (8, 8), -5)),
        ValueError,
        r"mode I\) values must lie in \[0, 65535\]",
    ),
    (
        "processor",
        lambda c: c["processor"](images=Image.new("RGB", (0, 4))),
        ValueError,
        r"image has no pixels \(0x4\)",
    ),
    (
        "processor",
        lambda c: c["processor"](images=str(c["root"] / "missing.png")),
        ValueError,
        "cannot decode image '.*missing.png'",
    ),
    (
        "processor",
        lambda c: c["processor"](images=str(c["root"] / "not_an_image.png")),
        ValueError,
        "cannot decode image '.*not_an_image.png'",
    ),
    (
        "processor",
        lambda c: c["processor"](images=str(c["bomb"])),
        ImageTooLargeError,
        "bomb.png.*400000000 pixels",
    ),
    # ---- model calls
    (
        "model",
        lambda c: c["model"].get_image_features(pixel_values=torch.zeros(3, 32, 16)),
        ValueError,
        r"pixel_values must have shape \(batch, 3, 32, 16\)",
    ),
    (
        "model",
        lambda c: c["model"].get_image_features(pixel_values=torch.zeros(1, 3, 64, 64)),
        ValueError,
        "got \\(1, 3, 64, 64\\)",
    ),
    (
        "model",
        lambda c: c["model"].get_image_features(
            pixel_values=torch.zeros(2, 3, 32, 16).index_fill_(0, torch.tensor([1]), float("nan"))
        ),
        ValueError,
        r"pixel_values contain NaN or inf values \(images \[1\]",
    ),
    (
        "model",
        lambda c: c["model"].get_image_features(pixel_values=torch.full((1, 3, 32, 16), float("inf"))),
        ValueError,
        "NaN or inf",
    ),
    (
        "model",
        lambda c: c["model"].get_image_features(pixel_values=raw_pixels()),
        ValueError,
        "pixel_values are uint8, not floating point.*Run the image processor first",
    ),
    (
        "model",
        lambda c: c["model"](input_ids=token_ids(49406, 320, 49407), pixel_values=raw_pixels(1)),
        ValueError,
        "pixel_values are uint8.*image processor",
    ),
    (
        "model",
        lambda c: tiny_visa()(pixel_values=raw_pixels(2), view_labels=torch.tensor([0, 1])),
        ValueError,
        "pixel_values are uint8.*image processor",
    ),
    (
        "model",
        lambda c: tiny_visa()(pixel_values=torch.zeros(2, 3, 64, 32), view_labels=torch.tensor([0, 1])),
        ValueError,
        r"pixel_values must have shape \(batch, 3, 32, 16\).*got \(2, 3, 64, 32\)",
    ),
    (
        "model",
        lambda c: tiny_visa()(pixel_values=torch.zeros(3, 32, 16), view_labels=torch.tensor([0, 1])),
        ValueError,
        r"pixel_values must have shape \(batch, 3, 32, 16\).*got \(3, 32, 16\)",  # not a view_labels count
    ),
    (
        "model",
        lambda c: label_routed_model().get_image_features(tiny_pixels(2), view_labels=torch.tensor([3, 0])),
        ValueError,
        r"view_labels must be 0 \(aerial\) or 1 \(ground\), got \[0, 3\]",
    ),
    (
        "model",
        lambda c: label_routed_model()(
            input_ids=token_ids(49406, 320, 49407),
            pixel_values=tiny_pixels(1),
            view_labels=torch.tensor([-1]),
        ),
        ValueError,
        r"view_labels must be 0 \(aerial\) or 1 \(ground\), got \[-1\]",
    ),
    (
        "model",
        lambda c: label_routed_model().get_image_features(
            tiny_pixels(2), view_labels=torch.tensor([0, 1, 1])
        ),
        ValueError,
        "view_labels has 3 entries for a batch of 2 images",
    ),
    (
        "model",
        lambda c: c["model"].get_text_features(input_ids=token_ids(49406, 60000, 49407)),
        ValueError,
        r"token ids in \[0, 49408\)",
    ),
    (
        "model",
        lambda c: c["model"].get_text_features(input_ids=token_ids(49406, -5, 49407)),
        ValueError,
        r"token ids in \[0, 49408\)",
    ),
    (
        "model",
        lambda c: c["model"].get_text_features(input_ids=torch.tensor([[49406.0, 49407.0]])),
        ValueError,
        "must be integer token ids",
    ),
    (
        "model",
        lambda c: c["model"].get_text_features(input_ids=token_ids(49406, 320, 786)),
        ValueError,
        "needs an EOS token",
    ),
    (
        "model",
        lambda c: c["model"].get_text_features(input_ids=torch.tensor([49406, 49407])),
        ValueError,
        r"input_ids must have shape \(batch, seq_len\)",
    ),
    # ---- from_pretrained
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained("outputs/typo/best"),
        FileNotFoundError,
        "no model folder at outputs/typo/best",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(c["model_dir"] / "config.json"),
        FileNotFoundError,
        "no model folder at .*config.json",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(
            tampered(c, "drop", lambda s: {k: v for k, v in s.items() if k != "text_projection.weight"})
        ),
        ValueError,
        r"missing keys \['text_projection.weight'\]",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(
            tampered(c, "extra", lambda s: {**s, "surprise.weight": torch.zeros(1)})
        ),
        ValueError,
        r"unexpected keys \['surprise.weight'\]",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(
            tampered(c, "int64", lambda s: replaced(s, "visual_projection.weight", lambda v: v.long()))
        ),
        ValueError,
        "'visual_projection.weight' is stored as I64, not floating point",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(
            tampered(c, "nan", lambda s: replaced(s, "text_projection.weight", lambda v: v * float("nan")))
        ),
        ValueError,
        r"NaN or inf values in \['text_projection.weight'\]",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(
            tampered(
                c,
                "layers",
                edit_config=lambda g: {**g, "text_config": {**g["text_config"], "num_hidden_layers": 3}},
            )
        ),
        ValueError,
        r"missing keys \['text_model.encoder.layers.2.",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(
            tampered(c, "typo", edit_config=lambda g: {**g, "logit_scale_init_valu": 2.0})
        ),
        ValueError,
        "unknown config key 'logit_scale_init_valu' .did you mean 'logit_scale_init_value'",
    ),
    (
        "from_pretrained",
        lambda c: TagClipModel.from_pretrained(corrupt_model(c)),
        ValueError,
        "corrupt checkpoint",
    ),
]


@pytest.mark.parametrize(("entry", "call", "error", "message"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_a_clear_error(ctx, capsys, entry, call, error, message):
    check(ctx, capsys, entry, call, error, message)


def test_the_table_covers_its_entry_points():
    check_table(CASES, {"model", "from_pretrained", "processor"}, 46)
