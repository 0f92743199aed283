"""CLIP pre-training as a task of the one loop: the numbers of the hand-written loop it replaced, a step-exact
resume, and the main job's phase resuming an interrupted pre-training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeling_tagclip.engine.config import TagClipTrainConfig
from modeling_tagclip.engine.tasks.clip_pretraining import (
    CaptionBatches,
    clip_config,
    epoch_losses,
    phase_config,
    pretrain_clip,
)

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
MODEL = {
    "vision_config": {**SIZES, "num_hidden_layers": 2, "patch_size": 8, "moe_layers": [1]},  # moe: the init
    "text_config": {**SIZES, "num_hidden_layers": 1},
    "projection_dim": 32,
}
IMAGE_SIZE = (32, 16)

# Recorded from the hand-written loop this task replaced (`pretrain_clip(rows, clip_config(MODEL, (32, 16), 3.0),
# out, (32, 16), epochs=3, batch_size=8, lr=1e-3, seed=0, fast=FAST, on_epoch=...)` of the commit before it, one
# torch thread, the 28 training rows of the 12-identity synthetic set at 32x16, seed 0): each epoch's mean step loss
# and the float64 sum / sum of squares of the saved weights. FAST: fused AdamW and captions padded to the batch's
# longest (the main job), else 77 tokens (the init study). The task gives the same weights bit for bit.
KNOWN = {
    True: (
        [3.201780637105306, 2.2210961977640786, 2.0016517639160156],
        346.0888702115684,
        1349.9594168192036,
    ),
    False: (
        [3.201780319213867, 2.2210960388183594, 2.0016517639160156],
        346.0817327469862,
        1349.9593798748524,
    ),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from fixtures import render_train_set

    return render_train_set(tmp_path_factory.mktemp("synthetic"), identities=12, image_size=IMAGE_SIZE)


def _rows(data_dir: Path):
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    return load_dataset_split(data_dir, "train", image_dir=data_dir / "images")


def _phase(out: Path, **settings) -> TagClipTrainConfig:
    cfg = TagClipTrainConfig(image_size=list(IMAGE_SIZE), model=MODEL, num_threads=1, **settings)
    return phase_config(cfg, out, epochs=3, batch_size=8, learning_rate=1e-3)


def _pretrain(data_dir: Path, out: Path, longest: bool = True, **kwargs) -> Path | None:
    clip = clip_config(MODEL, IMAGE_SIZE, 3.0)
    phase = _phase(out, save_steps=kwargs.pop("save_steps", 500))
    return pretrain_clip(lambda: _rows(data_dir), clip, phase, longest=longest, **kwargs)


def _weights(clip: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(clip / "model.safetensors"))


@pytest.mark.parametrize("longest", [True, False])
def test_pretraining_gives_the_losses_and_weights_of_the_loop_it_replaced(
    tmp_path, data_dir, longest, capsys
):
    clip = _pretrain(data_dir, tmp_path / "run", longest)
    losses, total, squares = KNOWN[longest]
    assert epoch_losses(tmp_path / "run") == pytest.approx(losses, abs=1e-6)
    weights = _weights(clip).values()
    assert sum(float(t.double().sum()) for t in weights) == pytest.approx(total, rel=1e-9)
    assert sum(float(t.double().pow(2).sum()) for t in weights) == pytest.approx(squares, rel=1e-9)
    err = capsys.readouterr().err
    assert (
        "pre-training CLIP: epoch 1/3 done, loss 3.202, " in err and "pre-training CLIP: 9/9 steps in " in err
    )


def test_a_stopped_pretraining_resumes_to_the_uninterrupted_weights_and_losses(tmp_path, data_dir):
    from fixtures import records

    whole = _pretrain(data_dir, tmp_path / "whole")
    # 3 steps an epoch: stopped at step 4, in the middle of the second epoch (checkpoints every 2 steps)
    assert _pretrain(data_dir, tmp_path / "part", save_steps=2, stop_after_steps=4) is None
    assert not (tmp_path / "part" / "clip-hf").exists()
    assert epoch_losses(tmp_path / "part") == epoch_losses(tmp_path / "whole")[:1]
    resumed = _pretrain(data_dir, tmp_path / "part", save_steps=2, resume="latest")
    assert epoch_losses(tmp_path / "part") == epoch_losses(
        tmp_path / "whole"
    )  # the cut epoch's mean included
    assert records(tmp_path / "part") == records(tmp_path / "whole")  # every step's loss, lr and scale
    one, other = _weights(whole), _weights(resumed)
    assert list(one) == list(other) and all(torch.equal(one[k], other[k]) for k in one)


def test_the_main_job_resumes_an_interrupted_pretraining_phase_and_then_reuses_it(tmp_path, data_dir, capsys):
    from modeling_tagclip.atomic_io import write_json
    from modeling_tagclip.engine.tasks import clip_pretraining as phase

    rows = _rows(data_dir)
    cfg = TagClipTrainConfig(
        image_size=list(IMAGE_SIZE), model=MODEL, num_threads=1, output_dir=str(tmp_path)
    )
    cfg.pretrain_clip.epochs, cfg.pretrain_clip.batch_size, cfg.pretrain_clip.logit_scale_init_value = (
        3,
        8,
        3.0,
    )
    out = tmp_path / "clip-init"
    out.mkdir()
    write_json(
        out / "pretraining.json", phase._settings(rows, cfg), indent=1
    )  # as the phase's start writes it
    part = phase_config(cfg, out, 3, 8, 1e-3)
    part.save_steps = 2
    clip = clip_config(MODEL, IMAGE_SIZE, 3.0)
    assert pretrain_clip(lambda: rows, clip, part, stop_after_steps=4) is None  # interrupted at step 4
    capsys.readouterr()

    init = phase.clip_init_for_run(rows, cfg, Accelerator())
    printed = capsys.readouterr().out
    assert "pre-training a CLIP of this size on the training split for 3 epochs" in printed
    assert f"resuming from {out / 'checkpoints' / 'step_4'}" in printed
    assert (init / "config.json").is_file() and not (out / "checkpoints").exists()
    whole = _pretrain(data_dir, tmp_path / "whole")
    one, other = _weights(whole), _weights(out / "clip-hf")
    assert all(torch.equal(one[k], other[k]) for k in one)

    assert phase.clip_init_for_run(rows, cfg, Accelerator()) == init
    again = capsys.readouterr().out
    assert "reusing the pre-trained CLIP init" in again and "pre-training a CLIP" not in again


class Accelerator:
    """What the phase asks of the fine-tuning run's accelerator, for one process."""

    is_main_process = True

    def print(self, *args) -> None:
        print(*args)

    def wait_for_everyone(self) -> None:
        pass


