"""Re-ID loaders on fixture folders in the real naming schemes, the P x K sampler, transforms, synthetic set."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modeling_tagclip.data.reid import (
    IdentityBatchSampler,
    ReIDTransform,
    load_reid_dataset,
    parse_agreidv2_name,
    parse_cargo_name,
    parse_lagper_path,
    parse_market_name,
    relabel,
)
from modeling_tagclip.data.synthetic_reid import generate_reid_dataset


def touch(root: Path, relative: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 8), (10, 20, 30)).save(path)


def rows(table) -> dict[str, dict]:
    return {Path(r["image_path"]).name: r for r in table}


# --- CARGO -------------------------------------------------------------------------------------------------


def test_cargo_names_and_protocols(tmp_path):
    root = tmp_path / "datasets"
    for rel in (
        "train/Cam1/Cam1_day_0001_0001.jpg",
        "train/Cam13/Cam13_night_0001_0002.jpg",
        "query/Cam5/Cam5_day_0003_0001.jpg",
        "query/Cam6/Cam6_night_0003_0002.jpg",
        "gallery/Cam2/Cam2_day_0003_0003.jpg",
        "gallery/Cam9/Cam9_day_0003_0004.jpg",
    ):
        touch(root / "CARGO", rel)
    data = load_reid_dataset("cargo", root)
    train = rows(data.train)
    assert train["Cam1_day_0001_0001.jpg"] == {**train["Cam1_day_0001_0001.jpg"], "person_id": 1, "camera": 1}
    assert train["Cam1_day_0001_0001.jpg"]["camera_id"] == 0 and train["Cam1_day_0001_0001.jpg"]["view"] == 0
    assert (
        train["Cam13_night_0001_0002.jpg"]["camera_id"] == 12
        and train["Cam13_night_0001_0002.jpg"]["view"] == 1
    )
    assert rows(data.query)["Cam5_day_0003_0001.jpg"]["view"] == 0  # Cam1-5 aerial
    assert rows(data.query)["Cam6_night_0003_0002.jpg"]["view"] == 1  # Cam6-13 ground
    assert list(data.protocols) == ["ALL", "A<->G", "G<->G", "A<->A", "A<->G (VDT)", "G->A"]
    q_views, g_views = np.asarray(data.query["view"]), np.asarray(data.gallery["view"])
    assert (q_views[data.protocols["A<->G"].query] == 0).all() and (
        g_views[data.protocols["A<->G"].gallery] == 1
    ).all()
    assert parse_cargo_name("Cam12_night_0042_0007.jpg") == (42, 12, 1)
    with pytest.raises(ValueError, match="not a CARGO file name"):
        parse_cargo_name("0042_c1.jpg")


# --- AG-ReID.v2 ----------------------------------------------------------------------------------------------


def test_agreidv2_names_camids_and_setting_files(tmp_path):
    root = tmp_path / "AG-ReID.v2"
    images = root / "AG-ReID.v2"
    touch(images, "train_all/P0001T0100A1/P0001T0100A1C2F0001.jpg")
    touch(images, "train_all/P0001T0100A1/P0001T0100A1C0F0002.jpg")
    query = ["query/P0006T0214A0/P0006T0214A0C0F1831.jpg", "query/P0007T0001A2/P0007T0001A2C3F0005.jpg"]
    gallery = ["gallery/P0006T0214A0/P0006T0214A0C3F1900.jpg", "gallery/P0007T0001A2/P0007T0001A2C0F0010.jpg"]
    for rel in query + gallery:
        touch(images, rel)
    (root / "exp1_aerial_to_cctv.txt").write_text(f"{query[0]}\n{gallery[0]}")  # no final newline: accepted
    (root / "exp4_cctv_to_aerial.txt").write_text(f"{query[1]}\n{gallery[1]}\n")
    data = load_reid_dataset("AG-ReID.v2", tmp_path)
    assert set(data.protocols) == {"A->C", "C->A"}  # A->W / W->A files absent: skipped with a warning
    train = rows(data.train)
    assert train["P0001T0100A1C2F0001.jpg"]["person_id"] == int("000101001")
    assert (
        train["P0001T0100A1C2F0001.jpg"]["camera_id"] == 1 and train["P0001T0100A1C2F0001.jpg"]["view"] == 1
    )
    assert (
        train["P0001T0100A1C0F0002.jpg"]["camera_id"] == 0 and train["P0001T0100A1C0F0002.jpg"]["view"] == 0
    )
    q, g = rows(data.query), rows(data.gallery)
    assert q["P0006T0214A0C0F1831.jpg"]["person_id"] == 602140 and q["P0006T0214A0C0F1831.jpg"]["view"] == 0
    assert q["P0007T0001A2C3F0005.jpg"]["camera_id"] == 2  # query: C - 1
    assert g["P0006T0214A0C3F1900.jpg"]["camera_id"] == 1  # gallery: any ground camera -> 1
    assert g["P0007T0001A2C0F0010.jpg"]["camera_id"] == 0
    a2c = data.protocols["A->C"]
    assert data.query[int(a2c.query[0])]["image_path"].endswith(query[0])
    assert data.gallery[int(a2c.gallery[0])]["image_path"].endswith(gallery[0])
    assert parse_agreidv2_name("P0006T0214A0C2F1.jpg", gallery=True) == (602140, 2, 1, 1)
    with pytest.raises(FileNotFoundError, match="no AG-ReID.v2 setting file"):
        (root / "exp1_aerial_to_cctv.txt").unlink()
        (root / "exp4_cctv_to_aerial.txt").unlink()
        load_reid_dataset("agreidv2", root)


# --- LAGPeR ----------------------------------------------------------------------------------------------------


def test_lagper_names_cameras_and_protocols(tmp_path):
    root = tmp_path / "LAGPeR"
    touch(root, "bounding_box_train/s1/0001_c3_0001.jpg")
    touch(root, "bounding_box_train/s1/0001_c11_0002.jpg")
    touch(root, "bounding_box_train/s2/0002_c13_0003.jpg")
    touch(root, "bounding_box_train/s2/deeper/0009_c1_0004.jpg")  # two levels down: not matched by */*.jpg
    lines = ["query_A2G/0005_c9_0001.jpg", "gallery_A2G/0005_c12_0002.jpg", "gallery_A2G/0006_c4_0003.jpg"]
    for rel in lines:
        touch(root, rel)
    (root / "exp3_A2G+.txt").write_text("\n".join(lines) + "\n")
    data = load_reid_dataset("lagper", tmp_path)
    train = rows(data.train)
    assert set(train) == {"0001_c3_0001.jpg", "0001_c11_0002.jpg", "0002_c13_0003.jpg"}
    assert (train["0001_c3_0001.jpg"]["view"], train["0001_c3_0001.jpg"]["camera_id"]) == (0, 3)
    assert (train["0001_c11_0002.jpg"]["view"], train["0001_c11_0002.jpg"]["camera_id"]) == (1, 10)
    assert (train["0002_c13_0003.jpg"]["view"], train["0002_c13_0003.jpg"]["camera_id"]) == (0, 12)
    assert list(data.protocols) == ["A->G"]
    assert len(data.query) == 1 and rows(data.query)["0005_c9_0001.jpg"]["view"] == 0
    assert rows(data.gallery)["0005_c12_0002.jpg"]["camera_id"] == 11
    assert parse_lagper_path("gallery/12_c22_x/0003_c1_7.jpg") == (
        12,
        22,
        21,
        0,
    )  # first match on the path wins


# --- Market-1501 --------------------------------------------------------------------------------------------------


def test_market1501_all_ground_and_junk_dropped(tmp_path):
    root = tmp_path / "market1501"
    for rel in (
        "bounding_box_train/0002_c1s1_000451_03.jpg",
        "bounding_box_train/0002_c2s1_000301_01.jpg",
        "query/0003_c3s1_000001_00.jpg",
        "bounding_box_test/0003_c4s1_000002_00.jpg",
        "bounding_box_test/0000_c1s1_000003_00.jpg",
        "bounding_box_test/-1_c1s1_000004_00.jpg",
    ):
        touch(root, rel)
    data = load_reid_dataset("Market-1501", tmp_path)
    assert len(data.gallery) == 2 and set(data.gallery["person_id"]) == {
        0,
        3,
    }  # distractor 0 kept, -1 dropped
    assert set(data.train["view"]) == {1} and data.query[0]["camera_id"] == 2
    assert list(data.protocols) == ["ALL"]
    assert parse_market_name("-1_c1s1_000004_00.jpg") is None


def test_detection_and_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset folder not found"):
        load_reid_dataset("cargo", tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown re-ID dataset"):
        load_reid_dataset("duke", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot tell"):
        load_reid_dataset(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no images found"):
        (tmp_path / "empty" / "train").mkdir()
        load_reid_dataset("cargo", tmp_path / "empty")


# --- synthetic set ----------------------------------------------------------------------------------------------------


def test_synthetic_reid_layout_loads_as_cargo(tmp_path):
    counts = generate_reid_dataset(
        tmp_path / "syn",
        num_identities=4,
        image_size=(32, 16),
        aerial_per_id=2,
        ground_per_id=2,
        progress=False,
    )
    assert counts == {"train": 8, "query": 4, "gallery": 4}
    data = load_reid_dataset(str(tmp_path / "syn"))
    assert len(data.train) == 8 and len(data.query) == 4
    assert Image.open(data.query[0]["image_path"]).size == (16, 32)
    query_ids = Counter(zip(data.query["person_id"], data.query["view"], strict=True))
    assert (
        all(n == 1 for n in query_ids.values()) and len(query_ids) == 4
    )  # one aerial + one ground query per id
    for pid, camera, view in zip(
        data.query["person_id"], data.query["camera_id"], data.query["view"], strict=True
    ):
        matches = [
            (c, v)
            for p, c, v in zip(
                data.gallery["person_id"], data.gallery["camera_id"], data.gallery["view"], strict=True
            )
            if p == pid
        ]
        assert any(v == view and c != camera for c, v in matches) and any(v != view for _, v in matches)


# --- sampler and transforms ---------------------------------------------------------------------------------------------


def test_identity_batch_sampler_pk_structure():
    pids = [0] * 6 + [1] * 5 + [2] * 1 + [3] * 4 + [4] * 4
    sampler = IdentityBatchSampler(pids, batch_size=8, num_instances=4, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 2
    for batch in batches:
        counts = Counter(pids[i] for i in batch)
        assert len(batch) == 8 and len(counts) == 2 and set(counts.values()) == {4}
    again = list(IdentityBatchSampler(pids, batch_size=8, num_instances=4, seed=0))
    assert again == batches
    many = [i for _ in range(20) for batch in sampler for i in batch]
    assert pids.index(2) in many  # the 1-image identity is drawn (with replacement)
    with pytest.raises(ValueError, match="at least P = 3"):
        IdentityBatchSampler([0, 0, 1, 1], batch_size=6, num_instances=2)
    with pytest.raises(ValueError, match="multiple of num_instances"):
        IdentityBatchSampler(pids, batch_size=6, num_instances=4)


def test_relabel_contiguous():
    from datasets import Dataset

    labels, mapping = relabel(Dataset.from_dict({"person_id": [7, 3, 7, 9]}))
    assert labels.tolist() == [0, 1, 0, 2] and mapping == {7: 0, 3: 1, 9: 2}


def test_transforms():
    image = Image.fromarray(np.full((40, 20, 3), 255, dtype=np.uint8))
    test = ReIDTransform((32, 16))(image)
    assert test.shape == (3, 32, 16) and torch.allclose(test, torch.ones_like(test))  # (255 - 127.5) / 127.5
    torch.manual_seed(0)
    train = torch.stack([ReIDTransform((32, 16), train=True)(image) for _ in range(8)])
    assert train.shape == (8, 3, 32, 16) and train.min() < 0.99  # padding / erasing change pixels
    assert train.min() >= -1.0 and train.max() <= 1.0


def _lagper_with_setting(tmp_path, lines: list[str]) -> Path:
    root = tmp_path / "LAGPeR"
    touch(root, "bounding_box_train/s1/0001_c3_0001.jpg")
    for rel in lines:
        if rel and ".." not in rel and not rel.startswith("/"):
            touch(root, rel)
    (root / "exp3_A2G+.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize(
    "bad", ["../../outside_c1_0001.jpg", "/etc/0005_c9_0001.jpg", "gallery/../../x_c1.jpg"]
)
def test_setting_file_paths_stay_inside_the_dataset(tmp_path, bad):
    _lagper_with_setting(tmp_path, ["query_A2G/0005_c9_0001.jpg", "", bad])
    with pytest.raises(ValueError, match=r"exp3_A2G\+.txt, line 3: .* points outside the dataset folder"):
        load_reid_dataset("lagper", tmp_path)


def test_setting_file_parse_error_names_file_and_line(tmp_path):
    _lagper_with_setting(tmp_path, ["query_A2G/0005_c9_0001.jpg", "gallery_A2G/no_camera_here.jpg"])
    with pytest.raises(ValueError, match=r"exp3_A2G\+.txt, line 2: no '<pid>_c<camera>' in LAGPeR path"):
        load_reid_dataset("lagper", tmp_path)


@pytest.mark.parametrize(
    ("mode", "value", "expected"), [("I;16", 40000, 156), ("I", 65535, 255), ("F", 0.5, 128)]
)
def test_reid_transform_high_bit_depth(mode, value, expected):
    pixels = ReIDTransform((4, 2))(Image.new(mode, (2, 4), value))
    torch.testing.assert_close(pixels, torch.full((3, 4, 2), (expected - 127.5) / 127.5))
