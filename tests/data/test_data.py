"""Tests for modeling_tagclip.data.text_retrieval: loaders for the four annotation formats, pairs view, id remap, validation split."""

import logging
import os
import re
from pathlib import Path

import pytest
from datasets import ClassLabel, DatasetDict, List, Value
from fixtures import make_tagpedes, tag_entry, write_annotations, write_png

from modeling_tagclip.data.text_retrieval import (
    IMAGE_FEATURES,
    PAIR_FEATURES,
    load_cuhk_pedes,
    load_dataset_split,
    load_icfg_pedes,
    load_rstpreid,
    load_tagpedes,
    pairs_view,
    remap_ids,
    split_validation,
)

LOGGER = "modeling_tagclip.data.text_retrieval"


@pytest.fixture
def tagpedes(tmp_path):
    train = [tag_entry(7, "a", 0), tag_entry(7, "b", 1), tag_entry(3, "c", 0), tag_entry(9, "d", 1)]
    test = [tag_entry(11, "e", 0), tag_entry(11, "f", 1), tag_entry(12, "g", 1, n_captions=3)]
    return make_tagpedes(tmp_path / "TAG-PEDES", train, test)


def raw_entries(path_key: str, splits: dict[str, int], processed_tokens: bool = True) -> list[dict]:
    """`count` single-image identities per split; ids start at 1 as in CUHK-PEDES."""
    entries, pid = [], 1
    for split, count in splits.items():
        for _ in range(count):
            e = {"split": split, "captions": [f"a person {pid}"], path_key: f"sub/{pid}.png", "id": pid}
            if processed_tokens:
                e["processed_tokens"] = [["a", "person", str(pid)]]
            entries.append(e)
            pid += 1
    return entries


def make_raw(root: Path, filename: str, entries: list[dict], path_key: str) -> Path:
    write_annotations(root / filename, entries)
    for e in entries:
        write_png(root / "imgs" / e[path_key])
    return root


@pytest.fixture
def cuhk(tmp_path):
    entries = raw_entries("file_path", {"train": 3, "val": 1, "test": 2})
    return make_raw(tmp_path / "CUHK-PEDES", "reid_raw.json", entries, "file_path")


@pytest.fixture
def icfg(tmp_path):
    entries = raw_entries("file_path", {"train": 2, "test": 2})
    return make_raw(tmp_path / "ICFG-PEDES", "ICFG-PEDES.json", entries, "file_path")


@pytest.fixture
def rstp(tmp_path):
    entries = raw_entries("img_path", {"train": 2, "val": 1, "test": 1}, processed_tokens=False)
    return make_raw(tmp_path / "RSTPReid", "data_captions.json", entries, "img_path")


# ----------------------------------------------------------------------------- TAG-PEDES


def test_tagpedes_rows_and_features(tagpedes):
    ds = load_tagpedes(tagpedes / "anno_dir", tagpedes / "images", "train")
    assert ds.features == IMAGE_FEATURES
    assert ds.features["view"] == ClassLabel(names=["aerial", "ground"])
    assert ds.features["captions"] == List(Value("string"))
    assert ds.features["person_id"] == Value("int64")
    assert len(ds) == 4
    assert ds["person_id"] == [7, 7, 3, 9]
    assert ds["view"] == [0, 1, 0, 1]
    assert set(ds["split"]) == {"train"}
    assert ds[0]["captions"] == ["person 7 0", "person 7 1"]
    for path in ds["image_path"]:
        assert os.path.isabs(path) and os.path.isfile(path)
    assert ds[0]["image_path"] == os.path.abspath(tagpedes / "images" / "7" / "a.png")


def test_tagpedes_single_file_and_test_split(tagpedes):
    ds = load_tagpedes(tagpedes / "anno_dir" / "test_reid.json", tagpedes / "images", "test")
    assert ds["person_id"] == [11, 11, 12]
    assert sum(len(c) for c in ds["captions"]) == 7


def test_missing_or_unknown_cam_id_is_ground_with_one_warning(tmp_path, caplog):
    train = [tag_entry(1, "a", 0), tag_entry(1, "b"), tag_entry(2, "c"), tag_entry(2, "d", cam_id=5)]
    root = make_tagpedes(tmp_path, train, [])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ds = load_tagpedes(root / "anno_dir", root / "images", "train")
    assert ds["view"] == [0, 1, 1, 1]
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "3 of 4 entries have no valid cam_id" in warnings[0].getMessage()


def test_missing_images_reported_together(tmp_path):
    train = [tag_entry(i, f"x{i}", 0) for i in range(8)]
    root = make_tagpedes(tmp_path, train, [])
    for i in range(7):  # remove 7 of 8 images
        (root / "images" / train[i]["file_path"]).unlink()
    with pytest.raises(FileNotFoundError, match="7 of 8 images listed in") as err:
        load_tagpedes(root / "anno_dir", root / "images", "train")
    message = str(err.value)
    assert "0/x0.png" in message and "and 2 more" in message and "6/x6.png" not in message
    assert len(load_tagpedes(root / "anno_dir", root / "images", "train", check_files=False)) == 8


