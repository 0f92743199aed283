"""Frames out of footage (``modeling_tagclip.video.frames``): sampling at --fps, times, sources, bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clips import bad_files, draw, write_clip
from PIL import Image

from modeling_tagclip.video.frames import VideoError, container_start, expand_sources, iter_frames

START = 1_714_557_600.0  # 2024-05-01T10:00:00Z


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return write_clip(
        tmp_path_factory.mktemp("clip") / "cam.mp4",
        frames=30,
        fps=10,
        creation_time="2024-05-01T10:00:00.000000Z",
    )


def test_samples_at_fps_with_source_frame_numbers_and_times(clip):
    frames = list(iter_frames(str(clip), 2.0, START))
    assert [f.index for f in frames] == [0, 5, 10, 15, 20, 25]
    assert [f.pts_seconds for f in frames] == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5])
    assert [f.time - START for f in frames] == pytest.approx([0, 0.5, 1, 1.5, 2, 2.5])
    first = frames[0].image
    assert first.shape == (96, 128, 3) and first.dtype == np.uint8
    assert np.abs(first.astype(int) - draw(0, 2, 96, 128)).mean() < 6  # the drawn frame, up to compression


def test_fps_above_the_source_rate_takes_every_frame(clip):
    assert [f.index for f in iter_frames(str(clip), 50.0, 0.0)] == list(range(30))


def test_start_time_from_creation_time_else_file_time(clip, tmp_path):
    source = expand_sources([str(clip)])[0]
    assert container_start(source) == (START, "the container's creation_time")
    plain = write_clip(tmp_path / "plain.ts", frames=20, fps=10)
    seconds, how = container_start(expand_sources([str(plain)])[0])
    assert "modification time less its duration" in how
    assert seconds == pytest.approx(plain.stat().st_mtime - 2.0, abs=0.3)


def test_frame_folder_uses_frame_rate_and_name_order(tmp_path):
    for i in (2, 0, 1, 3):
        Image.fromarray(draw(i, 1, 32, 48)).save(tmp_path / f"f{i:03d}.png")
    (source,) = expand_sources([str(tmp_path)])
    assert source.kind == "frames" and source.stem == tmp_path.name
    frames = list(iter_frames(source, 1.0, START, frame_rate=2.0))
    assert [(f.index, f.time - START) for f in frames] == [(0, 0.0), (2, 1.0)]
    assert np.array_equal(frames[1].image, draw(2, 1, 32, 48))


def test_folder_of_videos_and_stream_urls(tmp_path):
    write_clip(tmp_path / "b.mp4", frames=2)
    (tmp_path / "sub").mkdir()
    write_clip(tmp_path / "sub" / "a.ts", frames=2)
    (tmp_path / "notes.txt").write_text("x")
    sources = expand_sources([str(tmp_path), "udp://127.0.0.1:5000?x=1"])
    assert [(Path(s.location).name, s.kind) for s in sources[:2]] == [("b.mp4", "video"), ("a.ts", "video")]
    assert (sources[2].kind, sources[2].stem) == ("stream", "127.0.0.1_5000")


def test_clock_running_backwards_is_skipped_and_reported(tmp_path):
    part = write_clip(tmp_path / "part.ts", frames=10, fps=10).read_bytes()
    joined = tmp_path / "joined.ts"
    joined.write_bytes(part + part)  # the second half's clock starts again from zero
    said = []
    frames = list(iter_frames(str(joined), 10.0, 0.0, warn=said.append))
    assert [f.index for f in frames] == list(range(10))
    assert said == [f"{joined}: 10 frame(s) whose time ran backwards were skipped"]


def test_bad_files_are_one_line_naming_the_file(clip, tmp_path):
    for name, (path, message) in bad_files(tmp_path, clip).items():
        with pytest.raises(VideoError) as caught:
            list(iter_frames(str(path), 2.0, 0.0))
        text = str(caught.value)
        assert text.startswith(f"{path}: ") and message in text and "\n" not in text, (name, text)


def test_bad_arguments(tmp_path, clip):
    with pytest.raises(VideoError, match="no such file or folder"):
        expand_sources([str(tmp_path / "missing.mp4")])
    with pytest.raises(VideoError, match="no videos"):
        expand_sources([str(tmp_path)])
    with pytest.raises(VideoError, match="fps must be a positive number"):
        list(iter_frames(str(clip), 0.0, 0.0))


def test_an_intra_only_codec_decodes_only_the_sampled_frames_and_gives_the_same_ones(tmp_path):
    import av

    clip = write_clip(tmp_path / "cam.avi", frames=30, fps=10, codec="mjpeg")
    with av.open(str(clip)) as container:
        every = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    frames = list(iter_frames(str(clip), 2.0, 0.0))
    assert [f.index for f in frames] == [0, 5, 10, 15, 20, 25]
    assert all(np.array_equal(f.image, every[f.index]) for f in frames)
