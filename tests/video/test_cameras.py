"""The camera file (``modeling_tagclip.video.cameras``): entries, matching, bad time zones and unknown cameras."""

from __future__ import annotations

import pytest

from modeling_tagclip.video.cameras import CameraFileError, camera_for, read_cameras
from modeling_tagclip.video.frames import Source

GOOD = """
- source: "*/gate*.mp4"
  camera: gate
  view: ground
  start: 2024-05-01T10:00:00+02:00
  name: Main gate
- {source: "drone7.ts", camera: "7", view: Aerial, start: "2024-05-01T08:05:40Z"}
- {source: "udp://127.0.0.1:*", camera: live}
"""


def test_entries_match_sources_by_glob_name_or_url(tmp_path):
    path = tmp_path / "cameras.yaml"
    path.write_text(GOOD)
    cameras = read_cameras(path)
    gate = camera_for(Source("/footage/gate-2.mp4", "video"), cameras, path)
    assert (gate.camera, gate.view, gate.start, gate.name) == ("gate", "ground", 1714550400.0, "Main gate")
    drone = camera_for(Source("/x/drone7.ts", "video"), cameras, path)
    assert (drone.camera, drone.view, drone.start) == (
        "7",
        "aerial",
        1714550740.0,
    )  # the same instant, in UTC
    live = camera_for(Source("udp://127.0.0.1:5000", "stream"), cameras, path)
    assert (live.camera, live.view, live.start) == ("live", None, None)


def test_mapping_form_and_json(tmp_path):
    path = tmp_path / "cameras.json"
    path.write_text('{"c3": {"source": "*.mp4", "view": "ground", "start": "2024-05-01T10:00:00-05:00"}}')
    (camera,) = read_cameras(path)
    assert (camera.camera, camera.start) == ("c3", 1714575600.0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('{source: a.mp4, camera: c, start: "2024-05-01T10:00:00"}', "has no time zone (add Z or an offset"),
        ("{source: a.mp4, camera: c, start: 2024-05-01T10:00:00}", "has no time zone"),
        ('{source: a.mp4, camera: c, start: "2024-05-01T10:00:00+25:00"}', "is not an ISO 8601 time"),
        ('{source: a.mp4, camera: c, start: "10 o\'clock CET"}', "is not an ISO 8601 time"),
        ("{source: a.mp4, camera: c, start: 2024-05-01}", "a date without a time and time zone"),
        ("{source: a.mp4, camera: c, view: sky}", "view must be 'aerial' or 'ground'"),
        ("{source: a.mp4}", "needs 'camera'"),
        ("{source: a.mp4, camera: c, zone: x}", "unknown keys ['zone']"),
    ],
)
def test_bad_entries_are_one_line_naming_file_and_entry(tmp_path, entry, message):
    path = tmp_path / "cameras.yaml"
    path.write_text(f"- {{source: ok.mp4, camera: ok}}\n- {entry}\n")
    with pytest.raises(CameraFileError) as caught:
        read_cameras(path)
    assert str(caught.value).startswith(f"camera file {path}, entry 2: ") and message in str(caught.value)


def test_a_source_no_entry_matches_is_an_unknown_camera(tmp_path):
    path = tmp_path / "cameras.yaml"
    path.write_text(GOOD)
    with pytest.raises(CameraFileError, match=r"/x/lobby.mp4: no entry of camera file .* \(unknown camera\)"):
        camera_for(Source("/x/lobby.mp4", "video"), read_cameras(path), path)


@pytest.mark.parametrize(
    ("text", "message"), [("[unclosed", "not valid YAML"), ("42", "expected a list"), ("", "expected a list")]
)
def test_unreadable_camera_files(tmp_path, text, message):
    path = tmp_path / "cameras.yaml"
    path.write_text(text)
    with pytest.raises(CameraFileError, match=message):
        read_cameras(path)
    with pytest.raises(CameraFileError, match="cannot read it"):
        read_cameras(tmp_path / "missing.yaml")
