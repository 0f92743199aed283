"""Helpers for the Hub/serving tests: a tiny TAG-CLIP with the real processor, a tiny synthetic gallery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_config

REPO_ROOT = Path(__file__).resolve().parents[1]
REAL_TEXT = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407)


def tiny_model(seed: int = 0):
    """(model, processor): the conftest tiny config with the real CLIP vocabulary, 32x16 images."""
    from modeling_tagclip import TagClipModel, TagClipProcessor

    torch.manual_seed(seed)
    return TagClipModel(tiny_config(text=REAL_TEXT)).eval(), TagClipProcessor.from_defaults(32, 16)


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Save a tiny model with the retrieval pipeline code (as the push and the training code do)."""
    from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline

    model, processor = tiny_model(seed)
    return save_with_pipeline(model, processor, folder)


def synthetic_gallery(folder: Path, identities: int = 6) -> Path:
    """A tiny synthetic aerial-ground dataset (TAG-PEDES layout); returns its root."""
    from modeling_tagclip.data.synthetic import generate_dataset

    generate_dataset(folder, num_identities=identities, seed=3, image_size=(64, 32), progress=False)
    return folder


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for a fresh subprocess: no package on the path, private HF cache, one thread."""
    env = {"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.update(extra)
    return env


# `python -I` keeps the checkout off sys.path, but an editable install still finds the packages: mark them
# missing so the subprocess is a user who has only transformers (an import of them raises ImportError).
HIDE_PROJECT = "import sys\nsys.modules.update({'modeling_tagclip': None, 'training': None})\n"


def run_python(code: str, args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300):
    """Run ``code`` with ``python -I`` where this project's packages are not importable; return the result."""
    result = subprocess.run(
        [sys.executable, "-I", "-c", HIDE_PROJECT + code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def repo_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess that runs project code from the repository root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON"))}
    env.update({"PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(tmp / "hf"), "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def save_eval_model(folder: Path) -> Path:
    """A tiny 64x32 TAG-CLIP (HR-MoE in block 1) and its processor saved in ``folder``, for evaluator runs."""
    from modeling_tagclip import TagClipConfig, TagClipModel, TagClipProcessor

    torch.manual_seed(0)
    config = TagClipConfig(
        vision_config=dict(
            hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
            image_size=[64, 32], patch_size=16, moe_layers=[1],
        ),
        text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2),
        projection_dim=16,
        tse_embed_dim=24,
    )  # fmt: skip
    TagClipModel(config).save_pretrained(folder)
    TagClipProcessor.from_defaults(64, 32).save_pretrained(folder)
    return folder


def synthetic_eval_set(folder: Path) -> Path:
    """The 16-identity 64x32 synthetic set the evaluator tests score."""
    from modeling_tagclip.data.synthetic import generate_dataset

    generate_dataset(folder, num_identities=16, seed=1, image_size=(64, 32), progress=False)
    return folder
