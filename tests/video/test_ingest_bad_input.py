"""Bad input to ``tagclip ingest`` (#31 item 8, #34 item 4): one line each, and nothing already ingested is lost
or duplicated."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import numpy as np
import pytest
from clips import FPS, FRAMES, bad_files, gallery_rows, manifest, write_clip, write_detections

from modeling_tagclip.cli import main as tagclip
from modeling_tagclip.video.cli import main


def _argv(ingest_setup: dict, out: Path, *sources: str, cameras: bool = True) -> list[str]:
    root = ingest_setup["root"]
    extra = ["--cameras", str(root / "cameras.yaml")] if cameras else []
    return [
        *sources,
        "--model",
        str(ingest_setup["model"]),
        "--out",
        str(out),
        "--detections",
        str(root / "dets"),
        "--fps",
        "5",
        "--device",
        "cpu",
        *extra,
    ]


def _one_line_errors(err: str) -> list[str]:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err
    return lines


@pytest.mark.slow
def test_bad_files_are_skipped_with_one_line_each_and_the_good_one_is_ingested(
    ingest_setup, tmp_path, capsys
):
    bad = bad_files(tmp_path, ingest_setup["root"] / "videos" / "gate.mp4")
    sources = tmp_path / "sources"
    sources.mkdir()
    shutil.copy(ingest_setup["root"] / "videos" / "gate.mp4", sources / "gate.mp4")
    for name, (path, _) in bad.items():
        path.rename(sources / f"{name.replace(' ', '-')}.mp4")
        write_detections(ingest_setup["root"] / "dets" / f"{name.replace(' ', '-')}.txt")
    out = tmp_path / "g.idx"
    assert main(_argv(ingest_setup, out, str(sources), cameras=False)) == 2
    err = capsys.readouterr().err
    assert f"{sources}/gate.mp4: times count from the file's modification time less its duration" in err
    errors = _one_line_errors(err)
    assert len(errors) == len(bad)
    for (name, (_, message)), line in zip(
        sorted(bad.items()), sorted(errors, key=lambda e: e.split("/")[-1]), strict=True
    ):
        assert (
            line.startswith(f"tagclip ingest: error: {sources}/{name.replace(' ', '-')}.mp4: ")
            and message in line
        )
    rows = manifest(Path(f"{out}.crops"))
    assert {row["camera"] for row in rows} == {"gate"}  # no camera file: the file's name
    views = {row["track"]: set() for row in rows}
    for row in rows:
        views[row["track"]].add(row["view"])
    assert all(len(v) == 1 and v <= {"aerial", "ground"} for v in views.values())  # one model view per track
    assert len(gallery_rows(out)) == 6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cameras", "message"),
    [
        ('- {source: "other.mp4", camera: c}', "gate.mp4: no entry of camera file"),
        ('- {source: "*.mp4", camera: c, start: "2024-05-01T10:00:00"}', "has no time zone"),
        ('- {source: "*.mp4", camera: c, start: "2024-05-01T10:00:00+99:00"}', "is not an ISO 8601 time"),
    ],
)
def test_a_bad_camera_file_is_one_line_before_anything_is_written(
    ingest_setup, tmp_path, capsys, cameras, message
):
    path = tmp_path / "cameras.yaml"
    path.write_text(cameras + "\n")
    out = tmp_path / "g.idx"
    argv = [
        *_argv(ingest_setup, out, str(ingest_setup["root"] / "videos" / "gate.mp4"), cameras=False),
        "--cameras",
        str(path),
    ]
    with pytest.raises(SystemExit) as done:
        main(argv)
    (line,) = _one_line_errors(capsys.readouterr().err)
    assert done.value.code == 2 and line.startswith("tagclip ingest: error: ") and message in line
    assert not out.exists() and not Path(f"{out}.crops").exists()


@pytest.mark.slow
def test_a_clock_that_runs_backwards_is_skipped_with_a_line(ingest_setup, tmp_path, capsys):
    part = write_clip(tmp_path / "part.ts", frames=FRAMES, fps=FPS).read_bytes()
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "gate.ts").write_bytes(part + part)
    cameras = tmp_path / "cameras.yaml"
    cameras.write_text('- {source: "gate.ts", camera: gate, view: ground, start: "2024-05-01T10:00:00Z"}\n')
    argv = [
        *_argv(ingest_setup, tmp_path / "g.idx", str(tmp_path / "v" / "gate.ts"), cameras=False),
        "--cameras",
        str(cameras),
    ]
    assert main(argv) == 0
    assert f"{tmp_path / 'v' / 'gate.ts'}: {FRAMES} frame(s) whose time ran backwards were skipped" in (
        capsys.readouterr().err
    )
    frames = {int(row["frame"]) for row in manifest(tmp_path / "g.idx.crops")}
    assert frames and max(frames) < FRAMES  # only the first recording's frames


@pytest.mark.slow
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_disk_or_read_only_output_mid_ingest_loses_nothing(
    ingest_setup, tmp_path, capsys, monkeypatch, code
):
    """The second source's crop writer fails (a full disk, a read-only file system): one line, the first source
    stays in the gallery, and a re-run ends equal to an uninterrupted run."""
    from PIL import Image

    videos = str(ingest_setup["root"] / "videos")
    whole = tmp_path / "whole.idx"
    assert main(_argv(ingest_setup, whole, videos)) == 0
    save, calls = Image.Image.save, []

    def failing(self, fp, *args, **kwargs):
        calls.append(fp)
        if len(calls) > 6:  # the first source (gate) writes 6 crops
            raise OSError(
                code, "No space left on device" if code == errno.ENOSPC else "Read-only file system", fp
            )
        return save(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", failing)
    out = tmp_path / "g.idx"
    assert tagclip(["ingest", *_argv(ingest_setup, out, videos)]) == 1
    (line,) = _one_line_errors(capsys.readouterr().err)
    assert line.startswith("tagclip ingest: error: ") and line.endswith(
        "No space left on device" if code == errno.ENOSPC else "Read-only file system"
    )
    assert {row[2] for row in gallery_rows(out)} == {"gate"} and len(gallery_rows(out)) == 6
    monkeypatch.setattr(Image.Image, "save", save)
    assert main(_argv(ingest_setup, out, videos)) == 0
    assert gallery_rows(out) == gallery_rows(whole)
    assert manifest(Path(f"{out}.crops")) == manifest(Path(f"{whole}.crops"))


@pytest.mark.slow
def test_a_detector_returning_nan_or_ten_thousand_boxes_is_bounded(ingest_setup, tmp_path, monkeypatch):
    """The tracker never sees a NaN row nor more than --max-boxes (here 10) boxes of a frame."""
    from modeling_tagclip.retrieval.cli import load_model
    from modeling_tagclip.video import track
    from modeling_tagclip.video.frames import expand_sources
    from modeling_tagclip.video.gallery import GalleryTarget
    from modeling_tagclip.video.ingest import Ingest, IngestOptions

    def wild(images):
        rng = np.random.default_rng(0)
        many = rng.random((10_000, 5)).astype(np.float32) * [100, 70, 1, 1, 1] + [0, 0, 20, 20, 0]
        many[:, 2:4] += many[:, :2]
        many[::7, 1] = np.nan
        return [many for _ in images]

    given, update = [], track.ByteTracker.update
    monkeypatch.setattr(
        track.ByteTracker, "update", lambda self, boxes: (given.append(boxes), update(self, boxes))[1]
    )
    model, processor = load_model(str(ingest_setup["model"]))
    options = IngestOptions(
        tmp_path / "crops", GalleryTarget(out=tmp_path / "g.idx"), fps=5, max_frames=3, max_boxes=10
    )
    summary = Ingest(model, processor, lambda source: wild, options).run(
        expand_sources([str(ingest_setup["root"] / "videos" / "gate.mp4")])
    )
    assert summary.failed == [] and len(given) == 3
    assert all(boxes.shape == (10, 5) and np.isfinite(boxes).all() for boxes in given)


@pytest.mark.slow
def test_a_source_without_its_detections_file_is_skipped_with_one_line(ingest_setup, tmp_path, capsys):
    videos = tmp_path / "videos"
    videos.mkdir()
    for name in ("gate", "lobby"):  # dets/ has gate.txt, no lobby.txt
        shutil.copy(ingest_setup["root"] / "videos" / "gate.mp4", videos / f"{name}.mp4")
    out = tmp_path / "g.idx"
    assert main(_argv(ingest_setup, out, str(videos), cameras=False)) == 2
    (line,) = _one_line_errors(capsys.readouterr().err)
    dets = ingest_setup["root"] / "dets"
    assert (
        line
        == f"tagclip ingest: error: {videos}/lobby.mp4: no lobby.txt or lobby.json in --detections {dets}"
    )
    assert {row["camera"] for row in manifest(Path(f"{out}.crops"))} == {"gate"}
