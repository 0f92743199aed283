"""``tagclip ingest`` end to end on tiny clips with known boxes: tracks, crops, manifest, gallery rows, re-runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from clips import FPS, gallery_rows, manifest, people_boxes

from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
from modeling_tagclip.video.cli import main
from modeling_tagclip.video.crops import MARGIN
from modeling_tagclip.video.ingest import bounded_boxes
from modeling_tagclip.video.state import KILL_ENV, KILL_STAGES


def ingest(ingest_setup: dict, out: Path, *sources: str, extra: tuple = ()) -> int:
    root = ingest_setup["root"]
    argv = [
        *sources,
        "--model",
        str(ingest_setup["model"]),
        "--out",
        str(out),
        "--cameras",
        str(root / "cameras.yaml"),
        "--detections",
        str(root / "dets"),
        "--fps",
        "5",
        "--device",
        "cpu",
        *extra,
    ]
    return main(argv)


@pytest.mark.slow
def test_one_video_gives_one_track_per_person_with_camera_view_time_and_boxes(ingest_setup, tmp_path, capsys):
    out = tmp_path / "g.idx"
    assert ingest(ingest_setup, out, str(ingest_setup["root"] / "videos" / "gate.mp4")) == 0
    crops = tmp_path / "g.idx.crops"
    rows = manifest(crops)
    assert {row["track"] for row in rows} == {"gate/1", "gate/2"}
    assert len(rows) == 6  # 3 best crops of each of the 2 people
    start = 1714557600.0  # 10:00:00Z
    for row in rows:
        frame = int(row["frame"])
        assert frame % 2 == 0  # --fps 5 of a 10 fps clip: every other frame
        pid = 1 + (row["track"] == "gate/2")
        (box,) = [b[1:] for b in people_boxes(frame, 2, 96, 128) if b[0] == pid]
        assert row["box"] == " ".join(map(str, box))
        assert row["path"] == f"gate/gate/{int(row['track'].split('/')[1]):05d}_{frame:07d}.jpg"
        assert (row["camera"], row["view"], row["source"]) == (
            "gate",
            "ground",
            str(ingest_setup["root"] / "videos" / "gate.mp4"),
        )
        assert row["timestamp"] == f"2024-05-01T10:00:{frame / FPS:06.3f}Z"
        assert (row["t_start"], row["t_end"]) == ("2024-05-01T10:00:00.000Z", "2024-05-01T10:00:02.800Z")
        image = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(crops / row["path"]))
        pad = round(
            MARGIN * (box[3] - box[1])
        )  # the crop is the box and a margin of context, inside the frame
        assert image.shape == (box[3] - box[1] + 2 * pad, box[2] - box[0] + 2 * pad, 3)
    indexed = gallery_rows(out)
    assert [r[0] for r in indexed] == sorted(row["path"] for row in rows)
    assert {(r[1], r[2]) for r in indexed} == {("ground", "gate")}
    assert [r[3] for r in indexed] == pytest.approx(sorted(start + int(row["frame"]) / FPS for row in rows))
    assert len(GalleryIndex.load(out)) == 6
    assert "1 source(s) ingested (0 already in), 2 track(s), 6 crop(s)" in capsys.readouterr().out


@pytest.mark.slow
def test_twice_adds_nothing_and_new_footage_adds_like_add(ingest_setup, tmp_path, capsys):
    out, videos = tmp_path / "g.idx", ingest_setup["root"] / "videos"
    assert ingest(ingest_setup, out, str(videos / "gate.mp4")) == 0
    before = (tmp_path / "g.idx.crops" / "manifest.csv").read_bytes()
    assert ingest(ingest_setup, out, str(videos / "gate.mp4")) == 0
    said = capsys.readouterr()
    assert "already ingested, nothing added" in said.err and "0 source(s) ingested (1 already in)" in said.out
    assert (tmp_path / "g.idx.crops" / "manifest.csv").read_bytes() == before
    assert len(gallery_rows(out)) == 6
    assert ingest(ingest_setup, out, str(videos)) == 0  # the folder: gate is in, yard is new
    rows = gallery_rows(out)
    assert len(rows) == 12 and {r[2] for r in rows} == {"gate", "yard"}
    assert {r[1] for r in rows if r[2] == "yard"} == {"aerial"}
    assert min(r[3] for r in rows if r[2] == "yard") == 1714557600.0  # 11:00+01:00 = 10:00Z


def test_bounded_boxes_drops_non_finite_and_keeps_the_best():
    boxes = np.array(
        [
            [0, 0, 10, 10, 0.5],
            [np.nan, 0, 1, 1, 0.9],
            [0, 0, 5, np.inf, 0.9],
            [3, 3, 3, 9, 0.9],
            [1, 1, 4, 4, 0.7],
        ],
        dtype=np.float32,
    )
    assert bounded_boxes(boxes, 100).tolist() == [[0, 0, 10, 10, 0.5], [1, 1, 4, 4, 0.699999988079071]]
    many = np.random.default_rng(0).random((10_000, 5)).astype(np.float32)
    many[:, 2:4] += 1
    kept = bounded_boxes(many, 100)
    assert kept.shape == (100, 5) and kept[:, 4].min() >= np.sort(many[:, 4])[-100]


def _child(ingest_setup: dict, out: Path, source: str, stage: str | None) -> None:
    import os

    import torch

    torch.set_num_threads(1)
    if stage:
        os.environ[KILL_ENV] = stage
    raise SystemExit(ingest(ingest_setup, out, source))


def _run_child(ingest_setup: dict, out: Path, source: str, stage: str | None = None) -> int:
    """``tagclip ingest`` in a forked process (SIGKILL at ``stage``); its exit code (-9: killed)."""
    import multiprocessing

    process = multiprocessing.get_context("fork").Process(
        target=_child, args=(ingest_setup, out, source, stage)
    )
    process.start()
    process.join(300)
    return process.exitcode


def _gallery(out: Path) -> dict:
    """Everything a re-run must reproduce: crop files and bytes, the manifest, the indexed rows."""
    crops = Path(f"{out}.crops")
    files = {p.relative_to(crops).as_posix(): p.read_bytes() for p in sorted(crops.rglob("*.jpg"))}
    hidden = [p.name for p in crops.iterdir() if p.name.startswith(".")]
    return {
        "files": files,
        "manifest": (crops / "manifest.csv").read_text(),
        "rows": gallery_rows(out),
        "hidden": hidden,
    }


@pytest.mark.slow
def test_kill_9_at_every_stage_then_a_re_run_equals_an_uninterrupted_run(ingest_setup, tmp_path):
    videos = str(ingest_setup["root"] / "videos")
    assert _run_child(ingest_setup, tmp_path / "whole.idx", videos) == 0
    whole = _gallery(tmp_path / "whole.idx")
    assert len(whole["rows"]) == 12 and len(whole["files"]) == 12
    for stage in KILL_STAGES:
        out = tmp_path / f"{stage}.idx"
        assert _run_child(ingest_setup, out, videos, stage) == -9, stage
        assert _run_child(ingest_setup, out, videos) == 0, stage
        assert _gallery(out) == whole, stage


@pytest.mark.slow
def test_milvus_lite_gets_the_same_rows_and_a_re_run_adds_nothing(ingest_setup, tmp_path, capsys):
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    uri, gate = str(tmp_path / "g.db"), str(ingest_setup["root"] / "videos" / "gate.mp4")
    root = ingest_setup["root"]
    argv = [
        gate,
        "--model",
        str(ingest_setup["model"]),
        "--milvus-uri",
        uri,
        "--collection",
        "people",
        "--cameras",
        str(root / "cameras.yaml"),
        "--detections",
        str(root / "dets"),
        "--fps",
        "5",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0 and main(argv) == 0
    assert "already ingested, nothing added" in capsys.readouterr().err
    rows = manifest(tmp_path / "g.db.crops")
    gallery = MilvusGallery(uri, "people")
    try:
        assert len(gallery) == 6 == len(rows)
        assert gallery.present([row["path"] for row in rows]) == {row["path"] for row in rows}
    finally:
        gallery.close()


def test_no_source_without_the_main_jobs_model_names_the_main_job(tmp_path, monkeypatch, capsys):
    from modeling_tagclip.cli import MAIN_JOB

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main([])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1
    assert f"no model at outputs/tagclip-synthetic/best: train it first with the main job ({MAIN_JOB})" in err
    assert list(tmp_path.iterdir()) == []  # nothing rendered, nothing written


@pytest.mark.slow
def test_a_folder_of_frames_is_one_source_timed_by_frame_rate(ingest_setup, tmp_path):
    from clips import FRAMES, draw, write_detections
    from PIL import Image

    dump = tmp_path / "drone7"
    dump.mkdir()
    for i in range(FRAMES):
        Image.fromarray(draw(i, 2, 96, 128)).save(dump / f"IMG_{i:04d}.png")
    cameras = tmp_path / "cameras.yaml"
    cameras.write_text('- {source: "drone7", camera: "7", view: aerial, start: "2024-05-01T10:00:00Z"}\n')
    out = tmp_path / "g.idx"
    argv = [
        str(dump),
        "--model",
        str(ingest_setup["model"]),
        "--out",
        str(out),
        "--cameras",
        str(cameras),
        "--detections",
        str(write_detections(tmp_path / "d.txt")),
        "--frame-rate",
        "2",
        "--fps",
        "1",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    rows = manifest(Path(f"{out}.crops"))
    assert {row["track"] for row in rows} == {"drone7/1", "drone7/2"} and len(rows) == 6
    for row in rows:  # every other frame at 1 fps of a 2 frames-per-second dump
        assert int(row["frame"]) % 2 == 0 and row["path"].startswith("7/drone7/")
        assert row["timestamp"] == f"2024-05-01T10:00:{int(row['frame']) / 2:06.3f}Z"


@pytest.mark.slow
def test_a_person_gone_longer_than_max_lost_comes_back_as_a_new_track(ingest_setup, tmp_path):
    """Tracker and crop keeper end a track after the same number of unseen frames: a person missing for 12
    frames (more than max_lost, 8) is a new track when seen again, never a second track under the same number."""
    from clips import FRAMES, gt_boxes

    lines = []
    for i, boxes in gt_boxes(FRAMES).items():
        for n, (x1, y1, x2, y2, s) in enumerate(boxes):
            if n == 0 and 10 <= i < 22:
                continue  # person 1 is hidden
            lines.append(f"{i + 1},-1,{x1},{y1},{x2 - x1},{y2 - y1},{s:.2f},-1,-1,-1")
    dets = tmp_path / "gate.txt"
    dets.write_text("\n".join(lines) + "\n")
    out = tmp_path / "g.idx"
    root = ingest_setup["root"]
    argv = [
        str(root / "videos" / "gate.mp4"),
        "--model",
        str(ingest_setup["model"]),
        "--out",
        str(out),
        "--cameras",
        str(root / "cameras.yaml"),
        "--detections",
        str(dets),
        "--fps",
        "10",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    spans = {}
    for row in manifest(Path(f"{out}.crops")):
        spans.setdefault(row["track"], set()).add((row["t_start"], row["t_end"]))
    assert len(spans) == 3 and all(len(span) == 1 for span in spans.values())


@pytest.mark.slow
def test_ingest_with_a_reid_model_equals_adding_the_embeddings_later(ingest_setup, tmp_path, capsys):
    """`tagclip ingest --reid-model VISA` gives the ingested crops the ViSA embeddings that `tagclip index
    --add-embeddings reid` adds to the same gallery ingested without it."""
    from fixtures import make_visa_model

    from modeling_tagclip.cli import main as tagclip
    from modeling_tagclip.retrieval.embedded.reid_store import EmbeddedReid

    visa = tmp_path / "visa"
    make_visa_model().save_pretrained(visa)
    video = str(ingest_setup["root"] / "videos" / "gate.mp4")
    assert ingest(ingest_setup, tmp_path / "with.idx", video, extra=("--reid-model", str(visa))) == 0
    assert "reid embeddings of 6 crop(s) added" in capsys.readouterr().out
    assert ingest(ingest_setup, tmp_path / "later.idx", video) == 0
    add = ["index", "--add-embeddings", "reid", "--reid-model", str(visa), "--quiet"]
    assert tagclip([*add, "--output", str(tmp_path / "later.idx")]) == 0
    built, later = (EmbeddedReid(GalleryIndex.load(tmp_path / name)) for name in ("with.idx", "later.idx"))
    assert built.vectors.shape[0] == 6 and bool(built.valid.all())
    assert torch.allclose(built.vectors, later.vectors, atol=1e-6)


def test_a_bad_reid_model_fails_before_any_footage_is_read(ingest_setup, tmp_path, capsys):
    video = str(ingest_setup["root"] / "videos" / "gate.mp4")
    with pytest.raises(SystemExit):
        ingest(ingest_setup, tmp_path / "g.idx", video, extra=("--reid-model", str(tmp_path / "no-such")))
    assert not (tmp_path / "g.idx.crops").exists()
