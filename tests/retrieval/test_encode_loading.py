"""The one encoding helper (retrieval/encode.py) and the one model loader (retrieval/loading.py)."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import save_tiny_model, tiny_model, tiny_visa_config
from PIL import Image

from modeling_tagclip.retrieval import encode as enc
from modeling_tagclip.retrieval.loading import ModelLoadError, load_model, load_visa

TEXTS = ["a man in a blue coat", "a woman with a red bag", "a person in a green hoodie"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for i in range(7):
        path = folder / f"{i}.png"
        Image.new("RGB", (16, 32), (30 * i, 255 - 30 * i, 90)).save(path)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ encoding


def test_encode_images_matches_the_model_and_is_normalised(images):
    model, processor = tiny_model()
    out = enc.encode_images(model, processor, images, batch_size=3)
    with torch.inference_mode():
        direct = model.get_image_features(**processor(images=[Image.open(p).convert("RGB") for p in images]))
    assert set(out) == {"global", "local", "view_probs"}
    torch.testing.assert_close(
        out["global"], torch.nn.functional.normalize(direct.pooler_output), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        out["local"], torch.nn.functional.normalize(direct.local_embeds), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out["global"].norm(dim=1), torch.ones(len(images)))
    torch.testing.assert_close(out["view_probs"].sum(1), torch.ones(len(images)))


@pytest.mark.slow
def test_workers_and_shards_give_the_same_rows(images):
    model, processor = tiny_model()
    full = enc.encode_images(model, processor, images, batch_size=2)
    workers = enc.encode_images(model, processor, images, batch_size=2, num_workers=2)
    shards = [enc.encode_images(model, processor, images, batch_size=2, shard=(r, 3)) for r in range(3)]
    for key in full:
        torch.testing.assert_close(workers[key], full[key], atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([s[key] for s in shards]), full[key], atol=1e-6, rtol=0)
    assert [len(enc.shard_range(7, (r, 3))) for r in range(3)] == [2, 2, 3]


def test_texts_and_eq14_scores_equal_model_similarity(images):
    model, processor = tiny_model()
    text = enc.encode_texts(model, processor, TEXTS, batch_size=2)
    image = enc.encode_images(model, processor, images)
    with torch.inference_mode():
        t = model.get_text_features(input_ids=processor(text=TEXTS)["input_ids"])
        i = model.get_image_features(**processor(images=[Image.open(p).convert("RGB") for p in images]))
        expected = model.similarity(t, i)
    torch.testing.assert_close(enc.embedding_scores(text, image), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(enc.embedding_scores(text, image, 2, 5), expected[:, 2:5], atol=1e-5, rtol=0)


def test_model_similarity_accepts_plain_tensors(images):
    model, processor = tiny_model()
    with torch.inference_mode():
        t = model.get_text_features(input_ids=processor(text=TEXTS)["input_ids"])
        i = model.get_image_features(**processor(images=[Image.open(p).convert("RGB") for p in images]))
        from_outputs = model.similarity(t, i)
        from_tensors = model.similarity(t.pooler_output, i.pooler_output, t.local_embeds, i.local_embeds)
        global_only = model.similarity(t.pooler_output, i.pooler_output)
    torch.testing.assert_close(from_tensors, from_outputs)
    expected = (
        torch.nn.functional.normalize(t.pooler_output, dim=-1)
        @ torch.nn.functional.normalize(i.pooler_output, dim=-1).t()
    )
    torch.testing.assert_close(global_only, expected)


def test_bf16_autocast_runs_and_stays_close(images):
    model, processor = tiny_model()
    fp32 = enc.encode_images(model, processor, images)
    bf16 = enc.encode_images(model, processor, images, dtype="bf16")
    assert bf16["global"].dtype == torch.float32  # embeddings come back in fp32
    cosine = (fp32["global"] * bf16["global"]).sum(1)
    assert float(cosine.min()) > 0.99
    with pytest.raises(ValueError, match="dtype must be one of"):
        enc.encode_images(model, processor, images, dtype="int8")


def test_encoding_errors_name_the_problem(tmp_path, images):
    model, processor = tiny_model()
    with pytest.raises(ValueError, match="no images"):
        enc.encode_images(model, processor, [])
    with pytest.raises(ValueError, match="2 views for 7 images"):
        enc.encode_images(model, processor, images, views=[0, 1])
    with pytest.raises(ValueError, match="missing.png"):
        enc.encode_images(model, processor, [*images, tmp_path / "missing.png"])
    with pytest.raises(ValueError, match="no query text"):
        enc.encode_texts(model, processor, [])
    with pytest.raises(ValueError, match="shard must be"):
        enc.shard_range(4, (2, 2))


# ------------------------------------------------------------------------------------------------ loading


def test_loads_this_packages_classes_without_remote_code(model_dir):
    model, processor = load_model(model_dir)
    assert type(model).__module__ == "modeling_tagclip.models.tagclip.modeling_tagclip"
    assert type(processor).__module__ == "modeling_tagclip.models.tagclip.processing_tagclip"
    assert not model.training


def test_missing_folder_is_reported_as_missing(tmp_path):
    with pytest.raises(ModelLoadError, match="model folder .*nope does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="model folder outputs/run/best does not exist"):
        load_model("outputs/run/best")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model(tmp_path)
    for name in ("run 1", "my_run!"):  # neither a folder here nor a valid Hub repo id
        with pytest.raises(ModelLoadError, match=f"model folder {name} does not exist") as info:
            load_model(name)
        assert "Repo id must" not in str(info.value)


def test_foreign_model_type_needs_explicit_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery-net", "auto_map": {}}))
    with pytest.raises(ModelLoadError, match="'mystery-net' model.*trust_remote_code=True"):
        load_model(tmp_path)


def test_family_mismatch_is_refused(model_dir):
    with pytest.raises(ModelLoadError, match="is a tagclip model .*needs a visa model"):
        load_visa(model_dir)
    with pytest.raises(ValueError, match="family must be one of"):
        load_model(model_dir, family="clip")


def test_visa_folder_loads_as_the_embedding_model(tmp_path):
    from modeling_tagclip import ViSAForReID, ViSAModel

    ViSAForReID(tiny_visa_config()).save_pretrained(tmp_path)
    model = load_visa(tmp_path)
    assert type(model) is ViSAModel and not model.training
    with pytest.raises(ModelLoadError, match="is a visa model"):
        load_model(tmp_path, family="tagclip")


def test_dtype_loads_weights_in_that_precision(model_dir):
    model, _ = load_model(model_dir, dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(model_dir, dtype="int4")


def test_foreign_model_loads_only_with_the_explicit_opt_in(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(
        BertConfig(
            hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=20
        )
    ).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="'bert' model"):
        load_model(tmp_path)
    model, _ = load_model(tmp_path, trust_remote_code=True)
    assert type(model).__name__ == "BertModel" and not model.training


@pytest.mark.slow
def test_reid_encoding_with_workers_equals_one_batch(images):
    from modeling_tagclip import ViSAModel
    from modeling_tagclip.data.reid import ReIDTransform
    from modeling_tagclip.evaluation.reid import encode

    torch.manual_seed(0)
    model = ViSAModel(tiny_visa_config()).eval()
    table = {"image_path": [str(p) for p in images], "view": [0, 1, 0, 1, 1, 0, 1]}
    serial = encode(model, table, batch_size=3)
    workers = encode(model, table, batch_size=3, num_workers=2)
    transform = ReIDTransform(model.config.image_size)
    with torch.no_grad():
        pixels = torch.stack([transform(Image.open(p)) for p in images])
        direct = model(pixel_values=pixels, view_labels=torch.tensor(table["view"])).pooler_output
    torch.testing.assert_close(workers, serial, atol=0, rtol=0)
    torch.testing.assert_close(serial, direct, atol=1e-5, rtol=1e-5)
