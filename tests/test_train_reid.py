"""ViSA re-ID training end to end on a tiny synthetic set: beats chance, resumes, evaluates every protocol."""

import json

import numpy as np
import pytest

from modeling_tagclip.data.reid import load_reid_dataset
from modeling_tagclip.data.synthetic_reid import generate_reid_dataset
from modeling_tagclip.metrics.reid import evaluate_protocols
from modeling_tagclip.evaluation import reid as evaluate_reid
from training import train_reid

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "image_size": [32, 16],
    "patch_size": 8,
    "patch_stride": [4, 4],
    "num_experts": 3,
    "num_prompt_tokens": 2,
    "expert_intermediate_size": 64,
    "graph_top_k": 8,
    "fusion_intermediate_size": 64,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("reid")
    generate_reid_dataset(root / "data", num_identities=48, image_size=(32, 16), progress=False)
    args = [
        "--data",
        str(root / "data"),
        "--output-dir",
        str(root / "out"),
        "--model",
        json.dumps(TINY_MODEL),
    ]
    args += [
        "--epochs",
        "16",
        "--batch-size",
        "24",
        "--lr",
        "0.01",
        "--eval-every",
        "8",
        "--warmup-iters",
        "10",
    ]
    return root, args, train_reid.main(args)


def random_feature_map(data, seeds: int = 20) -> tuple[float, float]:
    """mAP of random embeddings on the ALL protocol: mean and std over seeds (the chance level)."""
    scores = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        q, g = rng.normal(size=(len(data.query), 16)), rng.normal(size=(len(data.gallery), 16))
        scores.append(
            evaluate_protocols(q, g, data.query, data.gallery, {"ALL": data.protocols["ALL"]})["ALL"]["mAP"]
        )
    return float(np.mean(scores)), float(np.std(scores))


def test_short_synthetic_run_beats_chance(run):
    root, _, results = run
    data = load_reid_dataset(str(root / "data"))
    chance, spread = random_feature_map(data)
    assert set(results["protocols"]) == {"ALL", "A<->G", "G<->G", "A<->A", "A<->G (VDT)", "G->A"}
    assert results["protocols"]["ALL"]["mAP"] > chance + 3 * spread, (
        results["protocols"]["ALL"],
        chance,
        spread,
    )
    out = root / "out"
    assert (out / "best" / "config.json").is_file() and (out / "best" / "modeling_visa.py").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train", "validation"}
    assert (
        json.loads((out / "eval_results.json").read_text())["protocols"]["ALL"] == results["protocols"]["ALL"]
    )


def test_resume_continues_from_the_last_checkpoint(run):
    root, args, _ = run
    steps = [json.loads(line)["step"] for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    train_reid.main([*args, "--epochs", "17", "--resume", "latest"])
    after = [json.loads(line)["step"] for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    assert after[len(steps)] == max(steps) + 1 and max(after) > max(steps)


def test_evaluate_cli_prints_every_protocol(run, tmp_path, capsys):
    root, _, results = run
    report = evaluate_reid.main(
        [
            "--model",
            str(root / "out" / "best"),
            "--data",
            str(root / "data"),
            "--output",
            str(tmp_path / "r.json"),
        ]
    )
    printed = capsys.readouterr().out
    for name in results["protocols"]:
        assert name in printed
    saved = json.loads((tmp_path / "r.json").read_text())
    trained = json.loads((root / "out" / "eval_results.json").read_text())  # the latest run's best model
    assert saved["protocols"].keys() == results["protocols"].keys()
    assert saved["protocols"]["ALL"]["mAP"] == pytest.approx(trained["protocols"]["ALL"]["mAP"], abs=1e-6)
    assert report["retrieval_grid"].endswith("retrieval_grid.png")


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="unknown recipe"):
        train_reid.ReIDTrainConfig.from_recipe("fast")
    with pytest.raises(ValueError, match="unknown settings"):
        train_reid.ReIDTrainConfig.from_recipe("synthetic", learning_rate=1.0)
    cfg = train_reid.ReIDTrainConfig.from_recipe("reference")
    assert (cfg.optimizer, cfg.lr, cfg.batch_size, cfg.num_instances, cfg.warmup_iters, cfg.epochs) == (
        "sgd",
        0.008,
        128,
        4,
        2000,
        120,
    )


def test_reference_learning_rate_schedule():
    cfg = train_reid.ReIDTrainConfig.from_recipe("reference")
    lr = train_reid.learning_rate
    assert lr(cfg, 0, 0, 400) == pytest.approx(0.008 * 0.01)
    assert lr(cfg, 1000, 2, 400) == pytest.approx(0.008 * (0.01 * 0.5 + 0.5))
    assert lr(cfg, 2000, 5, 400) == pytest.approx(
        0.008
    )  # warmup over, cosine starts after ceil(2000/400) epochs
    assert lr(cfg, 48000, 120, 400) == pytest.approx(1.6e-6)


def test_clip_is_per_tensor():
    import torch

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    params[0].grad, params[1].grad = torch.tensor([30.0, 40.0]), torch.tensor([0.3, 0.4])
    train_reid.clip_per_tensor(params, 5.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]))  # this tensor's norm 50 -> 5
    torch.testing.assert_close(
        params[1].grad, torch.tensor([0.3, 0.4])
    )  # untouched: a global clip would shrink it


def test_lora_run_saves_a_plain_merged_model(run, tmp_path):
    root, _, _ = run
    args = [
        "--data",
        str(root / "data"),
        "--output-dir",
        str(tmp_path / "lora"),
        "--model",
        json.dumps(TINY_MODEL),
    ]
    train_reid.main([*args, "--epochs", "2", "--batch-size", "24", "--eval-every", "1", "--lora-rank", "4"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "lora" / "best" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "lora_" in k or "base_layer" in k or "modules_to_save" in k]


def test_train_py_task_reid_dispatches_to_visa_training(monkeypatch):
    """`accelerate launch training/train.py --task reid ...` runs training.train_reid.main with the rest."""
    import training.train as train_entry
    import training.train_reid as reid

    assert train_entry.split_task(["--task", "reid", "--epochs", "1"]) == ("reid", ["--epochs", "1"])
    assert train_entry.split_task(["--max_steps", "3"]) == ("retrieval", ["--max_steps", "3"])
    seen = {}
    monkeypatch.setattr(reid, "main", lambda argv: seen.setdefault("argv", argv) or {"ok": True})
    train_entry.main(["--task", "reid", "--data", "somewhere"])
    assert seen["argv"] == ["--data", "somewhere"]
