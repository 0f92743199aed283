"""Pipelines: text-to-person-retrieval (custom, Hub custom code), zero-shot, image feature extraction."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import clean_env, run_python, save_tiny_model, synthetic_gallery
from PIL import Image

from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded.index_build import build_index
from modeling_tagclip.retrieval.pipeline_tagclip import (
    TASK,
    TagClipRetrievalPipeline,
    register_pipeline,
    save_vision_tower,
    save_with_pipeline,
)

QUERY = "a man in a blue hooded sweatshirt with a brown bag"

FRESH = """
import json, sys
from pathlib import Path
import torch
from PIL import Image
from transformers import pipeline
try:
    import modeling_tagclip  # noqa: F401
    raise SystemExit("modeling_tagclip must not be importable here")
except ImportError:
    pass
model_dir, images, index_dir, vision_dir, query = sys.argv[1:6]
try:
    pipeline(model=model_dir)
    raise SystemExit("the custom pipeline loaded without trust_remote_code")
except ValueError as error:
    assert "trust_remote_code" in str(error), error
search = pipeline(model=model_dir, trust_remote_code=True)  # task inferred from custom_pipelines
paths = sorted(str(p) for p in Path(images).rglob("*.png"))
report = {
    "task": search.task,
    "module": type(search).__module__,
    "folder": search(query, gallery=images, top_k=4),
    "index": search(query, gallery=index_dir, top_k=4),
    "pil": search([query, "a woman"], gallery=[Image.open(p) for p in paths], top_k=3),
}
zero_shot = pipeline("zero-shot-image-classification", model=model_dir, trust_remote_code=True)
report["zero_shot"] = zero_shot(Image.open(paths[0]), candidate_labels=["blue hoodie", "red skirt", "backpack"])
features = pipeline("image-feature-extraction", model=vision_dir, trust_remote_code=True)
report["features"] = features(Image.open(paths[0]), pool=True, return_tensors=True).tolist()
report["features_module"] = type(features.model).__module__
print("\\n" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from modeling_tagclip import TagClipModel, TagClipProcessor

    root = tmp_path_factory.mktemp("pipelines")
    model_dir = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    model, processor = (
        TagClipModel.from_pretrained(model_dir).eval(),
        TagClipProcessor.from_pretrained(model_dir),
    )
    index_dir = root / "idx"
    build_index(model, processor, images, index_dir, progress=False)
    vision_dir = save_vision_tower(model, processor, root / "vision")
    return {
        "root": root,
        "model_dir": model_dir,
        "images": images,
        "index": index_dir,
        "vision": vision_dir,
        "model": model,
        "processor": processor,
    }


def _expected(setup, k: int):
    paths = gi.list_images(setup["images"])
    model, processor = setup["model"], setup["processor"]
    with torch.inference_mode():
        image = model.get_image_features(
            pixel_values=processor(images=[Image.open(p) for p in paths])["pixel_values"]
        )
        text = model.get_text_features(input_ids=processor(text=[QUERY])["input_ids"])
        top = model.similarity(text, image)[0].topk(k)
    return [str(paths[i]) for i in top.indices.tolist()], top.values, top.indices.tolist()


def test_saved_config_declares_the_custom_pipeline(setup):
    config = json.loads((setup["model_dir"] / "config.json").read_text())
    assert config["custom_pipelines"][TASK]["impl"] == "pipeline_tagclip.TagClipRetrievalPipeline"
    assert (setup["model_dir"] / "pipeline_tagclip.py").is_file()
    assert (setup["model_dir"] / "gallery_index.py").is_file()
    assert getattr(setup["model"].config, "custom_pipelines", None) is not None  # loaded from disk


@pytest.mark.slow
def test_pipelines_in_a_fresh_process_with_trust_remote_code(setup, tmp_path):
    args = [str(setup[k]) for k in ("model_dir", "images", "index", "vision")] + [QUERY]
    report = json.loads(
        run_python(FRESH, args, tmp_path, clean_env(tmp_path)).stdout.strip().splitlines()[-1]
    )
    assert report["task"] == TASK and report["module"].startswith("transformers_modules.")
    paths, scores, indices = _expected(setup, 4)
    for key in ("folder", "index"):
        assert [h["path"] for h in report[key]] == paths
        torch.testing.assert_close(torch.tensor([h["score"] for h in report[key]]), scores, atol=1e-5, rtol=0)
        assert [h["rank"] for h in report[key]] == [1, 2, 3, 4]
        assert all(h["view"] in ("aerial", "ground") for h in report[key])
    assert len(report["pil"]) == 2 and all(len(hits) == 3 for hits in report["pil"])
    assert [h["index"] for h in report["pil"][0]] == indices[:3]  # same sorted order as the folder
    assert report["pil"][0][0]["path"] is None
    labels = sorted(item["label"] for item in report["zero_shot"])
    assert labels == ["backpack", "blue hoodie", "red skirt"]
    assert abs(sum(item["score"] for item in report["zero_shot"]) - 1) < 1e-5
    with torch.inference_mode():
        pixels = setup["processor"](images=[Image.open(gi.list_images(setup["images"])[0])])["pixel_values"]
        expected = setup["model"].vision_model(pixel_values=pixels).pooler_output
    assert report["features_module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(report["features"]), expected, atol=1e-5, rtol=0)


def test_registered_pipeline_in_process(setup):
    from transformers import pipeline

    register_pipeline()
    register_pipeline()  # idempotent
    search = pipeline(TASK, model=setup["model"], processor=setup["processor"], gallery=str(setup["index"]))
    assert isinstance(search, TagClipRetrievalPipeline)
    hits = search(QUERY, top_k=2)
    paths, _, _ = _expected(setup, 2)
    assert [h["path"] for h in hits] == paths
    local_dir = pipeline(TASK, model=str(setup["model_dir"]), pipeline_class=TagClipRetrievalPipeline)
    assert [h["path"] for h in local_dir(QUERY, gallery=str(setup["images"]), top_k=2)] == paths


def test_retrieval_pipeline_errors(setup, tmp_path):
    from transformers import pipeline

    from modeling_tagclip import TagClipModel

    register_pipeline()
    search = pipeline(TASK, model=setup["model"], processor=setup["processor"])
    with pytest.raises(ValueError, match="no gallery"):
        search(QUERY)
    with pytest.raises(ValueError, match="top_k"):
        search(QUERY, gallery=str(setup["images"]), top_k=0)
    with pytest.raises(FileNotFoundError, match="neither an image"):
        search(QUERY, gallery=str(tmp_path / "missing"))
    torch.manual_seed(5)
    other = pipeline(TASK, model=TagClipModel(setup["model"].config).eval(), processor=setup["processor"])
    with pytest.raises(gi.GalleryIndexError, match="different model"):
        other(QUERY, gallery=str(setup["index"]))


@pytest.fixture
def empty_registry(monkeypatch):
    """transformers' pipeline registry as in a process that never imported the retrieval pipeline."""
    from transformers.pipelines import PIPELINE_REGISTRY

    monkeypatch.delitem(PIPELINE_REGISTRY.supported_tasks, TASK, raising=False)


def test_converted_folder_loads_the_pipeline_without_registration(setup, tmp_path, empty_registry):
    from transformers import pipeline

    from modeling_tagclip.convert.tagclip import save_converted

    save_converted(setup["model"], tmp_path / "converted")
    search = pipeline(TASK, model=str(tmp_path / "converted"), trust_remote_code=True)
    assert search.task == TASK
    assert [h["path"] for h in search(QUERY, gallery=str(setup["images"]), top_k=2)] == _expected(setup, 2)[0]


def test_save_with_pipeline_leaves_no_null_custom_pipelines(tmp_path):
    from fixtures import tiny_model
    from transformers import pipeline

    model, processor = tiny_model()
    save_with_pipeline(model, processor, tmp_path / "with")
    assert not hasattr(model.config, "custom_pipelines")  # was None before: a later plain save wrote null
    model.save_pretrained(tmp_path / "plain")
    assert "custom_pipelines" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    search = pipeline(TASK, model=str(tmp_path / "plain"), processor=processor)  # registered on import
    assert isinstance(search, TagClipRetrievalPipeline)


@pytest.mark.parametrize("top_k", [0, -3, 2.5, "3", True])
def test_pipeline_top_k_must_be_a_positive_integer(setup, top_k):
    from transformers import pipeline

    register_pipeline()
    search = pipeline(TASK, model=setup["model"], processor=setup["processor"])
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        search(QUERY, gallery=str(setup["images"]), top_k=top_k)


def test_pipeline_in_bf16_ranks_like_fp32(setup):
    from transformers import pipeline

    register_pipeline()
    search = pipeline(TASK, model=str(setup["model_dir"]), dtype=torch.bfloat16, trust_remote_code=True)
    assert search.model.dtype == torch.bfloat16
    hits = search(QUERY, gallery=str(setup["images"]), top_k=3)
    paths, scores, _ = _expected(setup, 3)
    torch.testing.assert_close(torch.tensor([h["score"] for h in hits]), scores, atol=3e-2, rtol=0)


def test_pipeline_filters_by_view_inside_the_index(setup):
    """`filters=` reaches GalleryIndex.topk: every hit has the asked view, and the hits are the exact ranking of
    the crops of that view (not an over-fetch of the unfiltered top-k)."""
    from transformers import pipeline

    register_pipeline()
    search = pipeline(TASK, model=setup["model"], processor=setup["processor"], gallery=str(setup["index"]))
    every = search(QUERY, top_k=100)
    assert len(every) > 3
    for view in ("aerial", "ground"):  # the tiny random router may predict one view for every crop
        wanted = [h["path"] for h in every if h["view"] == view][:3]
        hits = search(QUERY, top_k=3, filters={"view": view})
        assert [h["path"] for h in hits] == wanted
        assert all(h["view"] == view for h in hits)
