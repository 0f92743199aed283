"""CLIP pre-training as a task of the engine's loop: the losses and weights of the hand-written loop it replaced
(known answers), step-exact resume, and a run's pre-training phase resumed after a kill, then reused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from modeling_tagclip.engine.checkpoint import checkpoint_dirs
from modeling_tagclip.engine.samplers import FixedBatchSampler
from modeling_tagclip.engine.tasks.clip_pretraining import (
    clip_config,
    draw_batches,
    epoch_losses,
    pretrain_clip,
    warmup_cosine,
)
from modeling_tagclip.engine.tracker import read_records

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
MODEL = {
    "vision_config": {**SIZES, "num_hidden_layers": 2, "patch_size": 8},
    "text_config": {**SIZES, "num_hidden_layers": 1},
    "projection_dim": 32,
}
IMAGE_SIZE = [64, 32]
RUN = {"epochs": 3, "batch_size": 8, "lr": 1e-3, "seed": 0}  # 40 training images: 5 steps an epoch
SCALE = 3.0  # ln of the initial similarity scale

# Known answers, recorded from the hand-written loop this task replaced (`engine/clip_pretraining.py` at commit
# e7e9fef): `pretrain_clip(train split of fixtures.synthetic_eval_set, clip_config(MODEL, IMAGE_SIZE, 3.0), ...,
# epochs=3, batch_size=8, lr=1e-3, seed=0, fast=F)` with `torch.set_num_threads(1)` on AVX512 kernels; each step's
# loss read from the `CLIPModel.forward` output (`.item()`), the epoch means from its `on_epoch` callback (a float32
# sum over the epoch's steps), the weights' digest as `weights_digest` computes it. The loop's per-step losses
# and the weights are bit-identical; its epoch mean is a float64 mean of the same float32 losses, so it agrees
# to about 1e-7 (asserted at 1e-6).
RECORDED_ON = "AVX512"
OLD_LOOP = {
    False: {  # the init study's settings: per-tensor AdamW, captions padded to 77 tokens
        "steps": [4.454708099365234, 3.3620219230651855, 2.255952835083008, 2.1370089054107666,
                  2.3773536682128906, 2.379946708679199, 1.9138567447662354, 2.2944655418395996,
                  2.1280813217163086, 1.7351813316345215, 1.8060863018035889, 1.8446547985076904,
                  2.027010440826416, 2.093526601791382, 2.029294967651367],
        "epochs": [2.917409133911133, 2.0903064727783205, 1.9601146697998046],
        "digest": "eb23f26b1ad209067c8f2fd6df84b6850fe5a47adc2914d2767e8c80bbd528e9",
        "logit_scale": 2.994349479675293,
    },
    True: {  # a run's phase (fast): fused AdamW, captions padded to the batch's longest
        "steps": [4.454708099365234, 3.3620219230651855, 2.255952835083008, 2.1370091438293457,
                  2.377354145050049, 2.3799469470977783, 1.9138567447662354, 2.2944655418395996,
                  2.1280813217163086, 1.7351813316345215, 1.8060861825942993, 1.8446550369262695,
                  2.027010440826416, 2.093526840209961, 2.0292954444885254],
        "epochs": [2.917409133911133, 2.0903064727783205, 1.9601146697998046],
        "digest": "c67c74887b27811d1ebea9a9f489cada43d4406cf3962fb51e9083f93857c204",
        "logit_scale": 2.994349479675293,
    },
}  # fmt: skip


class Killed(Exception):
    """The job stops here."""


def weights_digest(folder: Path) -> str:
    """SHA-256 over the saved model's tensors (name, then bytes), in name order."""
    from safetensors.torch import load_file

    tensors, digest = load_file(str(folder / "model.safetensors")), hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def step_losses(run: Path) -> list[float]:
    return [record["loss"] for _, record in sorted(read_records(run / "metrics.jsonl").items())]


def train_split(data_dir: Path):
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    return load_dataset_split(data_dir, "train", image_dir=data_dir / "images")


def pretrain(data_dir: Path, out: Path, fast: bool, **loop) -> Path:
    """The recorded run, in the loop (one thread, as recorded)."""
    config = clip_config(MODEL, IMAGE_SIZE, SCALE)
    settings = {"num_threads": 1, **loop.pop("settings", {})}
    return pretrain_clip(
        train_split(data_dir), config, out, IMAGE_SIZE, **RUN, fast=fast, settings=settings, **loop
    )


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> Path:
    """The recorded run of a run's phase (fast), straight through."""
    out = tmp_path_factory.mktemp("straight")
    pretrain(data_dir, out, fast=True)
    return out


def test_batches_are_a_function_of_seed_and_epoch_and_replay():
    counts = [2, 3, 1, 2, 2, 4, 1]
    epochs = draw_batches(counts, 3, 2, seed=5)
    assert epochs == draw_batches(counts, 3, 2, seed=5) != draw_batches(counts, 3, 2, seed=6)
    for batches in epochs:  # full batches of distinct images, a caption of each
        assert [len(b) for b in batches] == [3, 3] and len({i for b in batches for i, _ in b}) == 6
        assert all(0 <= caption < counts[image] for batch in batches for image, caption in batch)
    sampler = FixedBatchSampler(epochs, 3)
    sampler.set_epoch(1)
    assert list(sampler) == list(sampler) == epochs[1] != epochs[0] and len(sampler) == 2


