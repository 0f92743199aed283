"""Following a person with ``tagclip search``: one hit per track, a per-camera timeline, crops of the person as
the query (alone or fused with a description), identical answers on the embedded index and Milvus Lite, and one
clear line for a query image that is no person crop."""

from __future__ import annotations

import csv
import json

import pytest
from fixtures import save_tiny_model, synthetic_gallery
from PIL import Image

from modeling_tagclip.cli import main as tagclip

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
    return {"root": root, "images": images, "crops": crops, "embedded": ["--index", str(root / "g.idx")],
            "milvus": ["--milvus-uri", uri, "--collection", "g"]}  # fmt: skip


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
    fused = search(capsys, galleries["embedded"], "--per-crop", "--text-weight", "1", "a person", "--image",
                   str(galleries["images"] / crop))[0]  # fmt: skip
    text = search(capsys, galleries["embedded"], "--per-crop", "a person")[0]
    assert [h["index"] for h in fused["hits"]] == [
        h["index"] for h in text["hits"]
    ]  # weight 1: the text alone
    assert fused["query"].startswith("a person + crops")


@pytest.mark.parametrize("mode", [["-k", "5"], ["--per-crop"], ["--group-by", "camera"]])
def test_both_backends_answer_the_same(galleries, capsys, mode):
    image = str(galleries["images"] / galleries["crops"][7])
    for query in (["a person in a red coat"], ["--image", image], ["a person", "--image", image]):
        embedded = search(capsys, galleries["embedded"], *mode, *query)
        milvus = search(capsys, galleries["milvus"], *mode, *query)
        assert json.dumps(_rounded(embedded), sort_keys=True) == json.dumps(_rounded(milvus), sort_keys=True)


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):  # a backend's own row id and predicted-view score are not the answer
        return {k: _rounded(v) for k, v in value.items() if k not in ("index", "predicted_view_score")}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def test_a_query_image_that_is_no_person_crop_is_one_line(galleries, capsys, tmp_path):
    tiny, huge = tmp_path / "dot.png", tmp_path / "frame.png"
    Image.new("RGB", (1, 1)).save(tiny)
    Image.new("RGB", (5000, 4000)).save(huge)
    for path, message in (
        (tiny, "is 1x1 pixels: a person crop has at least 16"),
        (huge, "frame.png: image of 5000x4000 = 20000000 pixels exceeds the limit of 16000000"),
    ):
        capsys.readouterr()
        assert tagclip(["search", *galleries["embedded"], "--image", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    with pytest.raises(SystemExit, match="give a description, --image CROP, or both"):
        tagclip(["search", *galleries["embedded"]])
