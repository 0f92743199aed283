"""``accelerate launch`` scale-out of ``tagclip index``: 2 CPU processes write the 1-process index byte for byte,
and the 1-process Milvus Lite collection row for row (the ``torchrun`` twins are in test_gallery_db.py and
test_milvus_store.py)."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO_ROOT, save_tiny_model, synthetic_gallery

INDEX = [
    "-m",
    "modeling_tagclip.cli",
    "index",
    "--batch-size",
    "2",
    "--shard-size",
    "3",
    "--workers",
    "0",
    "--quiet",
    "--device",
    "cpu",
]
ACCELERATE = [
    str(Path(sys.executable).with_name("accelerate")),
    "launch",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _index(prefix: list[str], model: Path, images: Path, out: Path, *target: str) -> str:
    """``tagclip index`` into the index folder ``out``, or into ``target`` (``--milvus-uri ...``) if given."""
    args = [*INDEX, "--model", str(model), "--images", str(images), *(target or ["--out", str(out)])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*prefix, *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout


def _rows(index: Path) -> list[tuple]:
    with sqlite3.connect(index / "gallery.sqlite") as db:
        return list(db.execute("SELECT * FROM crops ORDER BY id"))


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_write_the_same_index_as_one(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    images = synthetic_gallery(tmp_path / "data") / "images"
    one = _index([sys.executable], model, images, tmp_path / "one")
    launch = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port())]
    two = _index(launch, model, images, tmp_path / "two")
    assert "indexed 20 images" in one and "processes" not in one
    assert two.count("indexed 20 images") == 1 and "; 2 processes)" in two  # rank 0 reports, 2 ranks ran
    segment = "segments/seg_0000000000.safetensors"
    assert (tmp_path / "one" / segment).read_bytes() == (tmp_path / "two" / segment).read_bytes()
    assert _rows(tmp_path / "one") == _rows(tmp_path / "two") and len(_rows(tmp_path / "one")) == 20

    # accelerate 1.x: `--cpu` goes to its simple launcher, which starts N processes only through mpirun
    # (--mpirun_hostfile): one process, the same index
    cpu = _index([*ACCELERATE, "--cpu", "--num_processes", "2"], model, images, tmp_path / "cpu")
    assert (
        "processes" not in cpu
        and (tmp_path / "cpu" / segment).read_bytes() == (tmp_path / "one" / segment).read_bytes()
    )


def _collection(uri: str) -> list[dict]:
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    with MilvusGallery(uri, "g") as gallery:
        rows = gallery.client.query("g", filter="", output_fields=["*"], limit=1000)
    return sorted(rows, key=lambda row: row["id"])


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == 20
    for x, y in zip(a, b, strict=True):
        assert {k: v for k, v in x.items() if k != "vector"} == {k: v for k, v in y.items() if k != "vector"}
        assert max(abs(p - q) for p, q in zip(x["vector"], y["vector"], strict=True)) <= 1e-6


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_write_the_same_milvus_collection_as_one(tmp_path):
    pytest.importorskip("pymilvus")
    model = save_tiny_model(tmp_path / "model")
    images = synthetic_gallery(tmp_path / "data") / "images"

    def into(prefix: list[str], name: str) -> str:
        target = ["--milvus-uri", str(tmp_path / name), "--collection", "g"]
        return _index(prefix, model, images, tmp_path / name, *target)

    one = into([sys.executable], "one.db")
    assert f"indexed 20 new images from {images} into {tmp_path / 'one.db'} collection g (flat)" in one
    launch = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port())]
    two = into(launch, "two.db")
    assert sorted(line.split(" new images")[0] for line in two.splitlines() if "indexed" in line) == [
        "rank 0 of 2: indexed 11",  # shards of 3: rank 0 takes shards 0, 2, 4, 6; rank 1 shards 1, 3, 5
        "rank 1 of 2: indexed 9",
    ]
    # (`--cpu --num_processes 2` starts one process: see the test above)
    _same_rows(_collection(str(tmp_path / "one.db")), _collection(str(tmp_path / "two.db")))


def test_each_rank_reports_its_line_in_one_write(monkeypatch):
    """Ranks share stdout; under PYTHONUNBUFFERED ``print`` writes text and newline apart, so two ranks' reports
    merged into one line (seen in CI). The report is one write of the line and its newline."""
    from modeling_tagclip.retrieval import cli

    writes: list[str] = []

    class Stream:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    monkeypatch.setattr(sys, "stdout", Stream())
    cli._report_line("rank 1 of 2: indexed 9 new images")
    assert writes == ["rank 1 of 2: indexed 9 new images\n", "<flush>"]
