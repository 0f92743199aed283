"""Tests for the procedural synthetic aerial-ground person dataset and its numpy rasteriser."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modeling_tagclip.data import raster
from modeling_tagclip.data import synthetic as syn

SIZE = (48, 24)  # (H, W): tiny images keep the tests fast
N_IDS = 20
VIEW_WORDS = re.compile(r"aerial|drone|ground|camera|above|overhead|cctv|uav|view|top-down", re.IGNORECASE)
JSON_FILES = ("train_reid.json", "test_reid.json", "dataset_info.json", "identities.json")


def _generate(out: Path, seed: int = 0) -> dict:
    return syn.generate_dataset(out, num_identities=N_IDS, seed=seed, image_size=SIZE, progress=False)


def _records(root: Path, split: str) -> list[dict]:
    return json.loads((root / f"{split}_reid.json").read_text())


def _pixels(root: Path) -> dict[str, np.ndarray]:
    recs = _records(root, "train") + _records(root, "test")
    return {r["file_path"]: np.asarray(Image.open(root / "images" / r["file_path"])) for r in recs}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("syn_a")
    return root, _generate(root)


def test_same_seed_is_byte_identical(dataset: tuple[Path, dict], tmp_path: Path) -> None:
    root, summary = dataset
    assert _generate(tmp_path) == summary
    for name in JSON_FILES:
        assert (root / name).read_bytes() == (tmp_path / name).read_bytes(), name
    a, b = _pixels(root), _pixels(tmp_path)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_different_seed_differs(dataset: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = dataset
    _generate(tmp_path, seed=1)
    assert (root / "train_reid.json").read_bytes() != (tmp_path / "train_reid.json").read_bytes()
    a, b = _pixels(root), _pixels(tmp_path)
    common = a.keys() & b.keys()
    assert common and any(not np.array_equal(a[k], b[k]) for k in common)


def test_json_schema_and_images(dataset: tuple[Path, dict]) -> None:
    root, _ = dataset
    for split in ("train", "test"):
        recs = _records(root, split)
        assert recs
        for r in recs:
            assert set(r) == {"id", "file_path", "captions", "cam_id"}
            assert isinstance(r["id"], int) and isinstance(r["file_path"], str)
            assert r["cam_id"] in (syn.AERIAL, syn.GROUND)
            assert len(r["captions"]) == 2
            assert all(isinstance(c, str) and len(c.split()) >= 4 for c in r["captions"])
            with Image.open(root / "images" / r["file_path"]) as im:
                assert im.mode == "RGB" and im.size == (SIZE[1], SIZE[0])
        assert len({r["file_path"] for r in recs}) == len(recs)


def test_train_test_identities_disjoint(dataset: tuple[Path, dict]) -> None:
    root, summary = dataset
    train = {r["id"] for r in _records(root, "train")}
    test = {r["id"] for r in _records(root, "test")}
    assert train and test and not train & test
    assert len(train) + len(test) == N_IDS
    assert summary["train"]["identities"] == len(train) and summary["test"]["identities"] == len(test)


def test_view_mix_present_per_split(dataset: tuple[Path, dict]) -> None:
    root, summary = dataset
    for split in ("train", "test"):
        views: dict[int, set[int]] = {}
        for r in _records(root, split):
            views.setdefault(r["id"], set()).add(r["cam_id"])
        kinds = [frozenset(v) for v in views.values()]
        ground_only, aerial_only = kinds.count({syn.GROUND}), kinds.count({syn.AERIAL})
        both = kinds.count({syn.AERIAL, syn.GROUND})
        assert ground_only >= 1 and aerial_only >= 1 and both >= 1
        assert both > max(ground_only, aerial_only)  # most identities have both views
        s = summary[split]
        assert (s["ground_only_ids"], s["aerial_only_ids"], s["both_view_ids"]) == (
            ground_only,
            aerial_only,
            both,
        )
        assert s["images"] == 2 * (ground_only + aerial_only) + 4 * both  # images_per_view=2


def test_dataset_info(dataset: tuple[Path, dict]) -> None:
    root, summary = dataset
    info = json.loads((root / "dataset_info.json").read_text())
    assert info["counts"] == summary
    assert info["parameters"]["num_identities"] == N_IDS
    assert info["parameters"]["image_size"] == list(SIZE)
    ids = json.loads((root / "identities.json").read_text())
    keys = {syn.attribute_key(p["attributes"]) for p in ids}
    assert len(keys) == N_IDS


def test_captions_never_mention_view() -> None:
    rng = np.random.default_rng(0)
    for attrs in syn.sample_identities(300, rng):
        for k in range(3):
            for caption in syn.make_captions(attrs, np.random.default_rng([7, k])):
                assert not VIEW_WORDS.search(caption), caption


def test_captions_only_use_the_identitys_colours() -> None:
    all_colours = set(syn.COLORS) | set(syn.HAIR_COLORS)
    rng = np.random.default_rng(1)
    mentions_top = 0
    ids = syn.sample_identities(200, rng)
    for attrs in ids:
        own = {
            attrs[k]
            for k in ("hair_color", "top_color", "bottom_color", "shoes_color", "bag_color", "hat_color")
        }
        caps = syn.make_captions(attrs, rng)
        assert len(caps) == 2 and caps[0] != caps[1]
        words = set(re.findall(r"[a-z]+", " ".join(caps).lower().replace("gray", "grey")))
        assert (words & all_colours) <= own, (caps, attrs)
        mentions_top += attrs["top_color"] in " ".join(caps).replace("gray", "grey")
    assert mentions_top >= 0.95 * len(ids)


def test_caption_strategies_are_varied() -> None:
    attrs = syn.sample_identity(np.random.default_rng(3))
    caps = {c for k in range(30) for c in syn.make_captions(attrs, np.random.default_rng(k))}
    assert len(caps) > 30


def test_identities_unique_and_consistent() -> None:
    ids = syn.sample_identities(600, np.random.default_rng(5))
    assert len({syn.attribute_key(a) for a in ids}) == len(ids)
    for a in ids:
        assert set(a) == set(syn.ATTRIBUTE_KEYS)
        assert (a["hair_style"] == "bald") == (a["hair_color"] == "none")
        assert (a["bag"] == "none") == (a["bag_color"] == "none")
        assert (a["hat"] == "none") == (a["hat_color"] == "none")
        if a["top_type"] in ("jacket", "hoodie", "coat"):
            assert a["sleeves"] == "long"
    # attributes overlap across identities: every top colour is shared by several people
    tops = [a["top_color"] for a in ids]
    assert min(tops.count(c) for c in set(tops)) > 5


def test_render_person_size_and_determinism() -> None:
    attrs = syn.sample_identity(np.random.default_rng(0))
    for view in (syn.AERIAL, syn.GROUND):
        a = syn.render_person(attrs, view, np.random.default_rng(11), (40, 20))
        b = syn.render_person(attrs, view, np.random.default_rng(11), (40, 20))
        assert a.mode == "RGB" and a.size == (20, 40)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        syn.render_person(attrs, 2, np.random.default_rng(0), (40, 20))


def test_aerial_and_ground_differ_measurably() -> None:
    ids = syn.sample_identities(24, np.random.default_rng(2))
    stats: dict[int, list[tuple[float, float]]] = {syn.AERIAL: [], syn.GROUND: []}
    for i, attrs in enumerate(ids):
        for view in stats:
            img, mask = syn.render_person_with_mask(attrs, view, np.random.default_rng([i, view]), (64, 32))
            grey = np.asarray(img.convert("L"), dtype=np.float32)
            stats[view].append((float(mask.mean()), float(np.abs(np.diff(grey, axis=1)).mean())))
    aerial, ground = np.array(stats[syn.AERIAL]), np.array(stats[syn.GROUND])
    assert aerial[:, 0].mean() < 0.75 * ground[:, 0].mean()  # person is smaller from the air
    assert aerial[:, 1].mean() < 0.8 * ground[:, 1].mean()  # and blurrier
    assert (aerial[:, 0] > 0.02).all() and (ground[:, 0] > 0.1).all()  # but always visible


def test_cli_writes_layout(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--num-identities", "4", "--seed", "2", "--height", "32", "--width", "16"]
    summary = syn.main([*argv, "--images-per-view", "1", "--no-progress"])
    assert (tmp_path / "train_reid.json").exists() and (tmp_path / "test_reid.json").exists()
    assert summary["train"]["identities"] == 3 and summary["test"]["identities"] == 1
    rec = _records(tmp_path, "train")[0]
    assert Image.open(tmp_path / "images" / rec["file_path"]).size == (16, 32)
    # --test-images-per-view renders more images of the test identity only
    more_argv = [
        argv[0],
        str(tmp_path / "more"),
        *argv[2:],
        "--images-per-view",
        "1",
        "--test-images-per-view",
        "3",
    ]
    more = syn.main([*more_argv, "--no-progress"])
    assert more["train"] == summary["train"] and more["test"]["images"] == 3 * summary["test"]["images"]


# Pixel checksums (sha256 of the uint8 RGB bytes) pinned with the numpy rasteriser (GENERATOR_VERSION 2). The
# same values were measured with Pillow 12.3 and 13.0 (Pillow only encodes/decodes the lossless PNG). If a
# deliberate change to the drawing alters them, bump GENERATOR_VERSION and update the pins.
RENDER_SHA256 = {
    syn.AERIAL: "9c2eb687447afd94048acf80c6599b04100d8550830b696647dc7f121cc4c1a9",
    syn.GROUND: "1d10a10cbb304953c40a6b74b27894b3838c444af55ef7665ec980b044d1e784",
}
DATASET_SHA256 = "5caebec4c7cd6202929a08bcacded24c8618d9f528aeb6476ef0fa8f8faa8296"


def test_rendered_pixels_match_pinned_checksum() -> None:
    attrs = syn.sample_identity(np.random.default_rng(0))
    for view, expected in RENDER_SHA256.items():
        img = syn.render_person(attrs, view, np.random.default_rng([3, view]))
        assert hashlib.sha256(np.asarray(img).tobytes()).hexdigest() == expected, syn.VIEW_NAMES[view]


def test_generated_dataset_pixels_match_pinned_checksum(tmp_path: Path) -> None:
    syn.generate_dataset(tmp_path, num_identities=6, seed=0, image_size=(48, 24), progress=False)
    digest = hashlib.sha256()
    for split in ("train", "test"):
        for r in _records(tmp_path, split):
            digest.update(np.asarray(Image.open(tmp_path / "images" / r["file_path"])).tobytes())
    assert digest.hexdigest() == DATASET_SHA256
    assert json.loads((tmp_path / "dataset_info.json").read_text())["version"] == syn.GENERATOR_VERSION == 2


def test_rendering_does_not_use_pillow_drawing() -> None:
    source = Path(syn.__file__).read_text()
    for name in ("ImageDraw", "ImageFilter", ".resize(", ".rotate(", ".filter("):
        assert name not in source, name


def test_canvas_shapes_cover_their_area() -> None:
    canvas = raster.Canvas(40, 40, ss=4)
    canvas.ellipse(20, 20, 10, 5, 0.7, (255, 0, 0))
    _, alpha = canvas.resolve()
    assert alpha.sum() == pytest.approx(np.pi * 10 * 5, rel=0.01)
    canvas = raster.Canvas(40, 40, ss=4)
    canvas.polygon([(5, 5), (35, 5), (5, 35)], (0, 255, 0, 255))  # right triangle, area 450
    canvas.capsule((10, 37), (30, 37), 2.0, (0, 0, 255, 128))  # half-transparent, area 80 + 4 pi
    rgb, alpha = canvas.resolve()
    assert rgb[..., 1].sum() / 255 == pytest.approx(450, rel=0.01)
    assert rgb[..., 2].sum() / 128 == pytest.approx(80 + 4 * np.pi, rel=0.02)
    assert 0.0 <= alpha.min() and alpha.max() <= 1.0


def test_blur_and_resize_keep_constants_and_mass() -> None:
    flat = np.full((9, 7, 3), 100.0)
    assert np.allclose(raster.gaussian_blur(flat, 1.3), 100.0)
    assert np.allclose(raster.resize_bilinear(flat, 20, 3), 100.0)
    spike = np.zeros((21, 21))
    spike[10, 10] = 1.0
    blurred = raster.gaussian_blur(spike, 1.5)
    assert blurred.sum() == pytest.approx(1.0) and blurred[10, 10] < 0.1
    assert np.allclose(blurred, blurred.T) and np.allclose(blurred, blurred[::-1])
    ramp = np.arange(8, dtype=float)[None, :].repeat(2, 0)
    assert np.allclose(raster.resize_bilinear(ramp, 2, 4)[0], [0.5, 2.5, 4.5, 6.5])


def test_reid_set_pixels_match_pinned_checksum(tmp_path: Path) -> None:
    from modeling_tagclip.data.synthetic_reid import GENERATOR_VERSION, generate_reid_dataset

    generate_reid_dataset(tmp_path, num_identities=4, image_size=(48, 24), progress=False)
    digest = hashlib.sha256()
    for path in sorted(tmp_path.rglob("*.jpg")):
        digest.update(np.asarray(Image.open(path)).tobytes())
    assert digest.hexdigest() == "3f3f6bed79fd731ae04f9ae5053f20bcaadf4e57d0e5c5ae1a59f8591008a40d"
    assert GENERATOR_VERSION == 2


def test_stale_render_flags_sets_from_another_generator_version(
    dataset: tuple[Path, dict], tmp_path: Path
) -> None:
    root, _ = dataset
    assert syn.stale_render(root) is None and syn.stale_render(tmp_path) is None
    info = json.loads((root / "dataset_info.json").read_text())
    (tmp_path / "dataset_info.json").write_text(json.dumps({**info, "version": 1}))
    assert "version 1" in syn.stale_render(tmp_path) and "different pixels" in syn.stale_render(tmp_path)
    (tmp_path / "dataset_info.json").write_text(json.dumps({**info, "generator": "other", "version": 1}))
    assert syn.stale_render(tmp_path) is None
    (tmp_path / "dataset_info.json").write_text('{"generator": ')
    assert "not readable JSON" in syn.stale_render(tmp_path)


def test_stale_render_compares_the_requested_parameters(dataset: tuple[Path, dict]) -> None:
    root, _ = dataset
    same = {"num_identities": N_IDS, "seed": 0, "image_size": SIZE}  # defaults fill the rest, tuple == list
    assert syn.stale_render(root, same) is None
    assert syn.stale_render(root, {**same, "workers": 2}) is None  # the worker count changes no byte
    why = syn.stale_render(root, {**same, "num_identities": 800, "test_fraction": 0.2})
    assert why == f"{root} was rendered with num_identities 20, test_fraction 0.25, not the requested " + (
        "num_identities 800, test_fraction 0.2"
    )
    assert syn.stale_render(root, {"num_identities": N_IDS}).endswith(
        "image_size [48, 24], not the requested image_size [128, 64]"
    )
    assert syn.stale_render(root, {**same, "seed": 1}).endswith("seed 1")


def test_re_rendering_replaces_the_set_and_keeps_everything_else(tmp_path: Path) -> None:
    syn.generate_dataset(tmp_path, num_identities=6, seed=0, image_size=SIZE, progress=False)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "images" / "test" / "00005" / "mine.png").write_bytes(
        b"x"
    )  # a user's file in a render folder
    syn.generate_dataset(tmp_path, num_identities=4, seed=1, image_size=SIZE, progress=False)
    listed = {r["file_path"] for split in ("train", "test") for r in _records(tmp_path, split)}
    on_disk = {str(p.relative_to(tmp_path / "images")) for p in (tmp_path / "images").rglob("*.png")}
    assert on_disk == listed | {
        "test/00005/mine.png"
    }  # the old render's other images are gone, not the user's
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (
        not (tmp_path / "images" / "train" / "00003").exists()
        and not (tmp_path / "images/test/00004").exists()
    )
    fresh = tmp_path / "fresh"  # the same bytes as a render into an empty folder
    syn.generate_dataset(fresh, num_identities=4, seed=1, image_size=SIZE, progress=False)
    fresh_pixels, pixels = _pixels(fresh), _pixels(tmp_path)
    assert fresh_pixels.keys() == pixels.keys() and all(
        np.array_equal(fresh_pixels[k], pixels[k]) for k in pixels
    )
    for name in JSON_FILES:
        assert (fresh / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_worker_count_and_bad_worker_counts(tmp_path: Path) -> None:
    assert syn.worker_count(None, syn.MIN_IMAGES_PER_WORKER - 1) == 1  # a small set: no process pool
    assert 1 <= syn.worker_count(None, 10**6) <= (os.cpu_count() or 1) and syn.worker_count(3, 5) == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"workers must be a whole number >= 1 .*got {bad!r}"):
            syn.generate_dataset(
                tmp_path / "out", num_identities=2, image_size=SIZE, progress=False, workers=bad
            )
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_one_and_two_workers_write_byte_identical_files(tmp_path: Path, monkeypatch) -> None:
    pools = []

    class CountedPool(syn.ProcessPoolExecutor):
        def __init__(self, max_workers: int) -> None:
            pools.append(max_workers)
            super().__init__(max_workers=max_workers)

    monkeypatch.setattr(syn, "ProcessPoolExecutor", CountedPool)
    for workers in (1, 2):
        syn.generate_dataset(
            tmp_path / f"w{workers}", 8, seed=2, image_size=SIZE, progress=False, workers=workers
        )
    assert pools == [2]  # one worker renders in this process

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    one, two = files(tmp_path / "w1"), files(tmp_path / "w2")
    assert len([name for name in one if name.endswith(".png")]) >= 16 and one == two


# ----------------------------------------------------------------------------- camera / time sidecars


def test_metadata_sidecars_give_every_crop_a_camera_of_its_view_and_a_time(dataset) -> None:
    import csv
    from datetime import datetime, timedelta

    from modeling_tagclip.data.synthetic_metadata import CAMERAS, DAY_S, DAY_START, VISIT_S

    root, _ = dataset
    for split in ("train", "test"):
        rows = list(csv.DictReader((root / "metadata" / f"{split}.csv").open()))
        records = {r["file_path"].removeprefix(f"{split}/"): r for r in _records(root, split)}
        images = {
            p.relative_to(root / "images" / split).as_posix()
            for p in (root / "images" / split).rglob("*.png")
        }
        assert [r["path"] for r in rows] and {r["path"] for r in rows} == set(records) == images
        visits: dict[str, list[datetime]] = {}
        for row in rows:
            view = records[row["path"]]["cam_id"]
            assert row["view"] == syn.VIEW_NAMES[view] and row["camera"] in CAMERAS[view], row
            moment = datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00"))
            assert DAY_START <= moment < DAY_START + timedelta(seconds=DAY_S + VISIT_S), row
            visits.setdefault(row["path"].split("/")[0], []).append(moment)
        assert all(max(t) - min(t) <= timedelta(seconds=VISIT_S) for t in visits.values())  # one pass each
        assert len({r["camera"] for r in rows}) > 3 and len({r["timestamp"][11:13] for r in rows}) > 3


def test_metadata_does_not_change_pixels_or_annotations(tmp_path: Path, dataset) -> None:
    root, _ = dataset
    _generate(tmp_path)
    assert (tmp_path / "metadata" / "test.csv").read_bytes() == (root / "metadata" / "test.csv").read_bytes()
    for name in JSON_FILES:
        assert (tmp_path / name).read_bytes() == (root / name).read_bytes(), name


def test_default_set_answers_the_documented_filtered_search() -> None:
    """The default set's test split (260 identities, seed 0) has aerial crops of camera 7 between 10:00 and
    11:00, the filter the search docs show (computed from the plan: nothing is rendered)."""
    from modeling_tagclip.data.synthetic_metadata import crop_metadata

    plan = syn.plan_identities(260, 0, 0.25, 0.2, 0.2)
    rows = [
        crop_metadata(0, p["id"], v, k)
        for p in plan
        if p["split"] == "test"
        for v in syn._views_of(p["views"])
        for k in range(2)
    ]
    hits = [r for r in rows if r["view"] == "aerial" and r["camera"] == "7" and "T10:" in r["timestamp"]]
    assert len(hits) >= 3, hits


def test_filtered_search_on_the_synthetic_gallery_returns_only_matching_crops(tmp_path: Path, capsys) -> None:
    import csv

    from fixtures import save_eval_model

    from modeling_tagclip.retrieval import cli

    root = tmp_path / "data"
    syn.generate_dataset(root, num_identities=24, seed=0, image_size=(64, 32), progress=False)
    rows = list(csv.DictReader((root / "metadata" / "test.csv").open()))
    target = next(r for r in rows if r["view"] == "aerial")
    hour = target["timestamp"][:13]
    expected = {
        r["path"]
        for r in rows
        if r["view"] == "aerial" and r["camera"] == target["camera"] and r["timestamp"][:13] == hour
    }
    index = tmp_path / "gallery.idx"
    model = save_eval_model(tmp_path / "model")
    assert (
        cli.main(
            [
                "index",
                "--model",
                str(model),
                "--images",
                str(root / "images" / "test"),
                "--metadata",
                str(root / "metadata" / "test.csv"),
                "--out",
                str(index),
                "--workers",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    after, before = f"{hour}:00", f"{hour}:59:59"
    assert (
        cli.main(
            [
                "search",
                "--index",
                str(index),
                "--view",
                "aerial",
                "--camera",
                target["camera"],
                "--after",
                after,
                "--before",
                before,
                "-k",
                "50",
                "--json",
                "a man in red",
            ]
        )
        == 0
    )
    hits = json.loads(capsys.readouterr().out)[0]["hits"]
    assert {Path(h["path"]).relative_to(root / "images" / "test").as_posix() for h in hits} == expected
    assert all(h["camera"] == target["camera"] for h in hits)


@pytest.mark.slow
def test_bench_render_records_cpu_time_per_worker_count(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/
    from benchmarks import bench_render

    out = tmp_path / "render.json"
    bench_render.main(
        ["--identities", "4", "--size", "32", "16", "--workers", "1", "2", "--output", str(out)]
    )
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["digest"] == rows[1]["digest"]
    assert rows[0]["images"] == rows[1]["images"] >= 8 and rows[0]["cpu_workers_s"] == 0 < rows[0]["cpu_s"]
    assert rows[1]["cpu_workers_s"] > 0 and "machine" in saved


def test_test_images_per_view_adds_test_images_and_leaves_training_untouched(dataset, tmp_path: Path) -> None:
    root, summary = dataset
    more = syn.generate_dataset(
        tmp_path, num_identities=N_IDS, image_size=SIZE, progress=False, test_images_per_view=3
    )
    assert more["train"] == summary["train"] and _records(tmp_path, "train") == _records(root, "train")
    s = more["test"]
    assert s["identities"] == summary["test"]["identities"]
    assert s["images"] == 3 * (s["ground_only_ids"] + s["aerial_only_ids"]) + 6 * s["both_view_ids"]
    old, new = _pixels(root), _pixels(tmp_path)
    assert all(
        np.array_equal(old[path], new[path]) for path in old
    )  # the first two of each view are the same
    assert len(new) - len(old) == s["images"] - summary["test"]["images"]
    info = json.loads((tmp_path / "dataset_info.json").read_text())
    assert info["parameters"]["test_images_per_view"] == 3
    assert syn.stale_render(tmp_path, {"num_identities": N_IDS, "image_size": SIZE}) is not None
    assert syn.stale_render(root, {"num_identities": N_IDS, "image_size": SIZE}) is None
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="test_images_per_view"):
            syn.generate_dataset(
                tmp_path / "bad", num_identities=N_IDS, image_size=SIZE, test_images_per_view=bad
            )
    assert not (tmp_path / "bad").exists()
