"""Progress: one style for long phases; plain lines (one per epoch, one per interval, with the time left) in a log,
and the README's main job shows them from its first seconds."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import TINY_TRAIN_ARGS

from modeling_tagclip.progress import Progress, duration

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_duration_reads_as_time():
    assert [duration(s) for s in (0, 42.4, 65, 3725)] == ["0 s", "42 s", "1 min 05 s", "1 h 02 min"]


def test_a_log_gets_a_line_per_epoch_and_per_interval_with_the_time_left():
    clock, log = Clock(), io.StringIO()  # a StringIO is not a terminal: plain lines
    progress = Progress("fine-tuning", 40, "step", interval=30.0, stream=log, clock=clock)
    for _ in range(10):  # 10 steps of 2 s: 20 s, under the interval
        clock.now += 2
        progress.update(loss=1.5)
    assert log.getvalue() == ""
    clock.now += 10
    progress.update(loss=1.25)  # 11 steps in 30 s: 29 left at 30/11 s each
    progress.epoch(0, 4, loss=1.3)
    clock.now += 5
    progress.close()
    assert log.getvalue().splitlines() == [
        "fine-tuning: 11/40 steps (28%), 30 s so far, about 1 min 19 s left, loss 1.25",
        "fine-tuning: epoch 1/4 done, loss 1.3, 30 s so far, about 1 min 19 s left",
        "fine-tuning: 11/40 steps in 35 s",
    ]


def test_a_resumed_phase_counts_the_time_left_from_its_own_rate():
    clock, log = Clock(), io.StringIO()
    progress = Progress("fine-tuning", 100, initial=90, interval=0.0, stream=log, clock=clock)
    clock.now += 10
    progress.update(5)  # 5 steps in 10 s since the resume: 5 left, 10 s
    assert log.getvalue() == "fine-tuning: 95/100 steps (95%), 10 s so far, about 10 s left\n"


def test_a_disabled_progress_prints_nothing():
    log = io.StringIO()
    progress = Progress("rendering", 3, enabled=False, interval=0.0, stream=log)
    progress.update()
    progress.epoch(0, 1)
    progress.write("x")
    progress.close()
    assert log.getvalue() == ""


TINY_MAIN_JOB = [
    *TINY_TRAIN_ARGS,
    "--num-train-epochs",
    "1",
    "--set",
    "pretrain_clip.epochs=1",
    "--num-threads",
    "1",
]


def _timed_lines(args: list[str], cwd: Path) -> list[tuple[float, str]]:
    """(seconds since the start, line) of each line ``training/train.py ARGS`` prints (stdout and stderr), and
    (seconds, "<exit N>") last."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "training" / "train.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    lines.append((time.monotonic() - start, f"<exit {proc.wait(timeout=600)}>"))
    return lines


@pytest.mark.slow
def test_the_main_job_shows_progress_at_once_and_every_minute_and_a_resume_reuses_its_clip(tmp_path):
    lines = _timed_lines([*TINY_MAIN_JOB, "--output_dir", "out"], tmp_path)
    text = "\n".join(line for _, line in lines)
    assert lines[-1][1] == "<exit 0>", text[-3000:]
    assert lines[0][0] < 10, f"first line after {lines[0][0]:.1f} s: {lines[0][1]}"
    gaps = [(later - earlier, line) for (earlier, _), (later, line) in zip(lines, lines[1:], strict=False)]
    assert max(gaps)[0] < 60, f"{max(gaps)[0]:.1f} s without output before {max(gaps)[1]!r}"
    for expected in (
        "rendering the synthetic set into data/synthetic (once): 12 identities",
        "pre-training a CLIP of this size on the training split for 1 epochs",
        "pre-training CLIP: epoch 1/1 done, mean loss ",
        "fine-tuning: epoch 1/1 done, mean loss ",
    ):
        assert expected in text, expected
    assert "INFO " not in text and "{'" not in text and "\r" not in text  # user-facing lines, no raw records

    again = "\n".join(line for _, line in _timed_lines([*TINY_MAIN_JOB, "--output_dir", "out"], tmp_path))
    assert (
        "reusing the pre-trained CLIP init in out/clip-init" in again and "pre-training a CLIP" not in again
    )
    assert "rendering" not in again


def test_an_announced_phase_says_its_work_first_and_a_count_without_end_has_no_time_left():
    clock, log = Clock(), io.StringIO()
    with Progress("encoding images", 7, "image", announce=True, interval=0.0, stream=log, clock=clock) as bar:
        clock.now += 2
        bar.update(4)
    with Progress("tracking gate.mp4", None, "frame", interval=10.0, stream=log, clock=clock) as bar:
        for _ in range(6):
            clock.now += 2
            bar.update()
    assert log.getvalue().splitlines() == [
        "encoding images: 7 images to do",
        "encoding images: 4/7 images (57%), 2 s so far, about 2 s left",
        "encoding images: 4/7 images in 2 s",
        "tracking gate.mp4: 5 frames, 10 s so far",
        "tracking gate.mp4: 6 frames in 12 s",
    ]