def test_the_schedule_is_the_lambda_lr_of_the_hand_written_loop():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 40))
    for step in range(40):
        assert optimizer.param_groups[0]["lr"] == 1e-3 * warmup_cosine(step, 40), step  # bit-equal
        optimizer.step()
        scheduler.step()
    assert warmup_cosine(0, 40) == pytest.approx(0.25) and warmup_cosine(3, 40) == pytest.approx(
        0.98618, abs=1e-5
    )


@pytest.mark.slow
@pytest.mark.parametrize("fast", [False, True])
def test_the_loop_gives_the_losses_and_weights_of_the_hand_written_loop(data_dir, tmp_path, fast, capsys):
    hf_dir = pretrain(data_dir, tmp_path, fast)
    expected = OLD_LOOP[fast]
    losses, weights = step_losses(tmp_path), hf_dir / "model.safetensors"
    from transformers import CLIPModel

    rng_after = torch.get_rng_state()
    torch.manual_seed(RUN["seed"])
    CLIPModel(clip_config(MODEL, IMAGE_SIZE, SCALE))
    assert torch.equal(rng_after, torch.get_rng_state())  # as the CLIP's init left it: so a run's fine-tuning
    scale = CLIPModel.from_pretrained(hf_dir).logit_scale.item()  # draws its new ID head as before
    if torch.backends.cpu.get_cpu_capability() == RECORDED_ON:
        assert losses == expected["steps"]  # bit for bit
        assert weights_digest(hf_dir) == expected["digest"] and scale == expected["logit_scale"]
    else:  # other kernels round differently
        assert losses == pytest.approx(expected["steps"], abs=1e-4)
        assert scale == pytest.approx(expected["logit_scale"], abs=1e-5)
    assert epoch_losses(tmp_path) == pytest.approx(expected["epochs"], abs=1e-6)
    assert weights.is_file() and len(checkpoint_dirs(tmp_path)) == 2  # the loop's checkpoints, rotated
    err = capsys.readouterr().err
    assert (
        "pre-training CLIP: epoch 3/3 done, mean loss " in err and "pre-training CLIP: 15/15 steps in " in err
    )


@pytest.mark.slow
def test_pre_training_stopped_mid_epoch_resumes_step_exact(data_dir, tmp_path, uninterrupted, capsys):
    settings = {"save_steps": 3}  # checkpoints at steps 3, 5 (an epoch's end) and 6
    pretrain(data_dir, tmp_path, fast=True, settings=settings, stop_after_steps=7)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step_5", "step_6"]
    assert not (tmp_path / "clip-hf").exists()
    pretrain(data_dir, tmp_path, fast=True, settings=settings, resume="latest")
    assert "resuming from " in capsys.readouterr().out
    assert step_losses(tmp_path) == step_losses(uninterrupted)  # steps 1-6 kept, 7-15 replayed: bit-equal
    assert len(set(step_losses(tmp_path))) == 15
    assert weights_digest(tmp_path / "clip-hf") == weights_digest(uninterrupted / "clip-hf")


@pytest.mark.slow
def test_a_killed_pre_training_phase_continues_and_a_finished_one_is_reused(
    data_dir, tmp_path, uninterrupted, monkeypatch, capsys
):
    from accelerate import Accelerator

    from modeling_tagclip.engine import clip_pretraining as phase
    from modeling_tagclip.engine.config import load_config

    model = {
        "vision_config": {**MODEL["vision_config"], "moe_layers": [1]},
        "text_config": MODEL["text_config"],
        "projection_dim": 32,
        "tse_embed_dim": 32,
    }
    pc = {"epochs": 3, "batch_size": 8, "learning_rate": 1e-3, "logit_scale_init_value": SCALE}
    cfg = load_config(
        None,
        {"output_dir": str(tmp_path), "image_size": IMAGE_SIZE, "model": model, "pretrain_clip": pc}
        | {"seed": 0, "num_threads": 1, "save_steps": 3},
    )
    rows, accelerator = train_split(data_dir), Accelerator()

    def killed(*args, **kwargs):  # the job dies at step 7 of 15
        real(*args, **kwargs, stop_after_steps=7)
        raise Killed

    real = phase.pretrain_clip
    monkeypatch.setattr(phase, "pretrain_clip", killed)
    with pytest.raises(Killed):
        phase.clip_init_for_run(rows, cfg, accelerator)
    monkeypatch.undo()
    assert "pre-training a CLIP of this size on the training split for 3 epochs" in capsys.readouterr().out

    init = phase.clip_init_for_run(rows, cfg, accelerator)
    out = capsys.readouterr().out
    assert "continuing the CLIP pre-training" in out and "step_6" in out and "pre-training a CLIP" not in out
    assert weights_digest(tmp_path / "clip-init" / "clip-hf") == weights_digest(uninterrupted / "clip-hf")
    assert (init / "config.json").is_file() and not (tmp_path / "clip-init" / "checkpoints").exists()
    assert json.loads((tmp_path / "clip-init" / "pretraining.json").read_text())["train_images"] == len(rows)

    made = (init / "model.safetensors").stat().st_mtime_ns
    assert phase.clip_init_for_run(rows, cfg, accelerator) == init
    out = capsys.readouterr().out
    assert "reusing the pre-trained CLIP init" in out and "pre-training a CLIP" not in out
    assert (init / "model.safetensors").stat().st_mtime_ns == made
    assert np.isfinite(epoch_losses(tmp_path / "clip-init")).all()
