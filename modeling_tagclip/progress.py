"""One progress style for every long phase (rendering, CLIP pre-training, fine-tuning, indexing).

On a terminal it is a tqdm bar, with a line kept above it at each epoch. Elsewhere (a log file, a pipe, CI) it
prints plain lines only: one per epoch and, between them, one every ``interval`` seconds, each with the time
left, so a log shows progress at least twice a minute and never a wall of carriage returns.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "duration", "line_buffered_output", "main_process"]


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def line_buffered_output() -> None:
    """Print each line of stdout as it is written, also into a pipe or a log file (not in 8 KiB blocks), so the
    order and timing of a command's lines are the same everywhere."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)


def main_process() -> bool:
    """Whether this is the main process of a launch (``RANK`` 0 or unset): the one that reports progress."""
    return os.environ.get("RANK", "0") == "0"


def _values(values: dict[str, Any]) -> str:
    return ", ".join(
        f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
        for key, value in values.items()
    )


class Progress:
    """Progress of ``total`` ``unit``s of the phase ``desc``, started ``initial`` units in (a resumed run);
    ``total=None``: a count without an end (frames of a stream). ``announce``: in a log, a first line with the
    work to do, so a phase shorter than ``interval`` is not silent until its end.

    ``update(n, **values)`` after each unit of work (``values``, e.g. the loss, are shown with it);
    ``epoch(index, epochs, **values)`` at the end of an epoch; ``write(text)`` for a message of the phase;
    ``close()`` at the end. ``enabled=False`` shows nothing (another process of a multi-process run).
    """

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str = "step",
        *,
        initial: int = 0,
        enabled: bool = True,
        announce: bool = False,
        interval: float = 30.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.total, self.unit, self.enabled = desc, total, unit, enabled
        self.done = self.initial = initial
        self.interval, self.clock = interval, clock
        self.stream = stream or sys.stderr
        self.start = self.last_line = clock()
        self.values: dict[str, Any] = {}
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=self.stream
            )
        elif announce and total is not None:
            self.write(f"{total - initial} {unit}s to do")

    def left(self) -> str:
        """The time left at the rate so far (``?`` before the first unit)."""
        rate = (self.done - self.initial) / max(self.clock() - self.start, 1e-9)
        return duration((self.total - self.done) / rate) if rate > 0 and self.total is not None else "?"

    def count(self) -> str:
        """``120/420 steps``, or ``120 frames`` without a total."""
        return (
            f"{self.done}/{self.total} {self.unit}s"
            if self.total is not None
            else f"{self.done} {self.unit}s"
        )

    def status(self) -> str:
        """``120/420 steps (29%), 58 s so far, about 2 min 25 s left[, values]``."""
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        text = f"{self.count()}{share}, {duration(self.clock() - self.start)} so far"
        text += f", about {self.left()} left" if self.total is not None else ""
        return f"{text}, {_values(self.values)}" if self.values else text

    def update(self, n: int = 1, **values: Any) -> None:
        """``n`` more units done; on a log, a status line when ``interval`` seconds passed since the last line."""
        self.done += n
        self.values.update(values)
        if self.bar is not None:
            self.bar.update(n)
            if values:
                self.bar.set_postfix(
                    {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in values.items()}
                )
        elif self.enabled and self.clock() - self.last_line >= self.interval:
            self.write(self.status())

    def epoch(self, index: int, epochs: int, **values: Any) -> None:
        """The line of the end of epoch ``index`` (0-based) of ``epochs``: its ``values`` and the time left."""
        shown = f", {_values(values)}" if values else ""
        self.write(
            f"epoch {index + 1}/{epochs} done{shown}, {duration(self.clock() - self.start)} so far, "
            f"about {self.left()} left"
        )

    def write(self, text: str) -> None:
        """``DESC: TEXT`` on its own line (above the bar on a terminal)."""
        if not self.enabled:
            return
        line = f"{self.desc}: {text}"
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)
        self.last_line = self.clock()

    def close(self) -> None:
        """End the bar; on a log, a last line with the total time."""
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.write(f"{self.count()} in {duration(self.clock() - self.start)}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
