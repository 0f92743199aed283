"""A full disk under ``tagclip eval --output`` and ``tagclip export``: one error line naming the path, the metrics
still printed, the previous files kept whole and no temporary file or folder left (real tmpfs mounts; they skip
with a reason where mounting is not permitted)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from fixtures import save_tiny_model, synthetic_gallery

from modeling_tagclip.cli import main as tagclip


def _fill(disk: Path) -> None:
    """Write a filler file until ``disk`` has no byte left."""
    with open(disk / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_eval_output_on_a_full_disk_prints_the_metrics_and_keeps_the_old_file(tiny_disk, tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model")
    data = synthetic_gallery(tmp_path / "data")
    disk = tiny_disk(64)
    old = disk / "results.json"
    old.write_text('{"R@1": 1.0}\n')
    _fill(disk)
    assert tagclip(["eval", "--model", str(model), "--data", str(data), "--output", str(old)]) == 1
    out, err = capsys.readouterr()
    assert "R@1" in out  # printed before the write
    lines = [
        line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip().startswith("tagclip")
    ]
    assert len(lines) == 1 and "Traceback" not in err, err  # progress bars aside, one line
    assert (
        lines[0].startswith(f"tagclip eval: error: cannot write --output {old} (")
        and "No space left" in lines[0]
    )
    assert lines[0].endswith("the metrics are printed above")
    assert old.read_text() == '{"R@1": 1.0}\n' and sorted(p.name for p in disk.iterdir()) == [
        "filler",
        "results.json",
    ]


@pytest.mark.slow
def test_export_onto_a_full_disk_is_one_line_and_keeps_the_previous_export(tiny_disk, tmp_path, capsys):
    pytest.importorskip("onnxscript")
    model = save_tiny_model(tmp_path / "model")
    assert tagclip(["export", "onnx", str(model), str(tmp_path / "first")]) == 0
    size = sum(p.stat().st_size for p in (tmp_path / "first").iterdir())
    disk = tiny_disk(
        size // 1024 + 2048
    )  # room for the old export and 2 MiB: the new text graph does not fit
    out = shutil.copytree(tmp_path / "first", disk / "onnx")
    before = _digests(out)
    capsys.readouterr()
    assert tagclip(["export", "onnx", str(model), str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"tagclip export: error: {out}: No space left on device while exporting; nothing was changed there"
    )
    assert _digests(out) == before  # every graph and the manifest as they were; no staging folder left
    assert os.listdir(disk) == ["onnx"]
