"""The training loop shared by both families: epochs, progress, checkpoints, model selection, final evaluation.

A family plugs in through a ``Task`` (``tasks/tagclip.py``, ``tasks/visa.py``; ``tasks/clip_pretraining.py``, the
plain-CLIP phase before a TAG-CLIP run from scratch): data, model, optimiser, one step's loss, validation, saving
``best/`` and the final test evaluation. Resume is step-exact: the loop replays the same batches
(epoch-addressable samplers) with the same per-step seeds.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from modeling_tagclip.engine.accelerator import make_accelerator, seed_step
from modeling_tagclip.engine.checkpoint import load_checkpoint, read_state, save_checkpoint, select_checkpoint
from modeling_tagclip.engine.config import TrainArguments
from modeling_tagclip.engine.state import TrainState
from modeling_tagclip.progress import Progress

logger = logging.getLogger(__name__)
TEST_SELECTION_NOTE = "model selected on the TEST split each epoch (reference protocol; optimistic)"


class Task(Protocol):
    """What a model family provides to the loop."""

    cfg: TrainArguments
    project: str
    phase: str  # the progress lines' name: "fine-tuning", "pre-training CLIP"

    def prepare(self) -> None: ...  # load / render data (main process first)
    def has_validation(self) -> bool: ...
    def build_model(self, accelerator) -> torch.nn.Module: ...
    def build_optimizer(self, model) -> torch.optim.Optimizer: ...
    def build_loader(self) -> torch.utils.data.DataLoader: ...
    def set_epoch(self, epoch: int) -> None: ...
    def sampler_state(self) -> dict | None: ...
    def load_sampler_state(self, state: dict) -> None: ...
    def set_learning_rate(
        self, optimizer, step: int, epoch: int, steps_per_epoch: int, total: int
    ) -> float: ...
    def training_step(self, model, batch, step: int, epoch: int, steps_per_epoch: int, accelerator): ...
    def clip_gradients(self, accelerator, model) -> None: ...
    def evaluate(self, model, split: str) -> dict[str, Any]: ...  # "metric" + named metrics
    def save_best(self, accelerator, model) -> Path: ...  # main process
    def final_evaluation(self, extra: dict[str, Any]) -> dict[str, Any]: ...  # main process
    def summary(self) -> dict[str, Any]: ...


@dataclass
class Run:
    task: Task
    accelerator: Any
    model: Any
    optimizer: Any
    loader: Any
    state: TrainState
    total_steps: int
    epochs: int
    selection: str
    clock_start: float
    time_before: float

    @property
    def cfg(self) -> TrainArguments:
        return self.task.cfg

    def train_time(self) -> float:
        return self.time_before + time.time() - self.clock_start


def selection_mode(cfg: TrainArguments, has_validation: bool) -> str:
    """``validation`` needs a held-out split; without one (validation_fraction 0) the last epoch is selected."""
    if cfg.model_selection == "validation" and not has_validation:
        logger.info("no validation split (validation_fraction 0): the last evaluated epoch is kept as best/")
        return "last"
    return cfg.model_selection


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torch_threads(cfg: TrainArguments, num_processes: int) -> int:
    """Intra-op threads per process: ``num_threads``, else the usable cores shared by the processes.

    Set explicitly because ``accelerate launch`` exports ``OMP_NUM_THREADS=1`` unless it is set, and float
    reductions (so the metrics) depend on the thread count.
    """
    return cfg.num_threads or max(1, usable_cores() // num_processes)


def setup(task: Task, resume: str | None, inside_run: bool = False) -> Run:
    cfg = task.cfg
    resume_dir = select_checkpoint(cfg.output_dir, resume)
    accelerator = make_accelerator(
        cfg.mixed_precision,
        cfg.output_dir,
        read_state(resume_dir).step if resume_dir else None,
        task.project,
        asdict(cfg),
    )
    torch.set_num_threads(torch_threads(cfg, accelerator.num_processes))
    if not inside_run:  # a phase inside a run: the run has said it
        accelerator.print(f"torch threads: {torch.get_num_threads()} per process")
    with accelerator.main_process_first():
        task.prepare()
    model = task.build_model(accelerator)
    optimizer = task.build_optimizer(model)
    loader = task.build_loader()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps_per_epoch = len(loader)
    total = cfg.max_steps if cfg.max_steps > 0 else cfg.num_train_epochs * steps_per_epoch
    state = TrainState(steps_per_epoch=steps_per_epoch)
    if resume_dir is not None:
        accelerator.print(f"resuming from {resume_dir}")
        state = load_checkpoint(resume_dir, accelerator, model, optimizer)
        if state.steps_per_epoch != steps_per_epoch:
            raise ValueError(
                f"checkpoint has {state.steps_per_epoch} steps per epoch, this run {steps_per_epoch}: "
                "resume with the same data, batch size and number of processes"
            )
        if state.sampler is not None:
            task.load_sampler_state(state.sampler)
    elif resume:
        accelerator.print(f"no checkpoint in {cfg.output_dir}/checkpoints: starting from scratch")
    epochs = -(-total // steps_per_epoch)
    selection = selection_mode(cfg, task.has_validation())
    return Run(
        task,
        accelerator,
        model,
        optimizer,
        loader,
        state,
        total,
        epochs,
        selection,
        time.time(),
        state.train_time_s,
    )


def checkpoint(run: Run) -> None:
    state = run.state
    state.sampler = run.task.sampler_state()
    state.train_time_s = round(run.train_time(), 1)
    scaler = run.accelerator.scaler
    state.scaler = scaler.state_dict() if scaler is not None else None
    save_checkpoint(
        run.accelerator, run.model, run.optimizer, state, run.cfg.output_dir, run.cfg.save_total_limit
    )


def train_step(run: Run, batch, epoch: int) -> dict | None:
    """One optimisation step; returns the logged record on logging steps."""
    task, state, accelerator = run.task, run.state, run.accelerator
    spe = state.steps_per_epoch
    lr = task.set_learning_rate(run.optimizer, state.step, epoch, spe, run.total_steps)
    seed_step(run.cfg.seed, state.step, accelerator.process_index)
    loss, logs = task.training_step(run.model, batch, state.step, epoch, spe, accelerator)
    if loss.requires_grad:  # a gradient-caching step has back-propagated itself and returns a detached loss
        accelerator.backward(loss)
    task.clip_gradients(accelerator, run.model)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    if state.step % run.cfg.logging_steps and state.step != 1:
        return None
    keys = sorted(logs)
    reduced = accelerator.reduce(torch.stack([logs[k].float() for k in keys]).to(accelerator.device), "mean")
    record = {k: float(v) for k, v in zip(keys, reduced.tolist(), strict=True)}
    record.setdefault("loss", float(accelerator.reduce(loss.detach().float(), "mean")))
    record.update({"kind": "train", "lr": lr, "epoch": epoch})
    accelerator.log(record, step=state.step)
    return record


def train_epoch(run: Run, epoch: int, progress, stop_after_steps: int | None) -> bool:
    """Train one epoch (skipping the batches a resumed checkpoint already saw); True if stopped early."""
    state, cfg = run.state, run.cfg
    skip = state.step - epoch * state.steps_per_epoch
    run.task.set_epoch(epoch)
    run.loader.set_epoch(epoch)
    loader = run.accelerator.skip_first_batches(run.loader, skip) if skip else run.loader
    epoch_end = min((epoch + 1) * state.steps_per_epoch, run.total_steps)
    run.model.train()
    losses = []
    for batch in loader:
        if state.step >= epoch_end:
            break
        record = train_step(run, batch, epoch)
        if progress is not None:
            shown = {} if record is None else {"loss": record["loss"], "lr": record["lr"]}
            losses += [record["loss"]] if record is not None else []
            progress.update(1, **shown)
        if cfg.save_steps and state.step % cfg.save_steps == 0 and state.step != epoch_end:
            checkpoint(run)
        if stop_after_steps is not None and state.step >= stop_after_steps:
            return True
    if progress is not None:
        progress.epoch(epoch, run.epochs, **({"mean loss": sum(losses) / len(losses)} if losses else {}))
    if (epoch + 1) % cfg.eval_every_epochs == 0 or state.step >= run.total_steps:
        evaluate_and_select(run, epoch)
    checkpoint(run)
    return False


def evaluate_and_select(run: Run, epoch: int) -> None:
    """Evaluate (validation / test split, or nothing for ``last``); save ``best/`` when the metric improves."""
    from accelerate.utils import broadcast_object_list

    accelerator, state, task = run.accelerator, run.state, run.task
    metric = float(state.step)  # "last": every evaluation point improves
    if accelerator.is_main_process and run.selection != "last":
        split = "test" if run.selection == "test" else "validation"
        metrics = task.evaluate(accelerator.unwrap_model(run.model, keep_torch_compile=False), split)
        metric = float(metrics["metric"])
        kind = "test_selection" if split == "test" else "validation"
        accelerator.log({"kind": kind, "epoch": epoch, **metrics}, step=state.step)
        shown = "  ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k != "metric")
        label = "TEST (model selection)" if split == "test" else "validation"
        accelerator.print(f"epoch {epoch} step {state.step}: {label} {shown}")
    metric = broadcast_object_list([metric])[0]
    if metric > state.best_metric:  # ties keep the earlier model
        state.best_metric, state.best_step = metric, state.step
        if accelerator.is_main_process:
            task.save_best(accelerator, run.model)
    state.last_eval_step = state.step
    accelerator.wait_for_everyone()


def finish(run: Run) -> dict[str, Any] | None:
    """Select on the final weights if not done yet, then evaluate ``best/`` on the test split (main process)."""
    state, accelerator = run.state, run.accelerator
    if state.last_eval_step != state.step:
        evaluate_and_select(run, run.epochs - 1)
        checkpoint(run)
    result = None
    if accelerator.is_main_process:
        extra = {
            **run.task.summary(),
            "best_step": state.best_step,
            "best_metric": state.best_metric,
            "model_selection": TEST_SELECTION_NOTE if run.selection == "test" else run.selection,
            "train_time_s": round(run.train_time(), 1),
            "num_processes": accelerator.num_processes,
            "torch_threads": torch.get_num_threads(),
        }
        result = run.task.final_evaluation(extra)
    accelerator.wait_for_everyone()
    return result


def shutdown(run: Run, inside_run: bool = False) -> None:
    """Drop the DDP-wrapped model before ``end_training`` destroys the process group (only the trackers end for a
    phase ``inside_run``: the run goes on with the process group).

    A gloo ``Reducer`` freed after ``destroy_process_group`` can deadlock in ``~ProcessGroupGloo`` at exit.
    """
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    run.model = run.optimizer = run.loader = None
    accelerator.free_memory()
    gc.collect()
    if inside_run:
        for tracker in accelerator.trackers:
            tracker.finish()
    else:
        accelerator.end_training()


def progress_bar(phase: str, main: bool, total: int, initial: int) -> Progress | None:
    """The phase's progress (steps, the loss, a line per epoch) on the main process."""
    return Progress(phase, total, "step", initial=initial) if main else None


