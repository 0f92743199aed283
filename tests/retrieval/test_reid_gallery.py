"""Re-ID (ViSA) embeddings beside a gallery: ``tagclip index --reid-model`` and ``--add-embeddings reid`` give
the same embeddings and rankings, on the embedded index and Milvus Lite alike; ``tagclip search --reid-model``
ranks by cosine (a crop finds itself at 1.0, a query image scores as its embedding says); a second add is a
no-op; a kill -9 during an add and a rerun equal an uninterrupted add; each misuse is one error line."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from fixtures import make_visa_model, repo_env, save_tiny_model
from PIL import Image

from modeling_tagclip.cli import main as tagclip
from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
from modeling_tagclip.retrieval.embedded.reid_store import EmbeddedReid, read_reid_manifest
from modeling_tagclip.retrieval.loading import load_visa
from modeling_tagclip.retrieval.reid_encode import reid_embeddings

pytestmark = pytest.mark.slow  # index + search with tiny models, Milvus Lite

PEOPLE, CROPS = 5, 4  # 5 people, 4 crops each: two tracks of two crops, on two cameras


def noise_crops(folder):
    """Crops whose pixels are a person's own noise pattern plus a little noise per crop (a tiny random ViSA
    tells them apart), and a sidecar with view, camera and track per crop."""
    images = folder / "images"
    images.mkdir(parents=True)
    rows = []
    for person in range(PEOPLE):
        base = np.random.default_rng(person).integers(0, 256, (64, 32, 3))
        for j in range(CROPS):
            noise = np.random.default_rng(100 * person + j).integers(-30, 31, base.shape)
            name = f"p{person}_{j}.png"
            Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(images / name)
            view = "aerial" if j % 2 else "ground"
            rows.append([name, view, f"cam{j // 2}", f"t{person}"])
    sidecar = folder / "crops.csv"
    with open(sidecar, "w", newline="") as handle:
        csv.writer(handle).writerows([["path", "view", "camera", "track"], *rows])
    return images, sidecar


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reid")
    images, sidecar = noise_crops(root / "data")
    model = save_tiny_model(root / "model")
    visa = root / "visa"
    make_visa_model().save_pretrained(visa)
    make_visa_model(seed=1).save_pretrained(root / "visa-other")  # same width, other weights
    make_visa_model(hidden_size=48).save_pretrained(root / "visa-wide")  # another width
    common = ["--model", str(model), "--images", str(images), "--metadata", str(sidecar), "--workers", "0"]
    common += ["--quiet"]
    add = ["index", "--add-embeddings", "reid", "--reid-model", str(visa), "--quiet", "--shard-size", "7"]
    assert tagclip(["index", *common, "--out", str(root / "fresh.idx"), "--reid-model", str(visa)]) == 0
    assert tagclip(["index", *common, "--out", str(root / "later.idx")]) == 0
    assert tagclip([*add, "--out", str(root / "later.idx")]) == 0
    uri = str(root / "g.db")
    assert tagclip(["index", *common, "--milvus-uri", uri, "--collection", "g"]) == 0
    assert tagclip([*add, "--milvus-uri", uri, "--collection", "g"]) == 0
    return {
        "root": root,
        "images": images,
        "visa": visa,
        "model": model,
        "add": add,
        "fresh": ["--index", str(root / "fresh.idx")],
        "later": ["--index", str(root / "later.idx")],
        "milvus": ["--milvus-uri", uri, "--collection", "g"],
    }


def search(capsys, source, setup, *args):
    capsys.readouterr()
    argv = ["search", *source, "--json", "--per-crop", "--reid-model", str(setup["visa"]), *args]
    assert tagclip(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)[0]["hits"]


def error(capsys, argv) -> str:
    capsys.readouterr()
    assert tagclip(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def ranking(hits):
    """(score, id) in rank order, crops of equal score (to 1e-5) by id: rankings equal up to exact ties."""
    return sorted(((round(h["score"], 5), h["id"]) for h in hits), key=lambda p: (-p[0], p[1]))


QUERIES = [
    ["--image", "p2_0.png"],
    ["--image", "p1_1.png", "--query-view", "aerial", "--image", "p3_2.png", "--set-rule", "max"],
    ["--track", "cam0:t3"],
    ["--track", "cam1:t4", "--set-rule", "max"],
    ["--view", "aerial", "--track", "cam0:t0"],
]


def _args(setup, query):
    return [str(setup["images"] / a) if a.endswith(".png") else a for a in query]


def test_added_later_equals_built_with_and_embedded_equals_milvus(setup, capsys):
    fresh, later = (read_reid_manifest(setup["root"] / name) for name in ("fresh.idx", "later.idx"))
    assert fresh["num_rows"] == later["num_rows"] == PEOPLE * CROPS and len(later["segments"]) == 3
    a = EmbeddedReid(GalleryIndex.load(setup["root"] / "fresh.idx"))
    b = EmbeddedReid(GalleryIndex.load(setup["root"] / "later.idx"))
    assert torch.allclose(a.vectors, b.vectors, atol=1e-6) and bool(a.valid.all())
    for query in QUERIES:
        args = [*_args(setup, query), "-k", str(PEOPLE * CROPS)]  # every crop: no tie across the cut-off
        expected = ranking(search(capsys, setup["fresh"], setup, *args))
        assert len(expected) == (PEOPLE * CROPS) // (2 if "--view" in query else 1)
        assert ranking(search(capsys, setup["later"], setup, *args)) == expected, query
        assert ranking(search(capsys, setup["milvus"], setup, *args)) == expected, query
    like = search(capsys, setup["fresh"], setup, "--image", str(setup["images"] / "p2_0.png"), "-k", "1")[0]
    assert ranking(search(capsys, setup["milvus"], setup, "--like", like["id"], "-k", "20")) == ranking(
        search(capsys, setup["fresh"], setup, "--like", like["id"], "-k", "20")
    )


def test_scores_are_the_cosines_of_the_visa_embeddings(setup, capsys):
    visa = load_visa(setup["visa"])
    crop = Image.open(setup["images"] / "p2_1.png").convert("RGB")
    query = reid_embeddings(visa, [crop], ["aerial"])  # p2_1 is an aerial crop
    hits = search(
        capsys,
        setup["fresh"],
        setup,
        "--image",
        str(setup["images"] / "p2_1.png"),
        "--query-view",
        "aerial",
        "-k",
        str(PEOPLE * CROPS),
    )
    assert hits[0]["path"].endswith("p2_1.png") and hits[0]["score"] == pytest.approx(1.0, abs=1e-5)
    gallery = EmbeddedReid(GalleryIndex.load(setup["root"] / "fresh.idx"))
    expected = (gallery.vectors @ query[0]).tolist()
    assert [h["score"] for h in hits] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)
    # the person's other aerial crop next: the tiny random ViSA tells the noise patterns apart within a view
    assert hits[1]["path"].endswith("p2_3.png")
    liked = search(capsys, setup["fresh"], setup, "--like", hits[0]["id"], "-k", "3")
    assert liked[0]["id"] == hits[0]["id"] and liked[0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_a_second_add_is_a_no_op(setup, capsys):
    folder = setup["root"] / "later.idx"
    before = {p: p.stat().st_mtime_ns for p in (folder / "reid").iterdir()}
    for source in (["--out", str(folder)], setup["milvus"]):
        capsys.readouterr()
        assert tagclip([*setup["add"], *source]) == 0
        assert "already has a reid embedding: nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (folder / "reid").iterdir()} == before


@pytest.mark.parametrize("backend", ["fresh", "milvus"])
def test_another_visa_model_is_one_error_naming_the_model_that_built_them(setup, capsys, backend):
    source, root = setup[backend], setup["root"]
    image = ["--image", str(setup["images"] / "p0_0.png"), "--json"]
    wide = error(capsys, ["search", *source, "--reid-model", str(root / "visa-wide"), *image])
    assert "gives 96-d embeddings" in wide and "are 64-d" in wide and str(setup["visa"]) in wide
    other = error(capsys, ["search", *source, "--reid-model", str(root / "visa-other"), *image])
    assert "another ViSA model" in other and str(setup["visa"]) in other
    add = [*setup["add"][:3], "--reid-model", str(root / "visa-other")]
    target = ["--out", str(root / "fresh.idx")] if backend == "fresh" else source
    assert "another ViSA model" in error(capsys, [*add, *target])


def test_a_gallery_without_reid_embeddings_and_a_text_query_are_one_error_line(setup, tmp_path, capsys):
    images, sidecar = noise_crops(tmp_path / "data")
    out = tmp_path / "plain.idx"
    common = ["--model", str(setup["model"]), "--images", str(images), "--workers", "0", "--quiet"]
    assert tagclip(["index", *common, "--out", str(out)]) == 0
    reid = ["--reid-model", str(setup["visa"]), "--image", str(images / "p0_0.png")]
    assert "--add-embeddings reid" in error(capsys, ["search", "--index", str(out), *reid])
    text = error(capsys, ["search", *setup["fresh"], "--reid-model", str(setup["visa"]), "a person"])
    assert "description cannot be a --reid-model query" in text
    assert "needs --reid-model" in error(capsys, ["index", "--add-embeddings", "reid", "--out", str(out)])


def test_crops_added_without_reid_are_named_until_embedded(setup, tmp_path, capsys):
    images, sidecar = noise_crops(tmp_path / "data")
    out, visa = tmp_path / "grow.idx", str(setup["visa"])
    common = ["--model", str(setup["model"]), "--workers", "0", "--quiet", "--out", str(out)]
    first = images / "first"
    first.mkdir()
    for path in list(images.glob("p0_*.png")):
        path.rename(first / path.name)
    assert tagclip(["index", *common, "--images", str(first), "--reid-model", visa]) == 0
    (images / "p1_0.png").rename(first / "p1_0.png")
    assert tagclip(["index", *common, "--images", str(first), "--add"]) == 0
    query = ["search", "--index", str(out), "--reid-model", visa, "--image", str(first / "p0_0.png")]
    assert "cover 4 of its 5 crops" in error(capsys, query)
    assert (
        tagclip(["index", "--add-embeddings", "reid", "--reid-model", visa, "--out", str(out), "--quiet"])
        == 0
    )
    capsys.readouterr()
    assert tagclip([*query, "--json", "--per-crop"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["hits"]) == 5


KILLER = """
import os, signal, sys
from modeling_tagclip.retrieval.embedded import reid_store
from modeling_tagclip.cli import main
commits = []
real = reid_store.write_json
def write_json(path, obj, **kwargs):
    if len(commits) == int(os.environ["KILL_AFTER"]):
        os.kill(os.getpid(), signal.SIGKILL)  # after the segment file, before its manifest
    commits.append(path)
    real(path, obj, **kwargs)
