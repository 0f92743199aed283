"""The shared training engine: trainer state, checkpoints (atomic, verified, no pickle), samplers, and
step-exact resume of both families (N steps straight == N/2 steps + resume, loss by loss)."""

import errno
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from fixtures import OneProcess, model_and_optimizer, optimizer_steps

from modeling_tagclip.engine import checkpoint as ckpt
from modeling_tagclip.engine.samplers import EpochSampler, IdentityBatchSampler
from modeling_tagclip.engine.state import TrainState
from modeling_tagclip.engine.tracker import read_records

# ----------------------------------------------------------------------------- state and checkpoint files


def test_train_state_round_trips_as_json_and_rejects_other_files():
    state = TrainState(
        step=7, steps_per_epoch=3, best_metric=12.5, sampler={"epoch": 2, "stream": {"drawn": 5}}
    )
    assert TrainState.from_json(state.to_json()) == state
    with pytest.raises(ValueError, match="not a trainer state.*'weights'"):
        TrainState.from_json(json.dumps({"step": 1, "weights": []}), "x.json")


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_checkpoint_restores_model_and_optimizer_exactly(tmp_path, kind):
    model, opt = model_and_optimizer(kind)
    optimizer_steps(model, opt, 3)
    state = TrainState(step=3, steps_per_epoch=3)
    folder = ckpt.save_checkpoint(OneProcess(), model, opt, state, tmp_path, keep=2)
    assert folder == tmp_path / "checkpoints" / "step_3" and ckpt.verify_checkpoint(folder) is None
    expected = optimizer_steps(model, opt, 4, seed=2)

    fresh, fresh_opt = model_and_optimizer(kind)
    restored = ckpt.load_checkpoint(folder, OneProcess(), fresh, fresh_opt)
    assert restored == state
    assert (
        optimizer_steps(fresh, fresh_opt, 4, seed=2) == expected
    )  # weights, BN buffers and moments all restored


def test_checkpoint_holds_no_pickle_and_a_planted_pickle_is_never_loaded(tmp_path):
    model, opt = model_and_optimizer()
    optimizer_steps(model, opt, 1)
    folder = ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=1), tmp_path, keep=2)
    for path in folder.iterdir():
        head = path.read_bytes()[:2]
        assert head not in (b"\x80\x02", b"\x80\x04", b"PK"), f"{path.name} is a pickle / torch.save file"

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin"):
        (folder / name).write_bytes(pickle.dumps(Payload()))
    assert ckpt.verify_checkpoint(folder) is None  # extra files are not part of the checkpoint
    fresh, fresh_opt = model_and_optimizer()
    ckpt.load_checkpoint(ckpt.select_checkpoint(tmp_path, "latest"), OneProcess(), fresh, fresh_opt)
    assert not marker.exists()


def test_rotation_keeps_the_newest_and_never_lists_temporary_folders(tmp_path):
    model, opt = model_and_optimizer()
    for step in (2, 4, 6):
        ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=step), tmp_path, keep=2)
    (tmp_path / "checkpoints" / ".tmp_step_8").mkdir()
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["step_4", "step_6"]


def test_disk_full_during_save_leaves_no_partial_folder_and_keeps_older_checkpoints(tmp_path, monkeypatch):
    model, opt = model_and_optimizer()
    ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=2), tmp_path, keep=2)
    real = ckpt.write_checkpoint_files

    def full_disk(folder, *args):
        real(folder, *args)  # files half written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_checkpoint_files", full_disk)
    with pytest.raises(ckpt.CheckpointError, match=r"step_4.*No space left on device"):
        ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=4), tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert ckpt.select_checkpoint(tmp_path, "latest").name == "step_2"


def test_corrupt_latest_checkpoint_falls_back_to_the_newest_that_verifies(tmp_path, caplog):
    model, opt = model_and_optimizer()
    for step in (2, 4):
        ckpt.save_checkpoint(OneProcess(), model, opt, TrainState(step=step), tmp_path, keep=3)
    newest = tmp_path / "checkpoints" / "step_4"
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert ckpt.select_checkpoint(tmp_path, "latest").name == "step_2"
    assert "step_4 is unusable (model.safetensors does not match its checksum)" in caplog.text
    with pytest.raises(ckpt.CheckpointError, match="step_4 is unusable"):
        ckpt.select_checkpoint(tmp_path, str(newest))
    (newest / "manifest.json").unlink()
    assert "manifest.json" in ckpt.verify_checkpoint(newest)
    assert ckpt.select_checkpoint(tmp_path, None) is None


# ----------------------------------------------------------------------------- samplers


def test_epoch_sampler_is_a_function_of_seed_and_epoch():
    a, b = EpochSampler(10, seed=3), EpochSampler(10, seed=3)
    a.set_epoch(2), b.set_epoch(2)
    assert list(a) == list(b) and sorted(a) == [(i, 2) for i in range(10)]  # items carry their epoch
    b.set_epoch(3)
    assert [i for i, _ in a] != [i for i, _ in b]


def _identity_ids() -> list[int]:
    rng = np.random.default_rng(0)
    return [int(i) for i in rng.integers(0, 12, 90)] + [12, 13]  # 12, 13: fewer than K images


def test_identity_sampler_draws_the_reference_stream():
    """Same batches as data.reid.IdentityBatchSampler (fast-reid NaiveIdentitySampler), across epochs."""
    from modeling_tagclip.data.reid import IdentityBatchSampler as Reference

    ids = _identity_ids()
    ours, ref = IdentityBatchSampler(ids, 12, 4, seed=5), Reference(ids, 12, 4, seed=5)
    for epoch in range(3):
        ours.set_epoch(epoch)
        batches = [[index for index, _ in batch] for batch in ours]
        assert batches == list(ref), epoch
        for batch in batches:
            counts = np.unique(np.asarray(ids)[batch], return_counts=True)[1]
            assert len(counts) == 3 and set(counts) == {4}


