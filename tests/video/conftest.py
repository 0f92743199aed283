"""Fixtures of the ingest tests: tiny clips with known boxes, their detections, a camera file, a tiny model."""

from __future__ import annotations

import pytest
from clips import CAMERAS, FPS, FRAMES, write_clip, write_detections
from fixtures import save_tiny_model


@pytest.fixture(scope="module")
def ingest_setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ingest")
    (root / "videos").mkdir()
    (root / "dets").mkdir()
    for name in ("gate", "yard"):
        write_clip(root / "videos" / f"{name}.mp4", frames=FRAMES, fps=FPS)
        write_detections(root / "dets" / f"{name}.txt")
    (root / "cameras.yaml").write_text(CAMERAS)
    return {"root": root, "model": save_tiny_model(root / "model")}
