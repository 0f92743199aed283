"""The files of a training run next to a checkpoint: results, training config, plots, the model folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EVAL_FILE = "eval_results.json"
RUN_MARKERS = (EVAL_FILE, "metrics.jsonl")
RUN_CONFIG_NAMES = (
    "training_config.json",
    "train_config.json",
    "training_args.json",
    "run_config.json",
    "config.yaml",
    "train_config.yaml",
    "run_config.yaml",
    "config.json",
)


def run_folders(checkpoint: Path) -> list[Path]:
    """The checkpoint folder, plus the training run's OUTPUT_DIR above it (up to two levels, has run markers).

    ``train.py`` writes ``OUTPUT_DIR/best`` (LoRA: ``OUTPUT_DIR/best/adapter``) next to ``eval_results.json``,
    ``metrics.jsonl``, the run's ``config.json`` and the plots.
    """
    for parent in list(checkpoint.resolve().parents)[:2]:
        if any((parent / marker).is_file() for marker in RUN_MARKERS):
            return [checkpoint, parent]
    return [checkpoint]


def find_run_file(checkpoint: Path, names: Sequence[str]) -> Path | None:
    """The first of ``names`` in the checkpoint folder, else in the run folder above it.

    A ``config.json`` counts only in the run folder: in the checkpoint it is the model's config.
    """
    for folder in run_folders(checkpoint):
        for name in names:
            if (folder / name).is_file() and not (name == "config.json" and folder == checkpoint):
                return folder / name
    return None


def read_mapping(path: Path) -> dict[str, Any]:
    """A JSON or YAML file holding a mapping; ValueError if it holds something else."""
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(path.read_text())
    else:
        data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping")
    return data


def results_path(checkpoint: Path, names: Sequence[str], explicit: str | None = None) -> Path | None:
    """``explicit``, else the first of ``names`` next to the checkpoint (see `find_run_file`), else None."""
    return Path(explicit) if explicit else find_run_file(checkpoint, names)


def load_training_config(checkpoint: Path, explicit: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(flattened scalar settings, file name) of the run's training configuration, if one is found."""
    path = results_path(checkpoint, RUN_CONFIG_NAMES, explicit)
    return None if path is None else (flatten(read_mapping(path)), path.name)


def flatten(data: dict[str, Any], prefix: str = "", limit: int = 60) -> dict[str, str]:
    """Scalar and short-list settings as ``a.b`` → text, at most ``limit`` rows."""
    rows: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.update(flatten(value, f"{name}.", limit))
        elif isinstance(value, (list, tuple)) and len(value) > 8:
            rows[name] = f"[{len(value)} items]"
        elif value is not None:
            rows[name] = str(value).replace("|", "\\|").replace("\n", " ")
    return dict(list(rows.items())[:limit])


def discover_plots(checkpoint: Path) -> list[Path]:
    """PNG plots of the run (checkpoint folder and the run folder above it)."""
    return [p for folder in run_folders(checkpoint) for p in sorted(folder.glob("*.png"))]


def stage_plots(checkpoint: Path, out: Path) -> list[str]:
    """Copy the run's plots into ``out/plots``; returns their repo paths."""
    names = []
    for plot in discover_plots(checkpoint):
        (out / "plots").mkdir(exist_ok=True)
        shutil.copy2(plot, out / "plots" / plot.name)
        names.append(f"plots/{plot.name}")
    return names


def checkpoint_model_type(checkpoint: str | Path) -> str | None:
    """``model_type`` of the checkpoint's ``config.json`` (None if there is none)."""
    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return None


def model_folder(checkpoint: str | Path) -> Path:
    """The saved model of ``checkpoint``: the folder itself, or ``best/`` of a training run folder (whose own
    ``config.json`` is the training config, not a model config), a LoRA run's included (``best/adapter``)."""
    checkpoint = Path(checkpoint)
    best = checkpoint / "best"
    lora_best = (best / "adapter" / "adapter_config.json").is_file()
    if checkpoint_model_type(checkpoint) is None and (checkpoint_model_type(best) is not None or lora_best):
        return best
    return checkpoint
