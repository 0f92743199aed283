"""``tagclip ingest`` shows its progress in a log: the frames tracked per source and the crops indexed, as plain
lines of the package's progress style, and no raw log records."""

from __future__ import annotations

import pytest
from clips import FRAMES

from modeling_tagclip.cli import main as tagclip


@pytest.mark.slow
def test_ingest_shows_frames_tracked_and_crops_indexed(ingest_setup, tmp_path, capsys):
    root = ingest_setup["root"]
    video = str(root / "videos" / "gate.mp4")
    argv = [
        "ingest",
        video,
        "--model",
        str(ingest_setup["model"]),
        "--output",
        str(tmp_path / "g.idx"),
        "--cameras",
        str(root / "cameras.yaml"),
        "--detections",
        str(root / "dets"),
        "--fps",
        "5",
        "--device",
        "cpu",
    ]
    assert tagclip(argv) == 0
    err = capsys.readouterr().err
    assert "INFO " not in err and "{'" not in err and "\r" not in err, err
    lines = err.splitlines()
    frames = FRAMES // 2  # --fps 5 of a 10 fps clip: every other frame
    assert any(line.startswith(f"tracking {video}: {frames} frames in ") for line in lines), lines
    assert "indexing: 6 images to do" in lines  # 3 best crops of each of the 2 people
    assert any(line.startswith("indexing: 6/6 images in ") for line in lines), lines
    tracked = next(i for i, line in enumerate(lines) if line.startswith(f"tracking {video}"))
    assert tracked < lines.index("indexing: 6 images to do")
