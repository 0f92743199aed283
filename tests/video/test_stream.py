"""A live stream on the loopback network: served as MPEG-TS over TCP, dropped, reconnected with backoff,
flushed into the gallery as it goes, and resumed by a later run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clips import gallery_rows, manifest, write_detections
from fixtures import save_tiny_model

from modeling_tagclip.video.cli import main

FRAMES = 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, sessions: int) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from clips import serve; serve({port}, {FRAMES}, {sessions})"
    server = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.0)  # listening
    return server


@pytest.mark.slow
def test_a_dropped_stream_reconnects_records_the_gap_flushes_and_resumes(tmp_path, capsys):
    model, out = save_tiny_model(tmp_path / "model"), tmp_path / "live.idx"
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    argv = [
        url,
        "--model",
        str(model),
        "--out",
        str(out),
        "--detections",
        str(write_detections(tmp_path / "d.txt")),
        "--fps",
        "10",
        "--reconnect",
        "2",
        "--backoff",
        "0.3",
        "--flush-seconds",
        "1",
        "--device",
        "cpu",
    ]
    server = start_server(port, sessions=2)  # two connections, then the server is gone
    try:
        assert main(argv) == 0
    finally:
        server.wait(60)
    err = capsys.readouterr().err
    assert "back after a gap of" in err and "reconnecting in 0.3 s (try 1 of 2)" in err
    assert f"{url}: gone after 2 reconnect tries; stopped" in err
    crops = Path(f"{out}.crops")
    stem = f"127.0.0.1_{port}"
    rows = manifest(crops)
    by_unit = {}
    for row in rows:
        by_unit.setdefault(row["path"].split("/")[2], set()).add(row["track"])
    # the first connection's two people were flushed into the gallery while the second was still streaming
    assert by_unit == {"00001": {f"{stem}/1", f"{stem}/2"}, "00002": {f"{stem}/3", f"{stem}/4"}}
    assert len(rows) == 12 and len(gallery_rows(out)) == 12
    state = json.loads((crops / "ingest_state.json").read_text())["sources"][url]
    (gap,) = state["gaps"]
    assert gap[1] - gap[0] >= 0.3 and state["next_track"] == 5

    server = start_server(port, sessions=1)  # the camera is back: a new run goes on
    try:
        assert main([*argv[:-8], "--reconnect", "0", "--device", "cpu"]) == 0
    finally:
        server.wait(60)
    tracks = {row["track"] for row in manifest(crops)}
    assert tracks == {f"{stem}/{n}" for n in range(1, 7)}  # numbers go on: no track is reused
    assert len(gallery_rows(out)) == 18


@pytest.mark.slow
def test_a_stalled_stream_counts_as_dropped_and_keeps_what_it_sent(tmp_path, capsys):
    """A camera that goes silent without hanging up: after --stall-timeout it is dropped, the tracks it sent are
    in the gallery, and reconnecting finds nobody."""
    import threading

    from clips import write_clip

    data = write_clip(tmp_path / "clip.ts", frames=FRAMES, fps=10).read_bytes()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def silent_after_one_clip() -> None:
        connection, _ = listener.accept()
        listener.close()  # nobody answers a reconnect
        connection.sendall(data)
        time.sleep(30)  # silent, not hung up
        connection.close()

    threading.Thread(target=silent_after_one_clip, daemon=True).start()
    url, out = f"tcp://127.0.0.1:{port}", tmp_path / "live.idx"
    argv = [
        url,
        "--model",
        str(save_tiny_model(tmp_path / "model")),
        "--out",
        str(out),
        "--detections",
        str(write_detections(tmp_path / "d.txt")),
        "--fps",
        "10",
        "--stall-timeout",
        "1",
        "--reconnect",
        "1",
        "--backoff",
        "0.1",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err  # the stall is noticed: the server would hang up only after 30 s
    assert f"{url}: stream dropped ({url}: the stream sent nothing for 1 s (stalled))" in err
    assert f"{url}: gone after 1 reconnect tries; stopped" in err
    assert len(manifest(Path(f"{out}.crops"))) == 6 and len(gallery_rows(out)) == 6
