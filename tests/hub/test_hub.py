"""Model card and Hub push: card metadata/numbers, and a push → pull round trip against a fake Hub on 127.0.0.1.

Nothing leaves the machine: the fake Hub (tests/fake_hub.py) runs in this process and the
push and pull run in subprocesses whose HF_ENDPOINT points at it (set before huggingface_hub is imported).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml
from fake_hub import FakeHub
from fixtures import REPO_ROOT, clean_env, repo_env, run_python, save_tiny_model, tiny_config, tiny_model
from huggingface_hub import ModelCard

from modeling_tagclip.hub.push_to_hub import render_card
from modeling_tagclip.hub.tagclip import load_eval_results

EVAL = {
    "R@1": 41.5,
    "R@5": 70.25,
    "R@10": 81.0,
    "mAP": 38.1234,
    "mINP": 20.5,
    "match_view_breakdown": {
        "aerial-and-ground": {
            "R@1": 45.0,
            "R@5": 72.0,
            "R@10": 83.0,
            "mAP": 40.0,
            "mINP": 22.0,
            "num_queries": 30,
        }
    },
    "view_probe": {"accuracy": 97.5, "majority_baseline": 55.0},
    "num_queries": 120,
    "num_gallery": 60,
    "num_identities": 20,
    "chance_R@1": 5.0,
    "data": "data/synthetic",
    "split": "test",
}
REQUIRED_TAGS = {
    "custom_code",
    "person-retrieval",
    "text-to-image-retrieval",
    "aerial-ground",
    "mixture-of-experts",
}
REPO_ID = "tagclip-org/tag-clip-tiny"

PULL = """
import json, re, sys
from pathlib import Path
readme = Path(sys.argv[1]).read_text()
snippet = re.search(r"```python\\n(.*?)```", readme, re.S).group(1)
namespace = {}
exec(compile(snippet, "model-card-snippet", "exec"), namespace)  # the card's usage code, as written
model, repo, out = namespace["model"], namespace["repo"], namespace["out"]
from peft import PeftModel
adapted = PeftModel.from_pretrained(model, repo, subfolder="adapters/adapter")
import importlib.util
from huggingface_hub import hf_hub_download
spec = importlib.util.spec_from_file_location("handler", hf_hub_download(repo, "handler.py"))
handler = importlib.util.module_from_spec(spec)
spec.loader.exec_module(handler)
endpoint = handler.EndpointHandler(repo, trust_remote_code=True)  # served without the package: opted in
print("\\n" + json.dumps({
    "module": type(model).__module__,
    "logits": out.logits_per_text.tolist(),
    "lora_layers": sum("lora_A" in name for name, _ in adapted.named_parameters()),
    "endpoint": endpoint({"inputs": namespace["query"]}),
    "handler_module": type(endpoint.model).__module__,
}))
"""


def _front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "card has no YAML front matter"
    return yaml.safe_load(match.group(1))


def _card(results=EVAL, **kwargs):
    examples = (
        ["examples/aerial.png", "examples/ground.png"],
        ["aerial", "ground"],
        "a man in a blue hoodie",
    )
    return render_card(
        tiny_config(),
        REPO_ID,
        results,
        training=({"learning_rate": "0.001"}, "training_config.json"),
        examples=examples,
        adapters=["adapters/lora"],
        plots=["plots/curves.png"],
        **kwargs,
    )


def test_card_renders_valid_yaml_with_eval_numbers():
    text = str(_card())
    meta = _front_matter(text)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "zero-shot-image-classification"
    assert REQUIRED_TAGS <= set(meta["tags"]) and meta["datasets"] and meta["metrics"]
    assert meta["widget"][0]["src"].endswith(f"{REPO_ID}/resolve/main/examples/aerial.png")
    assert "candidate_labels" in meta["widget"][0]
    (entry,) = meta["model-index"]
    metrics = {m["name"]: m["value"] for m in entry["results"][0]["metrics"]}
    assert metrics == {k: round(EVAL[k], 2) for k in ("R@1", "R@5", "R@10", "mAP", "mINP")}
    parsed = ModelCard(text).data  # huggingface_hub's own parser accepts the metadata
    assert {r.metric_name: r.metric_value for r in parsed.eval_results}["mAP"] == 38.12
    for needle in (
        "| 41.50 | 70.25 | 81.00 | 38.12 | 20.50 |",
        "| aerial-and-ground | 30 | 45.00",
        "97.5% accuracy",
        "synthetic",
        "arXiv:2511.08369",
        "arXiv:2605.18192",
        "trust_remote_code=True",
        "| learning_rate | 0.001 |",
        "adapters/lora",
        "![plots/curves.png](plots/curves.png)",
    ):
        assert needle in text, needle
    import transformers

    assert f"Tested with transformers {transformers.__version__}" in text
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    compile(snippet, "snippet", "exec")
    assert f'repo = "{REPO_ID}"' in snippet


def test_card_without_eval_results_says_so():
    text = str(_card(results=None))
    assert "model-index" not in _front_matter(text)
    assert "No `eval_results.json` was found" in text


def test_eval_results_without_metrics_is_a_clear_error(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "eval_results.json").write_text(json.dumps({"R@1": 1.0}))
    with pytest.raises(ValueError, match="lacks the metrics"):
        load_eval_results(tmp_path / "best")
    (tmp_path / "a" / "b" / "c" / "best").mkdir(parents=True)
    assert (
        load_eval_results(tmp_path / "a" / "b" / "c" / "best") is None
    )  # run folders: at most two levels up


def _make_run(root):
    """A run folder as train.py leaves it: best/ (+ best/adapter), eval_results.json, metrics.jsonl, config.json."""
    from peft import LoraConfig, get_peft_model

    best = save_tiny_model(root / "best")
    (root / "eval_results.json").write_text(json.dumps({**EVAL, "data": str(root / "no-data")}))
    (root / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (root / "config.json").write_text(json.dumps({"config": {"learning_rate": 1e-3, "max_steps": 300}}))
    base, _ = tiny_model()
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(
        best / "adapter"
    )
    return best


@pytest.fixture
def hub():
    server = FakeHub().start()
    yield server
    server.stop()


@pytest.mark.slow
def test_push_then_pull_round_trip_on_a_fake_hub(hub, tmp_path):
    best = _make_run(tmp_path / "run")
    env = repo_env(tmp_path, HF_ENDPOINT=hub.url, HF_TOKEN="hf_fake", HF_HUB_DISABLE_XET="1")
    push = subprocess.run(
        [
            sys.executable,
            "-m",
            "modeling_tagclip.cli",
            "push",
            "--checkpoint",
            str(best),
            "--repo-id",
            REPO_ID,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert push.returncode == 0, push.stderr[-4000:]
    files = hub.repos[REPO_ID]["files"]
    expected = {
        "README.md",
        "config.json",
        "model.safetensors",
        "modeling_tagclip.py",
        "configuration_tagclip.py",
        "processing_tagclip.py",
        "pipeline_tagclip.py",
        "gallery_index.py",
        "processor_config.json",
        "tokenizer.json",
        "eval_results.json",
        "handler.py",
        "examples/aerial.png",
        "examples/ground.png",
        "adapters/adapter/adapter_config.json",
        "adapters/adapter/adapter_model.safetensors",
    }
    assert expected <= set(files), expected - set(files)
    assert json.loads(files["eval_results.json"])["R@1"] == EVAL["R@1"]
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModel"] == "modeling_tagclip.TagClipModel"
    assert "text-to-person-retrieval" in config["custom_pipelines"]
    readme = files["README.md"].decode()
    assert "| 41.50 | 70.25 | 81.00 | 38.12 | 20.50 |" in readme
    assert "| config.learning_rate | 0.001 |" in readme and "(`config.json`)" in readme  # the run's config
    assert any(r.startswith("POST /api/models/") and "/commit/" in r for r in hub.requests)

    (tmp_path / "README.md").write_text(readme)
    pull_env = clean_env(tmp_path, HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1")
    del pull_env["HF_HUB_OFFLINE"]
    stdout = run_python(PULL, [str(tmp_path / "README.md")], tmp_path, pull_env).stdout
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules.") and report["handler_module"].startswith(
        "transformers_modules."
    )
    assert report["lora_layers"] > 0
    assert len(report["endpoint"][0]["embedding"]) == 16

    from io import BytesIO

    from PIL import Image

    from modeling_tagclip import TagClipModel, TagClipProcessor

    model, processor = TagClipModel.from_pretrained(best).eval(), TagClipProcessor.from_pretrained(best)
    images = [Image.open(BytesIO(files[f"examples/{v}.png"])).convert("RGB") for v in ("aerial", "ground")]
    query = re.search(r'query = "(.*)"', readme).group(1)
    with torch.inference_mode():
        logits = model(**processor(text=[query], images=images)).logits_per_text
    torch.testing.assert_close(torch.tensor(report["logits"]), logits, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# ViSA checkpoints: the ViSA card (picked from config.json's model_type) and a --dry-run push
# ---------------------------------------------------------------------------------------------------------

REID_RESULTS = {
    "model": "outputs/visa-synthetic/best",
    "dataset": "synthetic_reid",
    "data": "data/synthetic_reid",
    "protocols": {
        "ALL": {"R1": 61.25, "R5": 80.5, "R10": 88.0, "mAP": 55.4321, "mINP": 30.125, "num_queries": 40},
        "A<->G": {"R1": 50.0, "R5": 75.0, "R10": 85.0, "mAP": 45.678, "mINP": 20.0, "num_queries": 20},
        "G->A": {"num_queries": 0},
    },
}


def _save_tiny_visa(folder):
    from fixtures import tiny_visa_config

    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID

    torch.manual_seed(0)
    ViSAForReID(tiny_visa_config()).save_pretrained(folder)
    (folder / "reid_results.json").write_text(json.dumps(REID_RESULTS))
    return folder


def test_visa_card_from_a_saved_checkpoint(tmp_path):
    from modeling_tagclip.hub.push_to_hub import stage_checkpoint

    best = _save_tiny_visa(tmp_path / "best")
    out = stage_checkpoint(best, "visa-org/visa-tiny", tmp_path / "stage")
    text = (out / "README.md").read_text()
    meta = _front_matter(text)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "image-feature-extraction"
    assert {
        "custom_code",
        "person-reidentification",
        "aerial-ground",
        "mixture-of-experts",
        "vision-transformer",
    } <= set(meta["tags"])
    assert meta["datasets"] and meta["metrics"]
    parsed = ModelCard(text).data  # huggingface_hub's own parser accepts the metadata
    got = {(r.dataset_config, r.metric_type): r.metric_value for r in parsed.eval_results}
    expected = {
        (name, metric): round(row[key], 2)
        for name, row in REID_RESULTS["protocols"].items()
        if "mAP" in row
        for key, metric in (
            ("R1", "recall@1"),
            ("R5", "recall@5"),
            ("R10", "recall@10"),
            ("mAP", "map"),
            ("mINP", "minp"),
        )
    }
    assert got == expected
    for needle in (
        "| ALL | 40 | 61.25 | 80.50 | 88.00 | 55.43 | 30.12 |",
        "| G->A | 0 |",
        "synthetic",
        "view_labels=torch.tensor(views)",
        "arXiv:2511.08369",
        "arXiv:2605.18192",
        "AutoImageProcessor.from_pretrained(repo)",
    ):
        assert needle in text, needle
    assert "tag-clip" not in meta["tags"] and "zero-shot" not in text
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "visa" and config["auto_map"]["AutoModel"].endswith("ViSAModel")

    # the card's snippet as written, against the staged folder served as a local "repo"
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    snippet = snippet.replace('repo = "visa-org/visa-tiny"', f"repo = {str(out)!r}")
    snippet = snippet.replace("hf_hub_download(repo, name)", "__import__('os').path.join(repo, name)")
    namespace: dict = {}
    exec(compile(snippet, "visa-card-snippet", "exec"), namespace)
    assert namespace["embeddings"].shape == (2, 64)  # 2 x hidden_size 32
    with pytest.raises(ValueError, match="a ViSA checkpoint takes no --adapter or --ablation"):
        stage_checkpoint(best, "visa-org/visa-tiny", tmp_path / "refused", ablation=tmp_path)


@pytest.mark.slow
def test_visa_dry_run_push_lists_card_and_weights(tmp_path):
    best = _save_tiny_visa(tmp_path / "run" / "best")
    stage = tmp_path / "stage"
    push = subprocess.run(
        [
            sys.executable,
            "-m",
            "modeling_tagclip.cli",
            "push",
            "--checkpoint",
            str(best),
            "--repo-id",
            "visa-org/visa-tiny",
            "--dry-run",
            "--stage-dir",
            str(stage),
        ],
        cwd=REPO_ROOT,
        env=repo_env(tmp_path, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert push.returncode == 0, push.stderr[-4000:]
    listed = push.stdout.split(": ", 1)[1]
    for name in ("README.md", "model.safetensors", "config.json", "modeling_visa.py", "reid_results.json"):
        assert name in listed, name
    assert "handler.py" not in listed
    assert _front_matter((stage / "README.md").read_text())["pipeline_tag"] == "image-feature-extraction"


def test_a_training_run_folder_pushes_its_best_model(tmp_path):
    """`--checkpoint outputs/RUN` (as the README says) stages RUN/best: the run's own config.json is the
    training config, which has no model_type."""
    from modeling_tagclip.hub.run_files import model_folder

    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"task": "retrieval", "seed": 0}))
    (run / "best" / "config.json").write_text(json.dumps({"model_type": "tagclip"}))
    assert model_folder(run) == run / "best"
    assert model_folder(run / "best") == run / "best"


def test_card_carries_the_ablation_tables_and_plots(tmp_path):
    """`--ablation outputs/ablation`: the harness's tables go into the card, their plots into the repo."""
    from modeling_tagclip.hub.push_to_hub import main, stage_checkpoint

    best = save_tiny_model(tmp_path / "best")
    ablation = tmp_path / "ablation"
    ablation.mkdir()
    (ablation / "table4.md").write_text(
        "### Table 4: components\n\n| variant | R@1 |\n|---|---|\n| 1 ViT | 12.34 ± 1.00 |\n"
    )
    (ablation / "table4.png").write_bytes(b"\x89PNG fake")
    (ablation / "table5.md").write_text(
        "### Table 5: training views\n\n| variant | R@1 |\n|---|---|\n| both | 9.87 |\n"
    )
    out = stage_checkpoint(best, REPO_ID, tmp_path / "stage", ablation=ablation)
    card = (out / "README.md").read_text()
    assert "### Ablation — Table 4: components" in card and "| 1 ViT | 12.34 ± 1.00 |" in card
    assert "### Ablation — Table 5: training views" in card and "| both | 9.87 |" in card
    assert card.index("Table 4") < card.index("Table 5") < card.index("## Model details")
    assert "![ablation/table4.png](ablation/table4.png)" in card and "ablation/table5.png" not in card
    assert (out / "ablation" / "table4.png").read_bytes() == b"\x89PNG fake"
    assert "Ablations" not in (stage_checkpoint(best, REPO_ID, tmp_path / "plain") / "README.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no table4.md"):
        main(["--checkpoint", str(best), "--repo-id", REPO_ID, "--dry-run", "--ablation", str(empty)])


def test_push_without_network_says_so_in_one_line(tmp_path, monkeypatch):
    """Offline mode or an unreachable Hub: one line naming the problem and --dry-run, not a traceback; the
    files staged in --stage-dir stay there."""
    import socket

    from huggingface_hub import constants

    from modeling_tagclip.hub.push_to_hub import main

    best = save_tiny_model(tmp_path / "best")
    stage = tmp_path / "stage"
    argv = ["--checkpoint", str(best), "--repo-id", REPO_ID, "--token", "hf_fake", "--stage-dir", str(stage)]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as offline:
        main(argv)
    message = str(offline.value)
    assert message.startswith(
        "tagclip push: the Hub is offline here (HF_HUB_OFFLINE is set); nothing was pushed"
    )
    assert "--dry-run" in message and "\n" not in message
    assert (stage / "README.md").is_file() and (stage / "model.safetensors").is_file()

    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    with pytest.raises(SystemExit) as unreachable:
        main(argv)
    message = str(unreachable.value)
    assert message.startswith(f"tagclip push: cannot reach the Hub at {closed} (ConnectError")
    assert "--dry-run" in message and "\n" not in message
