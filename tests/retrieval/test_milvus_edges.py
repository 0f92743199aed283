"""The Milvus backend's edges, through ``tagclip index/search``: collection names and URIs are checked before
anything is opened or created, a search creates nothing, a full disk is one line, kill -9 inside a Milvus Lite
write followed by a re-run gives the collection of an uninterrupted run, and two concurrent ``--add`` runs lose
nothing (Milvus Lite opens a database in one process at a time: the second stops with one line, and its re-run
adds its rows)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import (
    TAGCLIP_CLI,
    assert_same_milvus_rows,
    milvus_index_cli,
    milvus_rows,
    model_and_gallery,
    one_error_line,
)

from modeling_tagclip.cli import main as tagclip
from modeling_tagclip.retrieval.embedded.index_store import GalleryIndexError

pytest.importorskip("pymilvus")  # the milvus extra; CI installs it

RULE = "letters, digits and underscores, starting with a letter or an underscore, at most 255 characters"


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> dict[str, Path]:
    return model_and_gallery(tmp_path_factory.mktemp("milvus_edges"))


@pytest.mark.parametrize("name", ["../x", "a" * 300, "a b; drop", "9lives"])
def test_a_collection_name_milvus_would_refuse_is_one_line_stating_the_rule(name, gallery, tmp_path, capsys):
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    uri = tmp_path / "g.db"
    index = [
        "index",
        "--model",
        str(gallery["model"]),
        "--images",
        str(gallery["images"]),
        "--milvus-uri",
        str(uri),
    ]
    for argv in (
        [*index, "--collection", name],
        ["search", "--milvus-uri", str(uri), "--collection", name, "a"],
    ):
        assert tagclip(argv) == 2
        err = one_error_line(capsys)
        assert err.startswith(f"tagclip {argv[0]}: error: collection name {name[:40]!r}") and RULE in err
    assert not uri.exists()  # checked before anything is opened
    with pytest.raises(GalleryIndexError, match="is not a valid Milvus name"):
        MilvusGallery(str(uri), name)


def test_a_uri_that_is_not_milvus_is_not_taken_for_an_index_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tagclip(["search", "--milvus-uri", "foo.txt", "--collection", "g", "a man"]) == 2
    err = one_error_line(capsys)
    assert "'foo.txt' is not a Milvus URI: give a server (http://HOST:19530" in err and "ending in .db" in err
    assert not (tmp_path / "foo.txt").exists()


def test_a_garbage_file_as_milvus_uri_is_one_line_and_stays_as_it_was(tmp_path, capsys):
    garbage = tmp_path / "gallery.db"
    garbage.write_bytes(bytes(range(256)) * 20)
    assert tagclip(["search", "--milvus-uri", str(garbage), "--collection", "g", "a man"]) == 2
    err = one_error_line(capsys)
    assert err == (
        f"tagclip search: error: {garbage} is not a Milvus Lite database: it is a file (Milvus Lite keeps a "
        "gallery in a folder *.db)"
    )
    assert "another process" not in err and garbage.read_bytes() == bytes(range(256)) * 20


def test_a_search_of_a_missing_milvus_lite_database_creates_nothing(tmp_path, capsys):
    uri = tmp_path / "new" / "dir" / "g.db"
    assert tagclip(["search", "--milvus-uri", str(uri), "--collection", "g", "a man"]) == 2
    assert f"no Milvus Lite database at {uri}; build one with `tagclip index" in one_error_line(capsys)
    assert not (tmp_path / "new").exists()  # no folder, no database


@pytest.mark.slow
def test_a_full_disk_during_a_milvus_insert_is_one_line_and_a_rerun_completes(gallery, tiny_disk):
    disk = tiny_disk(20)  # Milvus Lite's first data file of the 20 crops does not fit
    uri = str(disk / "g.db")
    full = milvus_index_cli([sys.executable, *TAGCLIP_CLI], gallery["model"], gallery["images"], uri)
    assert full.returncode == 1, full.stderr[-3000:]
    lines = [line for line in full.stderr.splitlines() if line.startswith(("tagclip", "Traceback", "  File"))]
    assert len(lines) == 1 and lines[0].startswith(f"tagclip index: error: Milvus at {uri}: "), full.stderr[
        -3000:
    ]
    assert "No space left on device" in lines[0] and "the disk is full: free some space and run" in lines[0]
    subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # space freed
    again = milvus_index_cli([sys.executable, *TAGCLIP_CLI], gallery["model"], gallery["images"], uri)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = milvus_rows(uri)
    assert len(rows) == len({row["id"] for row in rows}) == 20


@pytest.mark.slow
def test_a_milvus_error_raised_by_an_insert_is_one_line(gallery, tmp_path, capsys, monkeypatch):
    """The MilvusException pymilvus raises for a full disk (its text as Milvus Lite words it), from the upsert."""
    import pymilvus

    def full(self, *args, **kwargs):
        raise pymilvus.exceptions.MilvusException(
            code=1,
            message="[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device",
        )

    monkeypatch.setattr(pymilvus.MilvusClient, "upsert", full)
    uri = tmp_path / "g.db"
    argv = [
        "index",
        "--model",
        str(gallery["model"]),
        "--images",
        str(gallery["images"]),
        "--milvus-uri",
        str(uri),
    ]
    assert tagclip([*argv, "--collection", "g", "--quiet"]) == 1
    assert one_error_line(capsys).startswith(
        f"tagclip index: error: Milvus at {uri}: [Errno 28] Error writing bytes"
    )


# kill -9 while Milvus Lite (in this process) appends the second upsert to its write-ahead log: the record is
# written, cut short by 16 bytes as an interrupted write leaves it, and the process dies
KILL_INSIDE_THE_WRITE = """
import os, signal, runpy, sys
from milvus_lite.storage import wal
from modeling_tagclip.retrieval import milvus as milvus_store
milvus_store.INSERT_BATCH = 3  # several upserts per shard
write, calls = wal.WAL.write_insert, []
def dying(self, batch):
    calls.append(1)
    write(self, batch)
    if len(calls) == 2:
        self._data_sink.truncate(self._data_sink.tell() - 16)
        os.kill(os.getpid(), signal.SIGKILL)