def test_identity_sampler_state_restores_the_stream_mid_run():
    ids = _identity_ids()
    straight = IdentityBatchSampler(ids, 12, 4, seed=5)
    epochs = []
    for epoch in range(4):
        straight.set_epoch(epoch)
        epochs.append(list(straight))
        if epoch == 1:
            saved = json.loads(json.dumps(straight.state_dict()))  # what a checkpoint stores
    resumed = IdentityBatchSampler(ids, 12, 4, seed=5)
    resumed.load_state_dict(saved)
    assert list(resumed) == epochs[1]  # iterating an epoch again replays it (skip_first_batches)
    resumed.set_epoch(3)
    assert list(resumed) == epochs[3]
    draws = [d for batch in epochs[3] for _, d in batch]
    assert draws == list(range(draws[0], draws[0] + len(draws)))  # every sample numbered once
    with pytest.raises(ValueError, match="cannot go back"):
        resumed.set_epoch(1)


# ----------------------------------------------------------------------------- step-exact resume, both families

TAGCLIP_TINY = {
    "image_size": [64, 32],
    "synthetic": None,
    "model": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 16,
            "moe_layers": [1],
            "routing": "gumbel",
        },
        "text_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        },
        "projection_dim": 32,
        "tse_embed_dim": 32,
    },
    "per_device_batch_size": 24,
    "learning_rate": 1.0e-3,
    "warmup_epochs": 0.5,
    "freeze_patch_embedding": False,
    "text_max_length": 48,
    "save_steps": 3,
    "max_steps": 12,
    "plots": False,
    "eval_batch_size": 64,
}
VISA_TINY = {
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
    "drop_path_rate": 0.1,
}


@pytest.fixture(scope="module")
def tagclip_data(tmp_path_factory) -> Path:
    from modeling_tagclip.data.synthetic import generate_dataset

    out = tmp_path_factory.mktemp("synthetic")
    generate_dataset(out, num_identities=48, seed=0, image_size=(64, 32), progress=False)
    return out


@pytest.fixture(scope="module")
def reid_data(tmp_path_factory) -> Path:
    from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

    out = tmp_path_factory.mktemp("reid")
    generate_reid_dataset(out, num_identities=32, image_size=(32, 16), progress=False)
    return out


def _train(argv: list[str]) -> dict | None:
    from training.train import main

    return main(argv)


def _assert_resume_is_step_exact(tmp_path: Path, argv: list[str]) -> None:
    """Train straight; then stop mid-epoch after half the steps, resume from the last checkpoint, compare."""
    _train([*argv, "--output_dir", str(tmp_path / "full")])
    total = max(read_records(tmp_path / "full" / "metrics.jsonl"))
    stop = total // 2 + 1
    _train([*argv, "--output_dir", str(tmp_path / "crash"), "--stop_after_steps", str(stop)])
    saved = ckpt.checkpoint_dirs(tmp_path / "crash")[-1].name
    assert saved != f"step_{stop}" and not (tmp_path / "crash" / "eval_results.json").exists()
    _train([*argv, "--output_dir", str(tmp_path / "crash"), "--resume_from_checkpoint", "latest"])
    full, resumed = (
        read_records(tmp_path / "full" / "metrics.jsonl"),
        read_records(tmp_path / "crash" / "metrics.jsonl"),
    )
    assert sorted(full) == sorted(resumed) == list(range(1, total + 1))
    assert max(r["epoch"] for r in full.values()) >= 1  # the run crosses epochs
    for step in full:
        assert resumed[step]["loss"] == full[step]["loss"], step  # bit-equal, step by step
        assert resumed[step]["lr"] == full[step]["lr"]
    assert len({full[s]["loss"] for s in full}) == total  # the losses do change


@pytest.mark.slow
def test_tagclip_resume_is_step_exact(tmp_path, tagclip_data, one_thread):
    import yaml

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({**TAGCLIP_TINY, "data_dir": str(tagclip_data)}))
    argv = ["--config", str(recipe), "--validation_fraction", "0", "--model_selection", "test"]
    _assert_resume_is_step_exact(tmp_path, argv)
    out = tmp_path / "crash"
    best = json.loads((out / "best" / "config.json").read_text())
    assert best["vision_config"]["routing"] == "argmax"  # trained with gumbel, saved for deterministic use
    result = json.loads((out / "eval_results.json").read_text())
    assert "TEST split" in result["model_selection"] and read_records(out / "metrics.jsonl", "test_selection")
    assert result["validation_images"] == 0 and result["train_time_s"] > 0
    _train([*argv, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])  # a finished run
    again = json.loads((out / "eval_results.json").read_text())
    assert again["train_time_s"] >= result["train_time_s"] > 0  # kept, not reset to 0 (a load-free check)
    assert again["R@1"] == result["R@1"]


@pytest.mark.slow
def test_visa_resume_is_step_exact(tmp_path, reid_data, one_thread):
    argv = [
        "--task",
        "reid",
        "--data_dir",
        str(reid_data),
        "--model",
        json.dumps(VISA_TINY),
        "--per_device_batch_size",
        "16",
        "--num_train_epochs",
        "4",
        "--eval_every_epochs",
        "2",
        "--random_erasing",
        "0.5",
        "--warmup_iters",
        "4",
        "--save_steps",
        "3",
    ]
    _assert_resume_is_step_exact(tmp_path, argv)
