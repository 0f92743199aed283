"""The real-data recipes end to end on folders in the real datasets' layouts, written here: `tag-pedes.yaml`
from a converted CLIP (another image size), `visa-cargo.yaml` on a CARGO-layout folder. Each trains 2 steps,
evaluates, and pushes its best/ to the fake Hub. Only what a CPU smoke run needs is overridden (steps, batch
size, loader workers, and for ViSA the model size); everything else is the recipe's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub
from fixtures import TINY_VISA_TRAIN as TINY_MODEL
from fixtures import repo_env

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "modeling_tagclip" / "recipes"
SMOKE = [
    "--max_steps",
    "2",
    "--num_workers",
    "0",
    "--persistent_workers",
    "false",
    "--pin_memory",
    "false",
    "--num_threads",
    "1",
    "--plots",
    "false",
]


@pytest.fixture
def hub():
    server = FakeHub().start()
    yield server
    server.stop()


def _run(args: list[str], env: dict[str, str], timeout: int = 1800) -> str:  # a hang guard, not a budget
    proc = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _push(best: Path, repo: str, hub: FakeHub, tmp: Path) -> dict[str, bytes]:
    env = repo_env(tmp, HF_ENDPOINT=hub.url, HF_TOKEN="hf_fake", HF_HUB_DISABLE_XET="1")
    _run(
        [sys.executable, "-m", "modeling_tagclip.cli", "push", "--checkpoint", str(best), "--repo-id", repo],
        env,
    )
    return hub.repos[repo]["files"]


def tag_pedes_folder(root: Path) -> Path:
    """TAG-PEDES layout: ``anno_dir/{train,test}_reid.json`` and ``images/`` (the synthetic set, re-arranged)."""
    from modeling_tagclip.data.synthetic import generate_dataset

    generate_dataset(root / "render", num_identities=24, seed=1, image_size=(64, 32), progress=False)
    (root / "TAG-PEDES" / "anno_dir").mkdir(parents=True)
    for split in ("train", "test"):
        shutil.move(
            root / "render" / f"{split}_reid.json", root / "TAG-PEDES" / "anno_dir" / f"{split}_reid.json"
        )
    shutil.move(root / "render" / "images", root / "TAG-PEDES" / "images")
    return root / "TAG-PEDES"


@pytest.mark.slow
def test_tag_pedes_recipe_from_a_converted_clip_trains_evaluates_and_pushes(tmp_path, clip_init, hub):
    data, out = tag_pedes_folder(tmp_path), tmp_path / "run"
    env = {**repo_env(tmp_path), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    output = _run(
        [
            sys.executable,
            "training/train.py",
            "--config",
            str(RECIPES / "tag-pedes.yaml"),
            "--data_dir",
            str(data / "anno_dir"),
            "--image_dir",
            str(data / "images"),
            "--init_from",
            str(clip_init),
            "--output_dir",
            str(out),
            "--per_device_batch_size",
            "8",
            "--eval_batch_size",
            "16",
            *SMOKE,
        ],
        env,
    )
    assert (
        "position embeddings re-gridded to the recipe's image_size 224x224" in output and "test R@1" in output
    )
    result = json.loads((out / "eval_results.json").read_text())
    assert result["data"] == str(data / "anno_dir") and result["num_gallery"] == result["test_images"] > 0
    assert result["config"]["image_size"] == [224, 224]
    assert result["config"]["model"]["vision_config"]["routing"] == "gumbel"  # the recipe's training routing
    config = json.loads((out / "best" / "config.json").read_text())
    assert (
        config["vision_config"]["image_size"] in (224, [224, 224])
        and config["vision_config"]["routing"] == "argmax"
    )
    files = _push(out / "best", "smoke/tag-pedes", hub, tmp_path)
    assert {"config.json", "model.safetensors", "README.md", "eval_results.json"} <= set(files)
    assert json.loads(files["eval_results.json"])["R@1"] == result["R@1"]


def cargo_folder(root: Path) -> Path:
    """CARGO layout: ``CARGO/{train,query,gallery}/Cam{1..13}/Cam{c}_{day|night}_{pid}_{idx}.jpg``."""
    from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

    generate_reid_dataset(root / "CARGO", num_identities=16, image_size=(32, 16), progress=False)
    (root / "CARGO" / "dataset_info.json").unlink()  # a real CARGO folder has none: found by its layout
    assert sorted(p.name for p in (root / "CARGO").iterdir()) == ["gallery", "query", "train"]
    return root


@pytest.mark.slow
def test_visa_cargo_recipe_trains_evaluates_and_pushes(tmp_path, hub):
    datasets, out = cargo_folder(tmp_path / "datasets"), tmp_path / "run"
    env = {**repo_env(tmp_path), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    output = _run(
        [
            sys.executable,
            "training/train.py",
            "--config",
            str(RECIPES / "visa-cargo.yaml"),
            "--data_dir",
            str(datasets),
            "--output_dir",
            str(out),
            "--model",
            json.dumps(TINY_MODEL),
            "--per_device_batch_size",
            "16",
            "--eval_batch_size",
            "32",
            *SMOKE,
        ],
        env,
    )
    assert "A<->G" in output
    result = json.loads((out / "eval_results.json").read_text())
    assert result["dataset"] == "CARGO" and {"ALL", "A<->G", "G<->G", "A<->A"} <= set(result["protocols"])
    assert result["config"]["optimizer"] == "sgd" and result["config"]["warmup_iters"] == 2000  # the recipe's
    files = _push(out / "best", "smoke/visa-cargo", hub, tmp_path)
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert json.loads(files["config.json"])["model_type"] == "visa"
    assert os.path.isfile(out / "best" / "config.json")