def test_caption_batches_replay_any_epoch_and_slice_batches_per_process():
    counts = [1, 2, 3, 2, 2, 1, 3]
    batches, epochs = CaptionBatches(counts, 3, seed=5), []
    for epoch in range(3):
        batches.set_epoch(epoch)
        epochs.append(list(batches))
    again = CaptionBatches(counts, 3, seed=5)
    again.set_epoch(2)
    assert list(again) == epochs[2]  # epoch 2 alone, replayed from the seed
    assert len(batches) == 2 and all(len(b) == 3 for e in epochs for b in e)
    assert all(0 <= c < counts[r] for e in epochs for b in e for r, c in b)
    halves = CaptionBatches(counts, 2, seed=5, parts=2)
    whole = CaptionBatches(counts, 2, seed=5)
    assert len(halves) == 6 and list(halves) == [b[i : i + 1] for b in whole for i in (0, 1)]


@pytest.mark.slow
def test_two_processes_pretrain_as_one_process_with_the_whole_batch_then_fine_tune(tmp_path):
    """The main job launched on 2 processes: each pre-trains on half of every batch with the loss on the gathered
    batch (the one-process losses), then both fine-tune (the process group outlives the phase)."""
    import os
    import sys

    from fixtures import free_port, records, render_train_set, run_train

    data = render_train_set(tmp_path / "data", identities=24)
    cfg = {
        "data_dir": str(data),
        "max_steps": 2,
        "per_device_batch_size": 8,
        "pretrain_clip": {"epochs": 2, "batch_size": 8, "logit_scale_init_value": 3.0},
    }
    run_train(tmp_path, "one", cfg)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    launcher = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    launcher += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    os.environ["ACCELERATE_USE_CPU"] = "1"
    try:
        output = run_train(tmp_path, "two", {**cfg, "per_device_batch_size": 4}, launcher=launcher)
    finally:
        os.environ.pop("ACCELERATE_USE_CPU")
    one, two = (tmp_path / name / "clip-init" for name in ("one", "two"))
    assert len(epoch_losses(one)) == 2 and epoch_losses(two) == pytest.approx(epoch_losses(one), abs=1e-4)
    first, second = records(one), records(two)
    assert sorted(first) == sorted(second) and len(first) > 4
    assert [second[s]["loss"] for s in sorted(second)] == pytest.approx(
        [first[s]["loss"] for s in sorted(first)], abs=1e-4
    )
    assert "pre-training CLIP: epoch 2/2 done, loss " in output and "test R@1" in output
    assert (tmp_path / "two" / "eval_results.json").is_file()
