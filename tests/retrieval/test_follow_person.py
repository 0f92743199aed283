"""Following a person with ``tagclip search``: one hit per track, a per-camera timeline, crops of the person as
the query (image files, or a hit or a track of the gallery by its stored embeddings; alone or fused with a
description; mean or max set rule), identical answers and hit ids on the embedded index and Milvus Lite, and
one clear line for a query image that is no person crop, a hit id or a track the gallery does not have."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
from fixtures import save_tiny_model, synthetic_gallery
from PIL import Image

from modeling_tagclip.cli import main as tagclip
from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.gallery_types import crop_id

pytestmark = pytest.mark.slow  # index + search with a tiny model, Milvus Lite

START = 1_767_261_600  # 2026-01-01T10:00:00Z


@pytest.fixture(scope="module")
def galleries(tmp_path_factory):
    """The same crops with tracks, cameras and times, in an index folder and a Milvus Lite collection."""
    root = tmp_path_factory.mktemp("follow")
    model = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    crops = sorted(p.relative_to(images).as_posix() for p in images.rglob("*.png"))
    sidecar = root / "tracks.csv"
    with open(sidecar, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "camera", "timestamp", "track", "t_start", "t_end"])
        for i, path in enumerate(crops):  # 3 crops a track, 2 cameras, a track every 40 s
            track, camera = i // 3, f"cam{(i // 3) % 2}"
            t = START + 40 * track + (i % 3)
            writer.writerow([path, camera, t, f"t{track}", START + 40 * track, START + 40 * track + 2])
    common = ["--model", str(model), "--images", str(images), "--metadata", str(sidecar), "--workers", "0"]
    assert tagclip(["index", *common, "--out", str(root / "g.idx"), "--quiet"]) == 0
    uri = str(root / "g.db")
    assert tagclip(["index", *common, "--milvus-uri", uri, "--collection", "g", "--quiet"]) == 0
    return {
        "root": root,
        "images": images,
        "crops": crops,
        "embedded": ["--index", str(root / "g.idx")],
        "milvus": ["--milvus-uri", uri, "--collection", "g"],
        "model": model,
    }


def search(capsys, source: list[str], *args: str) -> list[dict]:
    capsys.readouterr()
    assert tagclip(["search", *source, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_hit_per_track_by_default(galleries, capsys):
    tracks = search(capsys, galleries["embedded"], "-k", "4", "a person")[0]["hits"]
    keys = [(h["camera"], h["track"]) for h in tracks]
    assert len(keys) == 4 and len(set(keys)) == 4 and [h["rank"] for h in tracks] == [1, 2, 3, 4]
    assert all(1 <= h["crops"] <= 3 and h["t_start"] <= h["t_end"] for h in tracks)
    crops = search(capsys, galleries["embedded"], "-k", "4", "--per-crop", "a person")[0]["hits"]
    assert (
        len(crops) == 4 and "crops" not in crops[0] and crops[0]["score"] == pytest.approx(tracks[0]["score"])
    )


def test_the_timeline_orders_cameras_and_sightings_and_marks_pauses(galleries, capsys):
    line = search(capsys, galleries["embedded"], "--group-by", "camera", "--gap", "60", "a person")[0][
        "timeline"
    ]
    cameras = line["cameras"]
    assert set(cameras) == {"cam0", "cam1"}
    firsts = [row["sightings"][0]["t_start"] for row in cameras.values()]
    assert firsts == sorted(firsts)  # cameras by their first sighting
    for row in cameras.values():
        starts = [s["t_start"] for s in row["sightings"]]
        assert starts == sorted(starts) and len(starts) == len({s["track"] for s in row["sightings"]})
        # same-camera tracks are 80 s apart, 2 s long: every pause of 78 s is over the 60 s gap
        assert row["gaps"] == [
            [a["t_end"], b["t_start"]] for a, b in zip(row["sightings"], row["sightings"][1:], strict=False)
        ]
    wide = search(capsys, galleries["embedded"], "--group-by", "camera", "--gap", "100", "a person")[0][
        "timeline"
    ]
    assert all(row["gaps"] == [] for row in wide["cameras"].values())


def test_a_crop_of_the_person_finds_its_own_track_first(galleries, capsys):
    crop = galleries["crops"][4]  # track t1
    hits = search(capsys, galleries["embedded"], "--image", str(galleries["images"] / crop))[0]["hits"]
    assert hits[0]["track"] == "t1" and hits[0]["score"] == pytest.approx(1.0, abs=1e-4)
    fused = search(
        capsys,
        galleries["embedded"],
        "--per-crop",
        "--text-weight",
        "1",
        "a person",
        "--image",
        str(galleries["images"] / crop),
    )[0]
    text = search(capsys, galleries["embedded"], "--per-crop", "a person")[0]
    assert [h["index"] for h in fused["hits"]] == [
        h["index"] for h in text["hits"]
    ]  # weight 1: the text alone
    assert fused["query"].startswith("a person + crops")


def test_a_hit_id_queries_with_that_crops_stored_embeddings(galleries, capsys, tmp_path):
    everything = ["--per-crop", "-k", str(len(galleries["crops"]))]
    page = tmp_path / "hits.html"
    first = search(capsys, galleries["embedded"], "-k", "3", "--html", str(page), "a person")[0]["hits"][0]
    assert f"id {first['id']}<br>" in page.read_text()  # the page shows the id to search with
    rel = next(crop for crop in galleries["crops"] if first["path"].endswith("/" + crop))
    assert first["id"] == crop_id(rel)  # the hit id is the crop's path key
    liked = search(capsys, galleries["embedded"], *everything, "--like", first["id"])[0]
    image = search(capsys, galleries["embedded"], *everything, "--image", first["path"])[0]
    assert liked["query"] == f"like {first['id']}"
    assert liked["hits"][0]["id"] == first["id"] and liked["hits"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert [h["id"] for h in liked["hits"]] == [h["id"] for h in image["hits"]]  # no image read, same query
    assert [h["score"] for h in liked["hits"]] == pytest.approx([h["score"] for h in image["hits"]], abs=1e-5)


def test_a_track_is_the_mean_or_the_best_of_its_crops(galleries, capsys):
    everything = ["--per-crop", "-k", str(len(galleries["crops"]))]
    t1 = [str(galleries["images"] / crop) for crop in galleries["crops"][3:6]]
    files = [arg for path in t1 for arg in ("--image", path)]
    for rule in ("mean", "max"):
        rule_flags = [*everything, "--set-rule", rule]
        track = search(capsys, galleries["embedded"], *rule_flags, "--track", "cam1:t1")[0]["hits"]
        crops = search(capsys, galleries["embedded"], *rule_flags, *files)[0]["hits"]
        assert [h["id"] for h in track] == [h["id"] for h in crops]
        assert [h["score"] for h in track] == pytest.approx([h["score"] for h in crops], abs=1e-5)
    assert {h["track"] for h in track[:3]} == {"t1"}  # max: the track's own three crops score 1, first
    assert [h["score"] for h in track[:3]] == pytest.approx([1.0] * 3, abs=1e-5)
    per_track = search(capsys, galleries["embedded"], "-k", "3", "--set-rule", "max", "--track", "cam1:t1")
    assert per_track[0]["hits"][0]["track"] == "t1" and per_track[0]["hits"][0]["crops"] == 3


def test_a_track_fused_with_a_description_is_the_weighted_sum(galleries, capsys):
    everything = ["--per-crop", "-k", str(len(galleries["crops"]))]
    described = search(capsys, galleries["embedded"], *everything, "a person")[0]["hits"]
    text = {h["id"]: h["score"] for h in described}
    track = search(capsys, galleries["embedded"], *everything, "--track", "cam0:t2")[0]["hits"]
    fused = search(
        capsys, galleries["embedded"], *everything, "a person", "--track", "cam0:t2", "--text-weight", "0.3"
    )[0]
    assert fused["query"] == "a person + track cam0:t2 (text weight 0.3)"
    expected = {h["id"]: 0.3 * text[h["id"]] + 0.7 * h["score"] for h in track}
    assert {h["id"]: h["score"] for h in fused["hits"]} == pytest.approx(expected, abs=1e-5)
    assert [h["id"] for h in fused["hits"]] == sorted(expected, key=lambda i: -expected[i])


def test_serve_takes_hit_ids_and_tracks(galleries, capsys):
    args = argparse.Namespace(
        index=galleries["embedded"][1],
        image_root=None,
        top_k=4,
        view=None,
        camera=None,
        after=None,
        before=None,
        tag=None,
        milvus_uri=None,
    )
    model, processor = cli.load_model(str(galleries["model"]))
    hit_id = crop_id(galleries["crops"][10])
    for request, flags in (
        ({"like": hit_id}, ["--like", hit_id]),
        ({"track": ["cam1:t3"], "set_rule": "max"}, ["--track", "cam1:t3", "--set-rule", "max"]),
        (
            {"query": "a person", "track": "cam0:t0", "text_weight": 0.2},
            ["a person", "--track", "cam0:t0", "--text-weight", "0.2"],
        ),
    ):
        answer = json.loads(cli.serve_answer(json.dumps(request), args, model, processor))
        expected = search(capsys, galleries["embedded"], "--per-crop", "-k", "4", *flags)[0]["hits"]
        assert [h["id"] for h in answer["hits"]] == [h["id"] for h in expected]
        assert [h["score"] for h in answer["hits"]] == pytest.approx([h["score"] for h in expected], abs=1e-5)
    for request, message in (
        ({"like": "0" * 16}, f"no crop with hit id {'0' * 16}"),
        ({"track": "cam0:t1"}, "no track cam0:t1"),
        ({"like": 5}, "like must be a string or a list of strings"),
        ({"track": "cam1:t3", "set_rule": "median"}, "set rule must be one of mean, max"),
    ):
        assert message in json.loads(cli.serve_answer(json.dumps(request), args, model, processor))["error"]


@pytest.mark.parametrize("mode", [["-k", "5"], ["--per-crop"], ["--group-by", "camera"]])
def test_both_backends_answer_the_same(galleries, capsys, mode):
    image = str(galleries["images"] / galleries["crops"][7])
    hit_id = crop_id(galleries["crops"][7])
    for query in (
        ["a person in a red coat"],
        ["--image", image],
        ["a person", "--image", image],
        ["--like", hit_id],
        ["--track", "cam1:t1"],
        ["a person", "--track", "cam1:t1", "--like", hit_id, "--set-rule", "max"],  # no ties at 1.0
        ["a person", "--track", "cam0:t2", "--text-weight", "0.3"],
    ):
        embedded = search(capsys, galleries["embedded"], *mode, *query)
        milvus = search(capsys, galleries["milvus"], *mode, *query)
        assert json.dumps(_rounded(embedded), sort_keys=True) == json.dumps(_rounded(milvus), sort_keys=True)


def _rounded(value):  # hit ids are compared: the same crop has the same id on both backends
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):  # a backend's own row key and predicted-view score are not the answer
        return {k: _rounded(v) for k, v in value.items() if k not in ("index", "predicted_view_score")}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def one_error_line(capsys, source: list[str], *args: str) -> str:
    capsys.readouterr()
    assert tagclip(["search", *source, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_query_image_that_is_no_person_crop_is_one_line(galleries, capsys, tmp_path):
    sizes = {
        "dot": (1, 1),
        "frame": (5000, 4000),
        "photo": (10000, 5000),
        "banner": (300, 40),
        "pole": (16, 200),
    }
    for name, size in sizes.items():
        Image.new("RGB", size).save(tmp_path / f"{name}.png")
    for name, message in (
        ("dot", "is 1x1 pixels: a person crop has at least 16"),
        ("frame", "frame.png: image of 5000x4000 = 20000000 pixels exceeds the limit of 16000000"),
        ("photo", "photo.png: image of 10000x5000 = 50000000 pixels exceeds the limit of 16000000"),
        ("banner", "is 300x40 pixels: a person crop is at most 2 times as wide as it is tall and 8 times"),
        ("pole", "is 16x200 pixels: a person crop is at most 2 times as wide as it is tall and 8 times"),
    ):
        assert message in one_error_line(
            capsys, galleries["embedded"], "--image", str(tmp_path / f"{name}.png")
        )
    with pytest.raises(
        SystemExit, match="give a description, --image CROP, --like HIT_ID, --track CAMERA:TRACK"
    ):
        tagclip(["search", *galleries["embedded"]])


@pytest.mark.parametrize("backend", ["embedded", "milvus"])
def test_a_hit_id_or_track_the_gallery_lacks_is_one_line(galleries, capsys, backend):
    source, unknown = galleries[backend], crop_id("not/in/the/gallery.png")
    for args, message in (
        (["--like", unknown], f"tagclip search: error: no crop with hit id {unknown} in "),
        (["--like", "42"], "tagclip search: error: '42' is not a hit id: a hit's 'id' is 16 hex digits"),
        (["--track", "cam0:t1"], "tagclip search: error: no track cam0:t1 in "),  # t1 is on cam1
        (["--track", "cam1:t999"], "tagclip search: error: no track cam1:t999 in "),
        (["--track", "t1"], "tagclip search: error: a track is CAMERA:TRACK (e.g. ground-01:3), got 't1'"),
    ):
        assert one_error_line(capsys, source, *args).startswith(message)
