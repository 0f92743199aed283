"""Tests for the TAG-CLIP processor: caption cleaning, tokenizer ids, image transform, views, save/load."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from modeling_tagclip.models.tagclip.processing_tagclip import (
    DEFAULT_VOCAB_DIR,
    VIEW_LABELS,
    FtfyMissingWarning,
    ImageTooLargeError,
    TagClipProcessor,
    build_image_processor,
    clean_caption,
    load_rgb,
    pre_caption,
    view_label_ids,
)

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])
KNOWN_CAPTION = "a man wearing a black short-sleeved top and blue jeans"
KNOWN_IDS = [49406, 320, 786, 3309, 320, 1449, 3005, 268, 1709, 19820, 1253, 537, 1746, 10157, 49407]
SOT, EOT, MASK = 49406, 49407, 49405


@pytest.fixture(scope="module")
def processor() -> TagClipProcessor:
    return TagClipProcessor.from_defaults(height=384, width=128)


def test_vocab_files_have_tagpr_mask():
    vocab = json.loads((DEFAULT_VOCAB_DIR / "vocab.json").read_text(encoding="utf-8"))
    merges = (DEFAULT_VOCAB_DIR / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 49408 and sorted(vocab.values()) == list(range(49408))
    special = [vocab[t] for t in ("!", "<|mask|>", "<|startoftext|>", "<|endoftext|>")]
    assert special == [0, MASK, SOT, EOT]
    assert "jekyll</w>" not in vocab
    assert merges[0].startswith("#version") and len(merges) == 1 + 48894 - 1
    assert "jeky ll</w>" not in merges


def test_known_answer_ids_and_zero_padding(processor):
    ids = processor(text=KNOWN_CAPTION)["input_ids"]
    assert ids.shape == (1, 77) and ids.dtype == torch.long
    assert ids[0].tolist() == KNOWN_IDS + [0] * (77 - len(KNOWN_IDS))


def test_batch_padding_and_eot_is_argmax(processor):
    out = processor(text=["A woman.", KNOWN_CAPTION + " with a red backpack"])
    ids = out["input_ids"]
    assert ids.shape == (2, 77)
    for row, mask in zip(ids, out["attention_mask"], strict=True):
        n = int(mask.sum())
        assert row[0] == SOT and row[n - 1] == EOT and int(row.argmax()) == n - 1
        assert (row[n:] == 0).all() and (row[:n] != 0).all()


def test_truncation_keeps_sot_and_eot(processor):
    words = " ".join(f"w{i % 10}" for i in range(200))
    ids = processor(text=words)["input_ids"][0]
    assert len(ids) == 77 and ids[0] == SOT and ids[-1] == EOT and (ids != 0).all()
    # reference: [SOT] + bpe[:75] + [EOT]
    bpe = processor.tokenizer(pre_caption(words), add_special_tokens=False)["input_ids"]
    assert ids[1:76].tolist() == bpe[:75]


def test_text_kwargs_overridable(processor):
    out = processor(text=["a man"], padding="longest", return_tensors=None)
    assert out["input_ids"] == [[SOT, 320, 786, EOT]]
    assert processor(text="a man", max_length=3)["input_ids"].tolist() == [[SOT, 320, EOT]]


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("A Man; in (BLACK) jeans.", "a man in black jeans"),
        ('she said "hi!" #tag *x* ~y: z', "she said hi tag x y z"),
        ("  lots \t of\n\n  space  ", "lots of space"),
        ("short-sleeved, top's", "short-sleeved, top's"),
    ],
)
def test_pre_caption(raw, clean):
    assert pre_caption(raw) == clean


def test_pre_caption_truncates_words():
    words = [f"w{i}" for i in range(100)]
    assert pre_caption(" ".join(words)).split(" ") == words[:77]
    assert pre_caption("a b c d", max_words=2) == "a b"


@pytest.mark.parametrize("bad", ["", "   ", "...!!", "\n\t"])
def test_empty_caption_raises(bad, processor):
    with pytest.raises(ValueError, match="empty"):
        pre_caption(bad)
    with pytest.raises(ValueError, match="empty"):
        processor(text=["ok", bad])


def test_views():
    assert VIEW_LABELS == {"aerial": 0, "ground": 1}
    labels = view_label_ids(["aerial", "GROUND", "Aerial", 1, 0])
    assert labels.dtype == torch.long and labels.tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="'satellite'.*aerial"):
        view_label_ids(["aerial", "satellite"])
    with pytest.raises(ValueError, match="2"):
        view_label_ids([2])


def test_processor_views_and_errors(processor):
    images = [Image.new("RGB", (64, 96), (200, 10, 10)), Image.new("RGB", (30, 30))]
    out = processor(images=images, text=["a man", "a woman"], views=["ground", "aerial"])
    assert out["view_labels"].tolist() == [1, 0]
    assert set(out) == {"input_ids", "attention_mask", "pixel_values", "view_labels"}
    with pytest.raises(ValueError, match="views"):
        processor(images=images, views=["ground"])
    with pytest.raises(ValueError, match="unknown view"):
        processor(images=images, views=["ground", "sky"])
    with pytest.raises(ValueError, match="neither"):
        processor()


def test_image_shapes_modes_and_normalisation(processor):
    rgb, grey = (40, 120, 250), 77
    images = [
        Image.new("RGB", (300, 200), rgb),  # PIL size is (width, height)
        Image.new("L", (50, 500), grey),
        Image.new("RGBA", (128, 384), (*rgb, 255)),
    ]
    pixels = processor(images=images)["pixel_values"]
    assert pixels.shape == (3, 3, 384, 128) and pixels.dtype == torch.float32
    colour = (np.array(rgb) / 255 - MEAN) / STD
    expected = [colour, (grey / 255 - MEAN) / STD, colour]
    for img, exp in zip(pixels, expected, strict=True):
        np.testing.assert_allclose(img.numpy(), np.broadcast_to(exp[:, None, None], img.shape), atol=1e-5)


def test_bicubic_resize_matches_pil():
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, size=(90, 70, 3), dtype=np.uint8)
    image = Image.fromarray(array)
    pixels = build_image_processor(height=384, width=128)(image, return_tensors="pt")["pixel_values"][0]
    ref = np.asarray(image.resize((128, 384), Image.Resampling.BICUBIC), dtype=np.float64) / 255
    ref = ((ref - MEAN) / STD).transpose(2, 0, 1)
    np.testing.assert_allclose(pixels.numpy(), ref, atol=1e-5)


def test_save_and_reload_round_trip(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    reloaded = TagClipProcessor.from_pretrained(tmp_path)
    assert reloaded.tokenizer.pad_token_id == 0 and reloaded.tokenizer.mask_token_id == MASK
    images = [Image.new("RGB", (100, 300), (1, 2, 3)), Image.new("L", (20, 20), 200)]
    text = [KNOWN_CAPTION, "a <|mask|> man, jekyll"]
    a = processor(images=images, text=text, views=["aerial", "ground"])
    b = reloaded(images=images, text=text, views=["aerial", "ground"])
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_mask_token_and_jekyll(processor):
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids("<|mask|>") == MASK
    assert tok("a <|mask|> man")["input_ids"] == [SOT, 320, MASK, 786, EOT]
    assert processor.decode([MASK]) == "<|mask|>"
    assert processor.batch_decode([[SOT, 320, 786, EOT, 0, 0]], skip_special_tokens=True) == ["a man"]
    ids = processor(text="jekyll", padding=False)["input_ids"][0].tolist()
    assert ids[0] == SOT and ids[-1] == EOT and len(ids) > 2 and MASK not in ids and 0 not in ids


@pytest.mark.parametrize(
    ("raw", "clean"),
    [  # reference: pre_caption, then ftfy.fix_text, html.unescape twice, whitespace collapse, lowercase
        ("He wore “red” shoes", 'he wore "red" shoes'),  # curly quotes survive as straight ones
        ("a girl’s bag", "a girl's bag"),
        ("a ﬁne ﬂowered dress", "a fine flowered dress"),  # ligatures
        ("ＡＢＣ　ｓｈｉｒｔ", "abc shirt"),  # full-width letters and ideographic space
        ("black &amp; white", "black & white"),  # ';' became a space first: '&amp ' unescapes to '& '
        ("tom&amp;amp;jerry", "tom& amp jerry"),  # ';' -> ' ' splits the double escape before unescaping
        ("a &lt;b&gt; tag", "a < b> tag"),
        ("a\tb", "a b"),
    ],
)
def test_clean_caption_reference_chain(raw, clean):
    assert clean_caption(raw) == clean


@pytest.fixture
def without_ftfy(monkeypatch):
    """The processor module as a Hub folder loads it where ftfy is not installed (its warning not yet given)."""
    from modeling_tagclip.models.tagclip import processing_tagclip

    monkeypatch.setattr(processing_tagclip, "ftfy", None)
    processing_tagclip._warn_without_ftfy.cache_clear()
    yield
    processing_tagclip._warn_without_ftfy.cache_clear()


@pytest.mark.parametrize(
    ("raw", "clean"),
    [  # plain text: the same string as the reference chain
        ("A Man in a RED coat.", "a man in a red coat"),
        ("black &amp; white", "black & white"),
        ("tom&amp;amp;jerry", "tom& amp jerry"),
        ("a &lt;b&gt; tag", "a < b> tag"),
        ("a\tb", "a b"),
        # what ftfy.fix_text would change stays as typed (the warning says so), as in transformers' fallback
        ("He wore \u201cred\u201d shoes", "he wore \u201cred\u201d shoes"),
        ("a \ufb01ne dress", "a \ufb01ne dress"),
        (
            "\uff21\uff22\uff23\u3000\uff53\uff48\uff49\uff52\uff54",
            "\uff41\uff42\uff43 \uff53\uff48\uff49\uff52\uff54",
        ),
        # BasicTokenizer's cleaning: control and format characters dropped, NFC composed
        ("a re\u200bd\x07 coat", "a red coat"),
        ("cafe\u0301 apron", "caf\u00e9 apron"),
    ],
)
def test_without_ftfy_captions_clean_as_transformers_clip_tokenizer(without_ftfy, raw, clean):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FtfyMissingWarning)
        assert clean_caption(raw) == clean


def test_without_ftfy_the_warning_comes_once_and_says_what_differs(without_ftfy, processor):
    with pytest.warns(FtfyMissingWarning, match="ftfy is not installed.*curly quotes, ligatures") as caught:
        ids = processor(text=KNOWN_CAPTION, padding=False)["input_ids"][0].tolist()
    assert len(caught) == 1 and ids == KNOWN_IDS
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        clean_caption("a woman in a red coat")
        processor(text=["a man", "a child"])
    assert [w for w in again if issubclass(w.category, FtfyMissingWarning)] == []


def test_pre_caption_single_tab_is_one_word_as_reference():
    # the reference collapses only runs of 2+ whitespace, so "a\tb" is one word when truncating
    assert pre_caption("a\tb c d", max_words=2) == "a\tb c"


def test_processor_text_uses_reference_cleaning(processor):
    ids = processor(text="He wore “red” shoes")["input_ids"][0]
    expected = processor.tokenizer('he wore "red" shoes', padding="max_length", max_length=77)["input_ids"]
    assert ids.tolist() == expected
    assert (
        processor(text="a ﬁne dress")["input_ids"].tolist()
        == processor(text="a fine dress")["input_ids"].tolist()
    )


def _pixel(processor, image):
    return processor(images=image)["pixel_values"][0, :, 0, 0].numpy()


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_16_bit_images_are_scaled_not_white(processor, mode):
    value = 40000  # 40000 / 257 = 155.6 -> 156
    expected = (156 / 255 - MEAN) / STD
    np.testing.assert_allclose(_pixel(processor, Image.new(mode, (8, 8), value)), expected, atol=1e-5)


def test_float_image_scaled_from_unit_range(processor):
    expected = (128 / 255 - MEAN) / STD  # 0.5 * 255 + 0.5 -> 128
    np.testing.assert_allclose(_pixel(processor, Image.new("F", (8, 8), 0.5)), expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"mode F.*\[0.0, 1.0\]"):
        processor(images=Image.new("F", (8, 8), 300.0))
    with pytest.raises(ValueError, match="NaN or inf"):
        processor(images=Image.new("F", (8, 8), float("nan")))


def test_alpha_and_palette_composite_on_white(processor):
    white = (1 - MEAN) / STD
    transparent_black = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    np.testing.assert_allclose(_pixel(processor, transparent_black), white, atol=1e-5)
    half = Image.new("LA", (8, 8), (0, 128))  # black at alpha 128/255 over white -> 127
    np.testing.assert_allclose(_pixel(processor, half), (127 / 255 - MEAN) / STD, atol=1e-5)
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    np.testing.assert_allclose(
        _pixel(processor, palette), (np.array([10, 200, 30]) / 255 - MEAN) / STD, atol=1e-5
    )
    palette.info["transparency"] = 1
    np.testing.assert_allclose(_pixel(processor, palette), white, atol=1e-5)


def test_nan_array_and_oversized_image_rejected(processor, monkeypatch):
    with pytest.raises(ValueError, match="image 1 contains NaN"):
        processor(images=[np.zeros((8, 8, 3), np.float32), np.full((8, 8, 3), np.inf, np.float32)])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageTooLargeError, match="11x10 = 110 pixels exceeds the limit of 100"):
        processor(images=Image.new("RGB", (11, 10)))
    assert ImageTooLargeError.status == 413 and issubclass(ImageTooLargeError, ValueError)


def test_load_rgb_refuses_decompression_bomb_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    Image.new("1", (20000, 20000)).save(path)  # 400 Mpx, a few KB on disk
    assert path.stat().st_size < 200_000
    with pytest.raises(ImageTooLargeError, match=r"bomb.png.*400000000 pixels"):  # Pillow's bomb check, named
        load_rgb(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # Pillow's check off: ours still applies
    with pytest.raises(ImageTooLargeError, match="20000x20000 = 400000000 pixels exceeds the limit of 10"):
        load_rgb(path, max_pixels=10)
    with Image.open(path) as lazy:  # opened, not decoded: our limit applies before any pixel is read
        with pytest.raises(
            ImageTooLargeError, match="20000x20000 = 400000000 pixels exceeds the limit of 10"
        ):
            load_rgb(lazy, max_pixels=10)
    with pytest.raises(ValueError, match="cannot decode image"):
        load_rgb(io.BytesIO(b"not an image"))
