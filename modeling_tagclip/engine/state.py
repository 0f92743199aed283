"""Trainer state saved with every checkpoint, as JSON (never pickled)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass
class TrainState:
    """Counters of a run. ``sampler`` is the JSON state of a stateful batch sampler (ViSA), else ``None``."""

    step: int = 0
    steps_per_epoch: int = 0
    best_metric: float = -1.0
    best_step: int = -1
    last_eval_step: int = -1
    train_time_s: float = 0.0
    sampler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = field(default=None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str | Path = "trainer state") -> TrainState:
        """Parse; unknown or missing keys are errors naming the file."""
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            extra = sorted(set(data) - known) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{source}: not a trainer state (unexpected {extra})")
        return cls(**data)