@pytest.mark.parametrize("captions", [[], [""], ["ok", "   "], None])
def test_empty_captions_raise_or_skip(tmp_path, caplog, captions):
    bad = tag_entry(5, "bad", 0)
    bad["captions"] = captions
    root = make_tagpedes(tmp_path, [tag_entry(4, "good", 1), bad], [])
    with pytest.raises(ValueError, match="train_reid.json: entry 1 \\(id=5.*has empty or invalid captions"):
        load_tagpedes(root / "anno_dir", root / "images", "train")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ds = load_tagpedes(root / "anno_dir", root / "images", "train", skip_bad=True)
    assert ds["person_id"] == [4]
    assert any("skipped 1 bad entries" in r.getMessage() for r in caplog.records)


def test_tagpedes_unknown_split(tagpedes):
    with pytest.raises(ValueError, match=r"unknown split 'val'.*\['test', 'train'\]"):
        load_tagpedes(tagpedes / "anno_dir", tagpedes / "images", "val")


# ----------------------------------------------------------------------------- raw formats


def test_cuhk_pedes(cuhk):
    ds = load_cuhk_pedes(cuhk, "train")
    assert ds.features == IMAGE_FEATURES
    assert ds["person_id"] == [1, 2, 3]
    assert ds["view"] == [1, 1, 1]  # no cam_id -> ground
    assert ds[0]["image_path"] == os.path.abspath(cuhk / "imgs" / "sub" / "1.png")
    all_splits = load_cuhk_pedes(cuhk)
    assert isinstance(all_splits, DatasetDict)
    assert {k: len(v) for k, v in all_splits.items()} == {"train": 3, "val": 1, "test": 2}
    assert all_splits["test"]["split"] == ["test", "test"]
    with pytest.raises(ValueError, match=r"unknown split 'dev'.*\['test', 'train', 'val'\]"):
        load_cuhk_pedes(cuhk, "dev")


def test_icfg_pedes(icfg):
    ds = load_icfg_pedes(icfg, "test")
    assert ds["person_id"] == [3, 4]
    assert set(load_icfg_pedes(icfg)) == {"train", "test"}
    with pytest.raises(ValueError, match="available splits"):
        load_icfg_pedes(icfg, "val")


def test_rstpreid(rstp):
    ds = load_rstpreid(rstp, "val")
    assert ds["person_id"] == [3]
    assert ds[0]["image_path"] == os.path.abspath(rstp / "imgs" / "sub" / "3.png")
    assert ds.features == IMAGE_FEATURES


def test_dispatcher(tmp_path, tagpedes, cuhk, icfg, rstp):
    assert len(load_dataset_split("CUHK_PEDES", "test", data_root=tmp_path)) == 2
    assert len(load_dataset_split("rstpreid", "train", data_root=tmp_path)) == 2
    assert len(load_dataset_split(icfg, "train")) == 2
    assert load_dataset_split("tag-pedes", "test", data_root=tmp_path)["person_id"] == [11, 11, 12]
    assert len(load_dataset_split(tagpedes, "train")) == 4
    anno = tagpedes / "anno_dir"
    assert len(load_dataset_split(anno, "train", image_dir=tagpedes / "images")) == 4
    assert len(load_dataset_split(anno / "test_reid.json", "test")) == 3
    assert len(load_dataset_split(anno, "train")) == 4  # images/ found beside anno_dir/


def test_dispatcher_flat_layout_finds_images_beside_the_json(tmp_path):
    """A folder holding the *_reid.json files and images/ itself (no anno_dir/)."""
    root = make_tagpedes(tmp_path / "flat", [tag_entry(1, "a", 0), tag_entry(2, "b", 1)], [])
    for f in list((root / "anno_dir").iterdir()):
        f.rename(root / f.name)
    (root / "anno_dir").rmdir()
    ds = load_dataset_split(root, "train")
    assert ds[0]["image_path"].startswith(os.path.abspath(root / "images"))


def test_dispatcher_unknown(tmp_path):
    with pytest.raises(ValueError, match="cannot detect a dataset"):
        load_dataset_split(tmp_path / "nothing", "train")


# ----------------------------------------------------------------------------- views and splits


def test_pairs_view(tagpedes):
    ds = load_tagpedes(tagpedes / "anno_dir", tagpedes / "images", "test")
    pairs = pairs_view(ds)
    assert pairs.features == PAIR_FEATURES
    assert len(pairs) == 7
    assert pairs["image_index"] == [0, 0, 1, 1, 2, 2, 2]
    assert pairs["caption"][4:] == ["person 12 0", "person 12 1", "person 12 2"]
    assert pairs["person_id"] == [11, 11, 11, 11, 12, 12, 12]
    assert pairs["view"] == [0, 0, 1, 1, 1, 1, 1]
    assert pairs[2]["image_path"] == ds[1]["image_path"]


