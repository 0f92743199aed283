"""Fine-tuning from a converted CLIP whose image size differs from the recipe's (the path users with real data
take): plain, LoRA and merged LoRA train, evaluate, index, search and load in a fresh process at the recipe size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures import CLIP_SIZE, FRESH_REMOTE_MODEL, clean_env, run_python, run_train
from fixtures import saved_size as _saved_size

RECIPE_SIZE = [64, 32]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from modeling_tagclip.data.synthetic import generate_dataset

    out = tmp_path_factory.mktemp("synthetic")
    generate_dataset(out, num_identities=16, seed=0, image_size=tuple(RECIPE_SIZE), progress=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora", [[], ["--lora"], ["--lora", "--merge_lora"]], ids=["plain", "lora", "merged"]
)
def test_converted_clip_of_another_size_trains_and_serves_at_the_recipe_size(
    tmp_path, data_dir, clip_init, lora
):
    from modeling_tagclip.evaluation.text_retrieval import (
        load_eval_dataset,
        load_model,
        run_retrieval,
        summarize,
    )
    from modeling_tagclip.retrieval import cli

    cfg = {
        "data_dir": str(data_dir),
        "init_from": str(clip_init),
        "max_steps": 2,
        "validation_fraction": 0,
        "lora": {"r": 4, "alpha": 8},
    }
    output = run_train(tmp_path, "run", cfg, *lora)
    out = tmp_path / "run"
    assert (
        f"is {CLIP_SIZE}x{CLIP_SIZE}; position embeddings re-gridded to the recipe's image_size 64x32"
        in output
    )
    assert "test R@1" in output  # the final evaluation ran on best/
    model_dir = out / "best" / "adapter" if lora == ["--lora"] else out / "best"
    if lora:
        assert _saved_size(out / "base") == RECIPE_SIZE  # the adapter's base is the re-gridded init
        adapter = json.loads((out / "best" / "adapter" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == "../../base"
    if lora != ["--lora"]:
        assert _saved_size(out / "best") == RECIPE_SIZE

    model, processor = load_model(model_dir)  # evaluation, as `evaluate --model` loads it
    assert list(model.config.vision_config.image_hw) == RECIPE_SIZE
    result = summarize(run_retrieval(model, processor, load_eval_dataset(data_dir), batch_size=64))
    saved = json.loads((out / "eval_results.json").read_text())
    assert result["R@1"] == pytest.approx(saved["R@1"]) and result["mAP"] == pytest.approx(saved["mAP"])

    index = tmp_path / "gallery.idx"  # `tagclip index` + `tagclip search` on the trained model
    images = data_dir / "images" / "test"
    assert (
        cli.main(
            [
                "index",
                "--model",
                str(model_dir),
                "--images",
                str(images),
                "--out",
                str(index),
                "--workers",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    assert cli.main(["search", "--index", str(index), "-k", "3", "--json", "a man in a red coat"]) == 0

    if lora == ["--lora"]:
        return
    from transformers import pipeline

    retriever = pipeline("text-to-person-retrieval", model=str(out / "best"), trust_remote_code=True)
    hits = retriever("a man in a red coat", gallery=str(images), top_k=3)  # encodes the crops at 64x32
    assert len(hits) == 3 and all(Path(h["path"]).suffix == ".png" for h in hits)
    code = FRESH_REMOTE_MODEL + (
        "import torch\n"
        "assert list(model.config.vision_config.image_size) == [64, 32], model.config.vision_config.image_size\n"
        "with torch.no_grad():\n"
        "    out = model.get_image_features(pixel_values=torch.zeros(2, 3, 64, 32))\n"
        "print(tuple(out.pooler_output.shape))\n"
    )
    fresh = run_python(code, [str(out / "best")], tmp_path, clean_env(tmp_path))
    assert fresh.stdout.strip().splitlines()[-1] == "(2, 32)"


@pytest.mark.slow
def test_pretraining_phase_makes_a_clip_init_on_the_training_rows_and_a_resume_reuses_it(tmp_path, data_dir):
    from transformers import CLIPModel

    from modeling_tagclip import TagClipModel

    cfg = {
        "data_dir": str(data_dir),
        "max_steps": 4,
        "save_steps": 2,
        "validation_fraction": 0.25,
        "pretrain_clip": {"epochs": 2, "batch_size": 8, "logit_scale_init_value": 3.0},
        "freeze_patch_embedding": True,
    }
    output = run_train(tmp_path, "run", cfg, "--stop_after_steps", "2")
    init = tmp_path / "run" / "clip-init"
    assert "pre-training a CLIP of this size on the training split for 2 epochs" in output
    assert "pre-training CLIP: epoch 2/2 done, mean loss " in output  # a line per epoch
    settings = json.loads((init / "pretraining.json").read_text())
    assert (settings["epochs"], settings["batch_size"], settings["learning_rate"]) == (2, 8, 1.0e-3)
    assert settings["logit_scale_init_value"] == 3.0
    made = (init / "tagclip-init" / "model.safetensors").stat().st_mtime_ns

    output = run_train(tmp_path, "run", cfg, "--resume_from_checkpoint", "latest")
    assert (init / "tagclip-init" / "model.safetensors").stat().st_mtime_ns == made  # reused, not remade
    assert "reusing the pre-trained CLIP init" in output and "pre-training a CLIP" not in output
    saved = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    all_train = len(json.loads((data_dir / "train_reid.json").read_text()))
    assert settings["train_images"] == saved["train_images"] < all_train  # validation identities left out
    clip = CLIPModel.from_pretrained(init / "clip-hf")
    best = TagClipModel.from_pretrained(tmp_path / "run" / "best")
    patch = best.vision_model.embeddings.patch_embedding.weight
    assert torch.equal(patch, clip.vision_model.embeddings.patch_embedding.weight)  # frozen, from the init
    # the CLIP starts at the recipe's scale (8 AdamW steps at 1e-3 move it < 0.02); the conversion copies it
    assert float(clip.logit_scale) == pytest.approx(3.0, abs=0.02)
    init_model = TagClipModel.from_pretrained(init / "tagclip-init")
    assert float(init_model.logit_scale) == float(clip.logit_scale)

    cfg["init_from"] = str(init / "tagclip-init")  # an explicit init: no pre-training phase
    output = run_train(tmp_path, "plain", cfg)
    assert "no pre-training phase (pretrain_clip is for runs from scratch)" in output
    assert not (tmp_path / "plain" / "clip-init").exists()