def train(
    task: Task,
    resume: str | None = None,
    stop_after_steps: int | None = None,
    inside_run: bool = False,
) -> dict[str, Any] | None:
    """Run training and the final evaluation of ``best/``; returns its results on the main process.

    ``inside_run``: a phase inside another run of this process (CLIP pre-training inside a TAG-CLIP run), which
    has printed its thread count and goes on with the process group.
    """
    threads = torch.get_num_threads()
    try:
        return _train(task, resume, stop_after_steps, inside_run)
    finally:
        torch.set_num_threads(threads)  # a caller's setting is back after an in-process run


def _train(
    task: Task, resume: str | None, stop_after_steps: int | None, inside_run: bool
) -> dict[str, Any] | None:
    run = setup(task, resume, inside_run)
    progress = progress_bar(task.phase, run.accelerator.is_main_process, run.total_steps, run.state.step)
    interrupted = False
    for epoch in range(run.state.step // run.state.steps_per_epoch, run.epochs):
        interrupted = train_epoch(run, epoch, progress, stop_after_steps)
        if interrupted:
            break
    if progress is not None:
        progress.close()
    result = None
    if interrupted:
        run.accelerator.print(f"stopped after step {run.state.step} (--stop-after-steps)")
    else:
        result = finish(run)
    shutdown(run, inside_run)
    return result