reid_store.write_json = write_json
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_during_add_then_rerun_equals_an_uninterrupted_add(setup, tmp_path):
    import shutil

    killed, clean = tmp_path / "killed.idx", tmp_path / "clean.idx"
    for folder in (killed, clean):
        shutil.copytree(setup["root"] / "later.idx", folder, ignore=shutil.ignore_patterns("reid"))
    add = [
        "index",
        "--add-embeddings",
        "reid",
        "--reid-model",
        str(setup["visa"]),
        "--quiet",
        "--shard-size",
        "3",
    ]
    env = repo_env(tmp_path, KILL_AFTER="2")
    run = subprocess.run(
        [sys.executable, "-c", KILLER, *add, "--out", str(killed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert (
        read_reid_manifest(killed)["num_rows"] == 6
    )  # two shards committed, the third written, not committed
    assert (killed / "reid" / "seg_000000006.safetensors").is_file()
    for folder in (killed, clean):
        done = subprocess.run(
            [sys.executable, "-m", "modeling_tagclip.cli", *add, "--out", str(folder)],
            env=repo_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    a, b = read_reid_manifest(killed), read_reid_manifest(clean)
    assert a == b and a["num_rows"] == PEOPLE * CROPS  # same files, same checksums
    assert {p.name for p in (killed / "reid").iterdir()} == {p.name for p in (clean / "reid").iterdir()}
    assert not os.environ.get("KILL_AFTER")
