"""A bad setting is reported against where it came from (recipe and/or flags), without a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from modeling_tagclip.engine.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_override_is_not_blamed_on_the_recipe_alone():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"grad_cache_chunks": 0, "output_dir": "x"})
    message = str(err.value)
    assert (
        "default.yaml + overrides (grad_cache_chunks, output_dir): grad_cache_chunks must be between"
        in message
    )


def test_a_bad_recipe_value_names_only_the_recipe(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("num_workers: 0\npersistent_workers: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value) == f"{recipe}: persistent_workers needs num_workers > 0"


@pytest.mark.slow
def test_train_py_prints_a_config_error_without_a_traceback(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "training/train.py",
            "--output_dir",
            str(tmp_path / "o"),
            "--grad_cache_chunks",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2  # a usage error, as argparse's
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("train.py: error: ")
    assert "+ overrides (output_dir, grad_cache_chunks): grad_cache_chunks must be between 1" in done.stderr
    assert not (tmp_path / "o").exists()
