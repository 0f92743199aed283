"""Results files are written atomically: a full disk (or a crash) mid-write leaves the previous file whole."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from modeling_tagclip import atomic_io
from modeling_tagclip.engine.tracker import JsonlTracker
from modeling_tagclip.evaluation import text_retrieval

OLD = '{"R@1": 12.5}\n'


def _half_then_full(self, data, *args, **kwargs):
    """``Path.write_text`` / ``write_bytes`` on a disk that fills up: half the data lands, then ENOSPC."""
    with open(self, "wb" if isinstance(data, bytes) else "w") as handle:
        handle.write(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device")


def _fill_the_disk(monkeypatch) -> None:
    monkeypatch.setattr(Path, "write_text", _half_then_full)
    monkeypatch.setattr(Path, "write_bytes", _half_then_full)


def _old_file(path: Path) -> Path:
    with open(path, "w") as handle:
        handle.write(OLD)
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_write_json_keeps_the_old_file_on_a_full_disk(tmp_path, monkeypatch):
    path = _old_file(tmp_path / "eval_results.json")
    _fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        atomic_io.write_json(path, {"R@1": 50.0, "mAP": 40.0}, indent=2)
    assert path.read_text() == OLD and _leftovers(tmp_path) == []


def test_write_json_formats_and_refuses_nan_unless_allowed(tmp_path):
    path = tmp_path / "r.json"
    atomic_io.write_json(path, {"a": 1, "when": Path("x")}, indent=2, default=str)
    assert path.read_text() == '{\n  "a": 1,\n  "when": "x"\n}'
    with pytest.raises(ValueError, match="Out of range float"):
        atomic_io.write_json(path, {"a": float("nan")})
    assert json.loads(path.read_text()) == {"a": 1, "when": "x"}
    atomic_io.write_json(path, {"a": float("nan")}, allow_nan=True)
    assert path.read_text() == '{\n "a": NaN\n}'


def test_tracker_config_survives_a_full_disk(tmp_path, monkeypatch):
    _old_file(tmp_path / "config.json")
    tracker = JsonlTracker(tmp_path / "metrics.jsonl")
    _fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        tracker.store_init_configuration({"lr": 0.001})
    assert (tmp_path / "config.json").read_text() == OLD and _leftovers(tmp_path) == []


def test_evaluate_output_survives_a_full_disk(tmp_path, data_dir, model_dir, monkeypatch, capsys):
    """`tagclip eval --output FILE` on a full disk: the old FILE stays whole (was: truncated)."""
    output = _old_file(tmp_path / "results.json")
    encode = text_retrieval.run_retrieval

    def encode_then_fill_the_disk(*args, **kwargs):  # the disk fills up after encoding, before the write
        run = encode(*args, **kwargs)
        _fill_the_disk(monkeypatch)
        return run

    monkeypatch.setattr(text_retrieval, "run_retrieval", encode_then_fill_the_disk)
    args = ["--model", str(model_dir), "--data", str(data_dir), "--batch_size", "8", "--no_probe"]
    with pytest.raises(OSError, match="cannot write --output .*No space left"):
        text_retrieval.main([*args, "--output", str(output)])
    assert output.read_text() == OLD and _leftovers(tmp_path) == []
    assert '"R@1"' in capsys.readouterr().out  # printed before the write
