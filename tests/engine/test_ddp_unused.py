"""DDP without ``find_unused_parameters``: a step's unused parameters (idle experts, heads of switched-off losses)
join the graph with a zero gradient (``engine.accelerator.UnusedParameters``); loss and gradients are unchanged,
and a parameter no rank used ends the step with no gradient, as under ``find_unused_parameters=True``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import EXACT_TRAIN as EXACT
from fixtures import REPO_ROOT as ROOT
from fixtures import TRAIN_SCRIPT as TRAIN
from fixtures import (
    VISA_LABELS,
    VISA_VIEWS,
    records,
    render_train_set,
    run_train,
    tiny_config,
    tiny_visa_config,
    train_inputs,
    visa_pixels,
)
from fixtures import free_port as _free_port
from fixtures import train_env as _env
from safetensors.torch import load_file

from modeling_tagclip import TagClipModel
from modeling_tagclip.engine.accelerator import UnusedParameters, reached_leaves, touch_parameters
from modeling_tagclip.engine.checkpoint import checkpoint_dirs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
HEADS_OFF = {
    "use_view_loss": False,
    "use_id_loss": False,
}  # img_router (argmax routing) and classifier unused


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _step(model, inputs: dict, touch: bool) -> torch.Tensor:
    """One forward/backward with a fixed RNG (router noise); with ``touch`` the unreached parameters are attached."""
    torch.manual_seed(7)
    loss = model(**inputs).loss
    if touch:
        reached = reached_leaves(loss)
        unused = [p for p in model.parameters() if p.requires_grad and id(p) not in reached]
        loss = touch_parameters(loss, unused)
    loss.backward()
    return loss.detach()


def _compare_touched_with_plain(model, inputs: dict) -> list[str]:
    """Loss and gradients bit-identical with and without the touch; returns the names the touch zero-filled."""
    plain, touched = model.train(), copy.deepcopy(model).train()
    loss = _step(plain, inputs, touch=False)
    loss_touched = _step(touched, inputs, touch=True)
    assert torch.equal(_bits(loss), _bits(loss_touched))
    zero_filled = []
    for (name, p), q in zip(plain.named_parameters(), touched.parameters(), strict=True):
        if not p.requires_grad:  # e.g. the BNNeck biases (frozen, as in fast-reid)
            continue
        assert q.grad is not None, f"{name}: no gradient after the touched backward"
        if p.grad is None:
            assert not q.grad.any(), name
            zero_filled.append(name)
        else:
            assert torch.equal(_bits(p.grad), _bits(q.grad)), name
    return zero_filled


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return render_train_set(tmp_path_factory.mktemp("synthetic"), identities=128)  # 96 training identities


def test_tagclip_step_with_switched_off_heads_touches_every_parameter_and_changes_nothing():
    torch.manual_seed(0)
    model = TagClipModel(tiny_config(vision={"router_noise_std": 0.01}, **HEADS_OFF))
    zero_filled = set(_compare_touched_with_plain(model, train_inputs()))
    heads = {
        f"vision_model.encoder.layers.{i}.mlp.img_router.{w}" for i in (1, 2) for w in ("weight", "bias")
    }
    heads |= {"classifier.weight", "classifier.bias"}
    assert heads <= zero_filled
    # on the CPU each expert runs on its own tokens: an expert no token was routed to is unused too
    assert all(".mlp.experts." in name for name in zero_filled - heads), sorted(zero_filled - heads)


def test_visa_step_reaches_every_parameter_and_touch_changes_nothing():
    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID

    torch.manual_seed(0)
    model = ViSAForReID(tiny_visa_config(drop_path_rate=0.1))
    inputs = {"pixel_values": visa_pixels(), "view_labels": VISA_VIEWS, "labels": VISA_LABELS}
    assert _compare_touched_with_plain(model, inputs) == []  # experts run on empty slices: all in the graph


def test_one_process_is_a_no_op():
    torch.manual_seed(0)
    model = TagClipModel(tiny_config(**HEADS_OFF)).train()
    loss = model(**train_inputs()).loss
    unused = UnusedParameters()
    assert unused.touch(loss, model) is loss  # no process group: the loss object itself
    unused.release()


# ----------------------------------------------------------------------------- 2 gloo processes, toy experts


class _Experts(torch.nn.Module):
    """Three experts; a step runs one of them (expert 2 never): idle experts per rank and everywhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](x).square().mean()


