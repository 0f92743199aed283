"""The CARGO-layout re-ID set cut from the synthetic footage: files and names, identities, cameras and views of
the footage's ground truth, the query / gallery split every CARGO protocol needs, determinism, bad input."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from modeling_tagclip.data.footage_reid import cut_reid_dataset, render_footage_reid
from modeling_tagclip.data.reid import detect_dataset, load_reid_dataset, parse_cargo_name
from modeling_tagclip.metrics.reid import evaluate_protocols
from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND
from modeling_tagclip.video.crops import crop_box
from modeling_tagclip.video.footage import render_footage
from modeling_tagclip.video.mot_eval import read_gt

TINY = {
    "ground_cameras": 3,
    "aerial_cameras": 2,
    "people": 6,
    "people_per_camera": 4,
    "seconds": 3.0,
    "fps": 5.0,
    "size": (96, 128),
}
SEED = 3


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """(footage folder, set folder, what cut_reid_dataset returned) for 3 crops a person and camera."""
    root = tmp_path_factory.mktemp("footage_reid")
    footage = render_footage(root / "footage", seed=SEED, **TINY)
    info = cut_reid_dataset(footage.root, root / "set", crops_per_camera=3, seed=SEED)
    return footage.root, root / "set", info


def _truth(footage: Path) -> tuple[dict[str, str], dict[tuple[int, str], list]]:
    """Footage camera -> view, and (identity, camera) -> its ground-truth boxes (x1 y1 x2 y2)."""
    views = {
        entry["camera"]: entry["view"] for entry in yaml.safe_load((footage / "cameras.yaml").read_text())
    }
    boxes = defaultdict(list)
    for camera in views:
        for ids, frame_boxes in read_gt(footage / "gt" / f"{camera}.txt").values():
            for pid, box in zip(ids.tolist(), frame_boxes, strict=True):
                boxes[(pid, camera)].append(box)
    return views, dict(boxes)


def _files(folder: Path) -> dict[str, list[Path]]:
    return {split: sorted((folder / split).glob("Cam*/*.jpg")) for split in ("train", "query", "gallery")}


def test_crops_are_the_footage_truth_in_cargo_names(cut):
    from PIL import Image

    footage, folder, info = cut
    views, boxes = _truth(footage)
    camera_of = {f"Cam{n}": camera for camera, n in ((c, int(v[3:])) for c, v in info["cameras"].items())}
    # aerial cameras on Cam1-5, ground ones on Cam6-13, in camera-file order
    assert info["cameras"] == {
        "ground-01": "Cam6",
        "ground-02": "Cam7",
        "ground-03": "Cam8",
        "aerial-01": "Cam1",
        "aerial-02": "Cam2",
    }
    seen, per_pair = set(), defaultdict(int)
    files = _files(folder)
    assert {split: len(paths) for split, paths in files.items()} == info["counts"]
    for path in (p for paths in files.values() for p in paths):
        pid, camera, view = parse_cargo_name(path.name)
        assert path.parent.name == f"Cam{camera}" and path.name.split("_")[1] == "day"
        source = camera_of[f"Cam{camera}"]
        assert view == (AERIAL if views[source] == "aerial" else GROUND)
        assert (pid, source) in boxes  # the identity is on that camera in the ground truth
        size = Image.open(path).size[::-1]
        windows = {
            (w[0].stop - w[0].start, w[1].stop - w[1].start)
            for w in (crop_box(b, TINY["size"])[1] for b in boxes[(pid, source)])
        }
        assert size in windows  # cut at one of its ground-truth boxes, with ingest's margin
        seen.add((pid, source))
        per_pair[(pid, source)] += 1
    assert seen == set(boxes)  # every identity on every camera it is seen by
    assert all(1 <= n <= 3 for n in per_pair.values()) and max(per_pair.values()) == 3
    names = [p.name for paths in files.values() for p in paths]
    assert len(set(names)) == len(names)  # (pid, idx) unique over the cameras


def test_split_gives_every_query_a_match_on_another_camera(cut):
    footage, folder, info = cut
    files = _files(folder)
    parsed = {split: {parse_cargo_name(p.name) for p in paths} for split, paths in files.items()}
    pairs = {split: {(pid, camera) for pid, camera, _ in rows} for split, rows in parsed.items()}
    train, test = info["identities"]["train"], info["identities"]["test"]
    assert sorted(train + test) == sorted({pid for pid, _ in set().union(*pairs.values())})
    assert {pid for pid, _ in pairs["train"]} == set(train) and not set(train) & set(test)
    assert {pid for pid, _ in pairs["query"] | pairs["gallery"]} == set(test)
    assert len(test) == round(0.75 * (len(train) + len(test)))
    for pid, camera in pairs["query"]:
        assert (pid, camera) not in pairs["gallery"]  # a camera is all query or all gallery
        assert any(p == pid and c != camera for p, c in pairs["gallery"])
    query_cameras = {(pid, camera, view) for pid, camera, view in parsed["query"]}
    for pid in test:  # at most one query camera per view
        views = [view for p, _, view in query_cameras if p == pid]
        assert len(views) == len(set(views))
    assert {view for _, _, view in query_cameras} == {AERIAL, GROUND}


def test_loads_as_cargo_and_every_protocol_has_queries(cut):
    _, folder, info = cut
    assert detect_dataset(folder) == "cargo"
    data = load_reid_dataset(str(folder))
    assert (len(data.train), len(data.query), len(data.gallery)) == tuple(info["counts"].values())
    # perfect features (one-hot by identity): every protocol scores 100 on a non-empty set of queries
    pids = sorted(set(data.query["person_id"]) | set(data.gallery["person_id"]))
    onehot = lambda table: torch.eye(len(pids))[[pids.index(p) for p in table["person_id"]]]  # noqa: E731
    results = evaluate_protocols(
        onehot(data.query), onehot(data.gallery), data.query, data.gallery, data.protocols
    )
    assert set(results) == {"ALL", "A<->G", "G<->G", "A<->A", "A<->G (VDT)", "G->A"}
    for name, metrics in results.items():
        assert metrics["num_queries"] > 0, name
        assert metrics["R1"] == metrics["mAP"] == 100.0, name


def test_render_footage_reid_is_the_cut_of_its_footage_and_records_how(cut, tmp_path):
    _, folder, info = cut
    out = tmp_path / "rendered"
    written = render_footage_reid(out, seed=SEED, footage=TINY, crops_per_camera=3)
    assert {split: [p.name for p in paths] for split, paths in _files(out).items()} == {
        split: [p.name for p in paths] for split, paths in _files(folder).items()
    }
    for a, b in zip(_files(out)["query"], _files(folder)["query"], strict=True):
        assert a.read_bytes() == b.read_bytes()  # same seed: the same footage and the same crops
    recorded = json.loads((out / "dataset_info.json").read_text())
    assert recorded == written
    assert recorded["generator"] == "modeling_tagclip.data.footage_reid" and recorded["layout"] == "cargo"
    assert recorded["footage"] == {
        "seed": SEED,
        **{k: list(v) if k == "size" else v for k, v in TINY.items()},
    }
    assert recorded["counts"] == info["counts"] and recorded["identities"] == info["identities"]
    assert sorted(p.name for p in out.iterdir()) == ["dataset_info.json", "gallery", "query", "train"]
    with pytest.raises(FileExistsError, match="already holds a re-ID set"):
        render_footage_reid(out, seed=SEED, footage=TINY)


def test_another_split_seed_draws_other_test_identities(cut, tmp_path):
    footage, _, info = cut
    other = cut_reid_dataset(footage, tmp_path / "other", crops_per_camera=3, seed=SEED + 1)
    assert other["identities"]["test"] != info["identities"]["test"]
    assert sum(other["counts"].values()) == sum(info["counts"].values())  # the same crops, split otherwise


def _footage_copy(footage: Path, dest: Path, cameras: list[dict]) -> Path:
    dest.mkdir()
    (dest / "cameras.yaml").write_text(yaml.safe_dump(cameras))
    (dest / "gt").mkdir()
    for entry in cameras:
        source = footage / "gt" / f"{entry['camera']}.txt"
        if source.is_file():
            (dest / "gt" / f"{entry['camera']}.txt").write_bytes(source.read_bytes())
    return dest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda cams: cams + [{**cams[-1], "camera": f"aerial-{k}"} for k in range(4)], "more than 5 aerial"),
        (lambda cams: [{k: v for k, v in c.items() if k != "view"} for c in cams], "has no view"),
        (lambda cams: cams + [{**cams[0], "camera": "ground-09", "source": "x.mp4"}], "no ground truth"),
    ],
)
def test_a_footage_folder_that_does_not_fit_is_one_line(cut, tmp_path, change, message):
    footage, _, _ = cut
    cameras = change(yaml.safe_load((footage / "cameras.yaml").read_text()))
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        cut_reid_dataset(_footage_copy(footage, tmp_path / "f", cameras), tmp_path / "out")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"crops_per_camera": 0}, "crops_per_camera must be >= 1, got 0"),
        ({"test_fraction": 1.0}, r"test_fraction must be in \(0, 1\), got 1.0"),
    ],
)
def test_bad_settings_are_one_line(cut, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cut_reid_dataset(cut[0], tmp_path / "out", **kwargs)


def test_a_folder_without_footage_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a footage folder .no cameras.yaml"):
        cut_reid_dataset(tmp_path, tmp_path / "out")


def test_footage_of_one_identity_is_refused(cut, tmp_path):
    footage, _, _ = cut
    camera = yaml.safe_load((footage / "cameras.yaml").read_text())[:1]  # one camera, one identity on it
    gt = _footage_copy(footage, tmp_path / "f", camera) / "gt" / f"{camera[0]['camera']}.txt"
    rows = np.loadtxt(gt, delimiter=",", ndmin=2)
    np.savetxt(gt, rows[rows[:, 1] == rows[0, 1]], delimiter=",", fmt="%g")
    with pytest.raises(ValueError, match="shows 1 identities; a re-ID set needs >= 2"):
        cut_reid_dataset(tmp_path / "f", tmp_path / "out")
