"""Every "next:" hint a training run prints is a command that works, and a LoRA run's model is found from the run
folder, its ``best/`` or its ``best/adapter`` by every verb that loads a model."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import torch
from fixtures import make_visa_model, synthetic_gallery, tiny_model

from modeling_tagclip.cli import main
from modeling_tagclip.engine.cli import next_steps
from modeling_tagclip.engine.config import load_config
from modeling_tagclip.hub.run_files import model_folder
from modeling_tagclip.retrieval.loading import load_model, model_dir


def _features(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and text embeddings of two fixed crops and captions."""
    from PIL import Image

    _, processor = tiny_model()
    images = [Image.new("RGB", (16, 32), (200, 30, 30)), Image.new("RGB", (16, 32), (20, 60, 200))]
    inputs = processor(text=["a man in a red coat", "a woman with a blue bag"], images=images)
    with torch.inference_mode():
        return (
            model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output,
            model.get_text_features(input_ids=inputs["input_ids"]).pooler_output,
        )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A LoRA run folder as training writes it (``base/``, ``best/adapter`` naming ``../../base``, the run's
    training ``config.json``) and the merged model its adapter gives."""
    from modeling_tagclip.engine.tasks.tagclip import apply_lora

    run = tmp_path_factory.mktemp("runs") / "lora"
    model, processor = tiny_model()
    adapted = apply_lora(model, load_config(None), run / "base", "../../base")
    processor.save_pretrained(run / "base")
    torch.manual_seed(1)
    for name, param in adapted.named_parameters():
        if "lora_B" in name:  # a trained adapter: it changes the outputs
            param.data.normal_(0, 0.5)
    adapted.save_pretrained(run / "best" / "adapter")
    processor.save_pretrained(run / "best" / "adapter")
    (run / "config.json").write_text(json.dumps({"task": "retrieval", "lora": {"enabled": True}}))
    return run, copy.deepcopy(adapted).merge_and_unload().eval()


@pytest.mark.parametrize("spelling", ["", "best", "best/adapter"])
def test_a_lora_run_loads_from_the_run_its_best_or_its_adapter(lora_run, spelling):
    run, merged = lora_run
    path = run / spelling if spelling else run
    assert model_dir(path) == str(run / "best" / "adapter")
    model, processor = load_model(path)
    assert processor is not None
    for got, expected in zip(_features(model), _features(merged), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    base, _ = load_model(run / "base")
    assert not torch.allclose(_features(base)[0], _features(merged)[0], atol=1e-3)  # the adapter is applied


def test_push_finds_a_lora_runs_best_folder(lora_run):
    run, _ = lora_run
    assert model_folder(run) == run / "best" and model_folder(run / "best") == run / "best"


def test_a_model_folder_or_a_hub_id_is_taken_as_given(lora_run, tmp_path):
    run, _ = lora_run
    assert model_dir(run / "base") == str(run / "base")
    assert model_dir("ORG/NAME") == "ORG/NAME" and model_dir(tmp_path) == str(tmp_path)


def _run_hints(text: str, cwd: Path, monkeypatch) -> list[str]:
    """Run every ``tagclip ...`` line of a hint in ``cwd``; the commands run."""
    monkeypatch.chdir(cwd)
    commands = [
        line.strip() for line in text.splitlines() if line.strip().startswith(("tagclip ", "next: tagclip "))
    ]
    for command in commands:
        argv = shlex.split(command.removeprefix("next: "))
        assert main(argv[1:]) == 0, command
    return commands


@pytest.mark.slow
def test_the_retrieval_runs_hints_work_on_a_lora_run(lora_run, tmp_path, monkeypatch):
    run, _ = lora_run
    data = synthetic_gallery(tmp_path / "data")
    cfg = load_config(None, {"output_dir": str(run), "data_dir": str(data)})
    commands = _run_hints(next_steps(cfg), tmp_path, monkeypatch)
    assert [c.split()[1] for c in commands] == ["index", "search"]
    assert (tmp_path / "gallery-index" / "index.json").is_file()


@pytest.mark.slow
def test_the_reid_runs_hint_works(tmp_path, monkeypatch):
    from modeling_tagclip.data.synthetic_reid import generate_reid_dataset
    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID

    run = tmp_path / "visa"
    make_visa_model(cls=ViSAForReID).save_pretrained(run / "best")
    data = tmp_path / "reid"
    generate_reid_dataset(data, num_identities=4, image_size=(32, 16), progress=False)
    cfg = load_config(None, {"output_dir": str(run), "data_dir": str(data)}, task="reid")
    assert _run_hints(next_steps(cfg), tmp_path, monkeypatch)[0].startswith("next: tagclip eval --task reid")
    assert (tmp_path / "grid.png").is_file()