def _grads(model) -> dict[str, list | None]:
    return {
        n: None if p.grad is None else p.grad.flatten().tolist() for n, p in model.module.named_parameters()
    }


def _ddp_steps(rank: int, mode: str) -> list[dict]:
    """Two steps of DDP on rank-dependent experts; the gradients after each step."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_Experts(), find_unused_parameters=mode == "find_unused")
    unused, steps = UnusedParameters(), []
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x, expert=(rank + step) % 2)  # step 0: rank r runs expert r; step 1: the other one
        if mode == "touch":
            loss = unused.touch(loss, model)
        loss.backward()
        before = all(p.grad is not None for p in model.parameters())
        unused.release()
        steps.append({"grads": _grads(model), "all_before_release": before})
        model.zero_grad(set_to_none=True)
    return steps


def _worker(rank: int, folder: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    torch.set_num_threads(1)
    result = {mode: _ddp_steps(rank, mode) for mode in ("find_unused", "touch")}
    try:
        _ddp_steps(rank, "plain")  # the control: default DDP, nothing touched
        result["plain_error"] = ""
    except RuntimeError as error:
        result["plain_error"] = str(error)
    with open(f"{folder}/rank{rank}.json", "w") as handle:
        json.dump(result, handle)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_with_idle_experts_match_find_unused_parameters(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "Expected to have finished reduction" in result["plain_error"]  # without the touch DDP fails
        for reference, touched in zip(result["find_unused"], result["touch"], strict=True):
            assert touched["all_before_release"]
            assert touched["grads"] == reference["grads"]  # same values, same None pattern
            assert reference["grads"]["experts.2.weight"] is None  # no rank used it: no gradient
            assert reference["grads"]["experts.0.weight"] is not None  # one rank used it: the mean


# ----------------------------------------------------------------------------- the real launcher, both families


def _launcher() -> list[str]:
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
    ]


@pytest.mark.slow
def test_two_processes_with_unused_heads_train_like_one_process(tmp_path, data_dir):
    """Default DDP (find_unused_parameters=False), a model whose img_router and classifier get no gradient:
    3 steps run; losses as one process; the unused heads are not updated (no weight decay) in either run."""
    cfg = {**EXACT, "data_dir": str(data_dir), "save_steps": 2}
    cfg["model"] = {**EXACT["model"], **HEADS_OFF}
    run_train(tmp_path, "one", {**cfg, "per_device_batch_size": 16}, "--stop_after_steps", "3")
    os.environ["ACCELERATE_USE_CPU"] = "1"
    try:
        run_train(
            tmp_path,
            "two",
            {**cfg, "per_device_batch_size": 8},
            "--stop_after_steps",
            "3",
            launcher=_launcher(),
        )
    finally:
        os.environ.pop("ACCELERATE_USE_CPU")
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    for step in (1, 2, 3):
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-4), step
    weights = [
        load_file(checkpoint_dirs(tmp_path / name)[-1] / "model.safetensors") for name in ("one", "two")
    ]
    heads = [k for k in weights[0] if "img_router" in k or k.startswith("classifier.")]
    assert len(heads) == 4
    for key in heads:  # with a zero gradient AdamW would decay the weights in the 2-process run
        assert torch.equal(weights[0][key], weights[1][key]), key


@pytest.mark.slow
def test_visa_trains_on_two_processes_without_find_unused_parameters(tmp_path):
    from fixtures import TINY_VISA_TRAIN as TINY_MODEL

    from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

    generate_reid_dataset(tmp_path / "data", num_identities=24, image_size=(32, 16), progress=False)
    args = [
        "--task",
        "reid",
        "--data_dir",
        str(tmp_path / "data"),
        "--output_dir",
        str(tmp_path / "out"),
        "--model",
        json.dumps(TINY_MODEL),
        "--per_device_batch_size",
        "8",
        "--stop_after_steps",
        "3",
    ]
    env = {**_env(), "ACCELERATE_USE_CPU": "1"}
    proc = subprocess.run(
        [*_launcher(), str(TRAIN), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = records(tmp_path / "out")
    assert sorted(steps) == [1, 2, 3] and all(0 < steps[s]["loss"] < 100 for s in steps)