def test_remap_ids_order_of_first_appearance(tagpedes):
    ds = load_tagpedes(tagpedes / "anno_dir", tagpedes / "images", "train")  # ids 7, 7, 3, 9
    remapped, mapping = remap_ids(ds)
    assert mapping == {7: 0, 3: 1, 9: 2}
    assert remapped["label"] == [0, 0, 1, 2]
    assert remapped["person_id"] == [7, 7, 3, 9]
    again, _ = remap_ids(remapped)  # idempotent, replaces the existing label column
    assert again["label"] == [0, 0, 1, 2]


def test_split_validation_disjoint_and_deterministic(tmp_path):
    train = [tag_entry(pid, f"{pid}_{k}", k % 2) for pid in range(20) for k in range(3)]
    root = make_tagpedes(tmp_path, train, [])
    ds = load_tagpedes(root / "anno_dir", root / "images", "train")
    parts = split_validation(ds, fraction=0.2, seed=0)
    train_ids, val_ids = set(parts["train"]["person_id"]), set(parts["validation"]["person_id"])
    assert not train_ids & val_ids
    assert train_ids | val_ids == set(range(20))
    assert len(val_ids) == 4
    assert len(parts["train"]) + len(parts["validation"]) == 60
    assert set(parts["validation"]["split"]) == {"validation"}
    assert set(parts["train"]["split"]) == {"train"}
    again = split_validation(ds, fraction=0.2, seed=0)
    assert again["validation"]["image_path"] == parts["validation"]["image_path"]
    other_seeds = {
        frozenset(split_validation(ds, 0.2, seed=s)["validation"]["person_id"]) for s in range(1, 6)
    }
    assert len(other_seeds | {frozenset(val_ids)}) > 1
    with pytest.raises(ValueError, match="fraction"):
        split_validation(ds, fraction=1.0)


def test_cam_id_view_names_accepted_like_the_processor(tmp_path):
    entries = [
        tag_entry(1, "a", "aerial"),
        tag_entry(1, "b", "GROUND"),
        tag_entry(2, "c", " Aerial "),
        tag_entry(2, "d", 0),
    ]
    root = make_tagpedes(tmp_path, entries, [tag_entry(3, "x")])
    assert load_tagpedes(root / "anno_dir", root / "images", "train")["view"] == [0, 1, 0, 0]


@pytest.mark.parametrize("bad_id", [3.7, 3.0, "3.7", None, True, [3]])
def test_non_integer_id_is_rejected_not_truncated(tmp_path, bad_id):
    entry = {**tag_entry(1, "a"), "id": bad_id}
    root = make_tagpedes(tmp_path, [entry], [])
    with pytest.raises(
        ValueError, match=rf"train_reid.json: entry 0 .*has no integer 'id' \(got {re.escape(repr(bad_id))}\)"
    ):
        load_tagpedes(root / "anno_dir", root / "images", "train")


def test_string_digit_ids_are_integers(tmp_path):
    root = make_tagpedes(tmp_path, [{**tag_entry(1, "a"), "id": "0012"}], [])
    assert load_tagpedes(root / "anno_dir", root / "images", "train")["person_id"] == [12]


def test_malformed_json_names_file_and_line(tmp_path):
    anno = tmp_path / "anno_dir"
    anno.mkdir()
    (anno / "train_reid.json").write_text('[\n  {"id": 1,\n   "file_path": "a.png",,\n}]')
    with pytest.raises(ValueError, match=r"train_reid.json: invalid JSON at line 3, column 25"):
        load_tagpedes(anno, tmp_path, "train")
    (anno / "train_reid.json").write_bytes(b'[{"id": 1, "captions": ["\xff"]}]')
    with pytest.raises(ValueError, match=r"train_reid.json: not UTF-8"):
        load_tagpedes(anno, tmp_path, "train")


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "a/../../outside.png"])
def test_paths_outside_the_image_folder_are_refused(tmp_path, path):
    entry = {**tag_entry(1, "a"), "file_path": path}
    root = make_tagpedes(tmp_path / "data", [tag_entry(2, "b")], [])
    write_annotations(root / "anno_dir" / "train_reid.json", [entry])
    with pytest.raises(ValueError, match="points outside the image folder"):
        load_tagpedes(root / "anno_dir", root / "images", "train", check_files=False)
    rows = load_tagpedes(
        root / "anno_dir", root / "images", "train", check_files=False, allow_outside_root=True
    )
    assert rows["image_path"] == [os.path.normpath(os.path.join(root / "images", path))]


def test_raw_format_paths_stay_inside_imgs(tmp_path):
    write_annotations(
        tmp_path / "data_captions.json",
        [{"id": 1, "img_path": "../x.png", "captions": ["a man"], "split": "train"}],
    )
    with pytest.raises(ValueError, match="data_captions.json: entry 0 .*outside the image folder"):
        load_rstpreid(tmp_path, "train", check_files=False)