wal.WAL.write_insert = dying
sys.argv = ["tagclip", *sys.argv[1:]]
runpy.run_module("modeling_tagclip.cli", run_name="__main__")
"""


@pytest.mark.slow
def test_kill_9_inside_a_milvus_lite_write_then_a_rerun_equals_an_uninterrupted_run(gallery, tmp_path):
    model, images = gallery["model"], gallery["images"]
    clean = milvus_index_cli([sys.executable, *TAGCLIP_CLI], model, images, str(tmp_path / "clean.db"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    uri = str(tmp_path / "killed.db")
    killed = milvus_index_cli([sys.executable, "-c", KILL_INSIDE_THE_WRITE], model, images, uri)
    assert killed.returncode == -9, killed.stderr[-3000:]
    kept = len(milvus_rows(uri))
    assert kept < 20  # the run died part-way
    again = milvus_index_cli([sys.executable, *TAGCLIP_CLI], model, images, uri)
    assert again.returncode == 0 and f"indexed {20 - kept} new images" in again.stdout, again.stderr[-3000:]
    assert_same_milvus_rows(
        milvus_rows(str(tmp_path / "clean.db")), milvus_rows(uri)
    )  # no duplicate, nothing missing


# `tagclip index --add` that holds the database: on its first insert it says so (a marker file) and waits for
# the test's go-ahead, so that a second --add runs while it holds the database
HOLD_THE_DATABASE = """
import os, runpy, sys, time
from pathlib import Path
from modeling_tagclip.retrieval import milvus as milvus_store
add = milvus_store.MilvusGallery.add
marker, release = Path(os.environ["HOLDING"]), Path(os.environ["RELEASE"])
def holding(self, *args, **kwargs):
    marker.touch()
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return add(self, *args, **kwargs)
milvus_store.MilvusGallery.add = holding
sys.argv = ["tagclip", *sys.argv[1:]]
runpy.run_module("modeling_tagclip.cli", run_name="__main__")
"""


@pytest.mark.slow
def test_two_concurrent_adds_lose_nothing(gallery, tmp_path):
    import os

    root = tmp_path / "crops"
    shutil.copytree(gallery["images"] / "train", root / "seed")
    uri, model = str(tmp_path / "g.db"), gallery["model"]
    first = milvus_index_cli([sys.executable, *TAGCLIP_CLI], model, root, uri)
    assert first.returncode == 0, first.stderr[-3000:]
    seed = len(milvus_rows(uri))
    shutil.copytree(gallery["images"] / "test", root / "a")
    shutil.copytree(gallery["images"] / "test", root / "b")
    holding, release = tmp_path / "holding", tmp_path / "release"
    env = {**os.environ, "HOLDING": str(holding), "RELEASE": str(release), "OMP_NUM_THREADS": "1"}
    argv = ["index", "--quiet", "--model", str(model), "--milvus-uri", uri, "--collection", "g", "--add"]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_DATABASE, *argv, "--images", str(root / "a")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not holding.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert holding.exists(), holder.communicate()[1][-3000:]
        second = subprocess.run(
            [sys.executable, *TAGCLIP_CLI, *argv, "--images", str(root / "b")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        release.touch()
        out, err = holder.communicate(timeout=300)
    assert holder.returncode == 0, err[-3000:]
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1] == (
        f"tagclip index: error: another process is using the Milvus Lite database {uri} (Milvus Lite opens it in "
        "one process at a time): run the command again when that process has finished; nothing was changed"
    )
    assert "Traceback" not in second.stderr
    again = subprocess.run(
        [sys.executable, *TAGCLIP_CLI, *argv, "--images", str(root / "b")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rows = milvus_rows(uri)
    paths = sorted(row["path"] for row in rows)
    assert len(rows) == len(set(paths)) == seed + 16  # both folders' 8 crops, once each
    assert {p.split("/")[0] for p in paths} == {"seed", "a", "b"}
