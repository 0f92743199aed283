"""Metric records as JSON lines (``metrics.jsonl``), an accelerate tracker."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.tracking import GeneralTracker

from modeling_tagclip.atomic_io import write_json


def plain(value: Any) -> Any:
    """A JSON-ready scalar from a tensor / numpy scalar."""
    if isinstance(value, (torch.Tensor, np.generic)):
        return value.item()
    return value


class JsonlTracker(GeneralTracker):
    """Appends ``{"step": N, ...}`` records; on resume drops the records after the restored step."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, path: str | os.PathLike, keep_until_step: int | None = None):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_until_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in kept if json.loads(ln).get("step", 0) <= keep_until_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        write_json(self.path.parent / "config.json", values, indent=2, default=str, allow_nan=True)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        record = {"step": step, **{k: plain(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_records(path: str | os.PathLike, kind: str = "train") -> dict[int, dict]:
    """Records of one ``kind`` by step."""
    lines = Path(path).read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r.get("kind") == kind}
