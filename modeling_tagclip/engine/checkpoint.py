"""Checkpoints ``checkpoints/step_N``: atomic save, rotation, verified resume; nothing pickled.

A checkpoint holds ``model.safetensors`` (the unwrapped training model, LoRA wrapper included),
``optimizer.safetensors`` + ``optimizer.json`` (tensors / the rest of ``optimizer.state_dict()``),
``trainer_state.json`` (``TrainState``: counters, sampler stream, grad-scaler) and ``manifest.json``
(SHA-256 of every file). RNG states are not stored: every random draw of a step is seeded from
(seed, step, rank) or (seed, sample), so a resumed run replays exactly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from modeling_tagclip.atomic_io import sha256_file
from modeling_tagclip.engine.state import TrainState

logger = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none that verifies could be read."""


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Completed checkpoints ``checkpoints/step_N``, oldest first (temporary folders are never listed)."""
    root = Path(output_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


# ----------------------------------------------------------------------------- optimizer state without pickle


def optimizer_to_files(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (``"<param>.<name>"``) and JSON-ready metadata."""
    tensors, other = {}, {}
    for index, values in state_dict["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().contiguous().cpu()
            else:
                other.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "state": other}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    """Inverse of ``optimizer_to_files``."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta["state"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


# ----------------------------------------------------------------------------- writing


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint_files(folder: Path, model, optimizer, state: TrainState) -> None:
    """Write the files of one checkpoint into ``folder`` (exists, empty), fsync each, then the manifest."""
    from safetensors.torch import save_file, save_model

    save_model(model, str(folder / MODEL_FILE))
    tensors, meta = optimizer_to_files(optimizer.state_dict())
    save_file(tensors, str(folder / OPTIMIZER_TENSORS))
    (folder / OPTIMIZER_META).write_text(json.dumps(meta) + "\n")
    (folder / STATE_FILE).write_text(state.to_json())
    names = (MODEL_FILE, OPTIMIZER_TENSORS, OPTIMIZER_META, STATE_FILE)
    for name in names:
        _fsync(folder / name)
    (folder / MANIFEST).write_text(json.dumps({name: sha256_file(folder / name) for name in names}, indent=2))
    _fsync(folder / MANIFEST)


def save_checkpoint(
    accelerator, model, optimizer, state: TrainState, output_dir: str | os.PathLike, keep: int
):
    """Save ``checkpoints/step_N`` atomically (temp folder, fsync, rename) and keep the newest ``keep``.

    Only the main process writes (model and optimizer are replicated). On any error the temporary folder is
    removed, older checkpoints are untouched, and a ``CheckpointError`` names the folder and the cause.
    """
    root = Path(output_dir) / "checkpoints"
    final, tmp = root / f"step_{state.step}", root / f".tmp_step_{state.step}"
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_checkpoint_files(tmp, unwrapped, optimizer, state)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync(root)
        except Exception as err:  # noqa: BLE001  (safetensors raises SafetensorError on a full disk)
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {err}") from err
        rotate_checkpoints(output_dir, state.step, keep)
    accelerator.wait_for_everyone()
    return final


def rotate_checkpoints(output_dir: str | os.PathLike, step: int, keep: int) -> list[Path]:
    """Delete the checkpoints older than the newest ``keep`` at or below ``step`` (the one just saved); never one
    newer than ``step``, nor one that it keeps. Returns the deleted folders."""
    older = [p for p in checkpoint_dirs(output_dir) if _step_of(p) <= step]
    doomed = older[: -max(1, keep)]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
    return doomed


def _step_of(folder: Path) -> int:
    return int(folder.name.split("_")[1])


# ----------------------------------------------------------------------------- reading


def verify_checkpoint(folder: Path) -> str | None:
    """``None`` if every file in the manifest is present with its checksum and the state's step is the folder's,
    else what is wrong."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"no readable {MANIFEST} ({err})"
    if not isinstance(manifest, dict) or STATE_FILE not in manifest:
        return f"{MANIFEST} does not list {STATE_FILE}"
    for name, digest in manifest.items():
        if not (folder / name).is_file():
            return f"{name} is missing"
        if sha256_file(folder / name) != digest:
            return f"{name} does not match its checksum"
    try:
        step = read_state(folder).step
    except (OSError, ValueError, TypeError) as err:
        return f"unreadable {STATE_FILE} ({err})"
    if STEP_DIR.fullmatch(folder.name) and step != _step_of(folder):
        return f"{STATE_FILE} says step {step}, the folder step {_step_of(folder)}"
    return _optimizer_step_problem(folder, step)


def _optimizer_step_problem(folder: Path, step: int) -> str | None:
    """What is wrong when the optimizer's own step counter (Adam's per-parameter ``step`` tensors in the binary
    ``optimizer.safetensors``) disagrees with ``trainer_state.json``, else ``None``.

    Every training step is one ``optimizer.step()``, so the largest counter equals the state's step; with a
    fp16 grad scaler (steps skipped on overflow) it can only be lower. An optimizer without a counter (SGD)
    cannot be cross-checked."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(folder / OPTIMIZER_TENSORS), framework="pt") as tensors:
            counters = [
                float(tensors.get_tensor(key).max()) for key in tensors.keys() if key.endswith(".step")
            ]
    except (OSError, SafetensorError) as error:
        return f"unreadable {OPTIMIZER_TENSORS} ({error})"
    if not counters:
        return None
    taken = round(max(counters))
    if taken > step or (taken < step and read_state(folder).scaler is None):
        return (
            f"{STATE_FILE} says step {step}, the optimizer state {OPTIMIZER_TENSORS} has taken {taken} steps"
        )
    return None


def select_checkpoint(output_dir: str | os.PathLike, resume: str | None) -> Path | None:
    """Checkpoint to resume from: an explicit folder (must verify), or for ``latest`` the newest that verifies.

    Broken newer checkpoints are reported and skipped. ``latest`` gives ``None`` (a fresh start) only when there is
    no checkpoint folder yet; when there are some and none verifies, a ``CheckpointError`` lists them and how to
    start fresh (nothing is overwritten).
    """
    if resume is None:
        return None
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume-from-checkpoint: no checkpoint folder {path}")
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        return path
    found = []
    for path in reversed(checkpoint_dirs(output_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        logger.warning("checkpoint %s is unusable (%s): falling back to an older one", path, problem)
        found.append(f"{path.name}: {problem}")
    if found:
        raise CheckpointError(
            f"--resume-from-checkpoint latest: no usable checkpoint in {Path(output_dir) / 'checkpoints'} "
            f"({'; '.join(found)}); to start fresh, move that folder away or use another --output"
        )
    return None


def read_state(folder: Path) -> TrainState:
    return TrainState.from_json((folder / STATE_FILE).read_text(), folder / STATE_FILE)


def load_checkpoint(folder: Path, accelerator, model, optimizer) -> TrainState:
    """Restore model weights, optimizer and trainer state (safetensors + JSON only)."""
    from safetensors.torch import load_file, load_model

    load_model(
        accelerator.unwrap_model(model, keep_torch_compile=False),
        str(folder / MODEL_FILE),
        strict=True,
        device=str(accelerator.device),
    )
    meta = json.loads((folder / OPTIMIZER_META).read_text())
    tensors = load_file(str(folder / OPTIMIZER_TENSORS))  # CPU: load_state_dict moves them to the params
    optimizer.load_state_dict(optimizer_from_files(tensors, meta))
    state = read_state(folder)
    if state.scaler is not None and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state.scaler)
    return state
