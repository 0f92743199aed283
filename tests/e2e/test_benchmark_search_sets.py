"""bench_search.py across generators, seeds and a real-model set: rows per (generator, seed), a summary whose
minimum is the minimum of the rows, generator parameters recorded, and the model set's crops equal to the
synthetic dataset's own test images."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import save_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import bench_search, search_sets
from benchmarks.figures import FIGURES, first_seed_rows
from benchmarks.render import render
from modeling_tagclip.retrieval.embedded import gallery_index as gi


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_summary_takes_the_minimum_and_mean_over_seeds():
    rows = [
        {"generator": "g", "seed": s, "size": 10, "method": "ann_combined", "ann": "ivf", "params": "preset"}
        | {"recall": r, "recall_held_out": h, "ms_per_query_b1": ms}
        for s, r, h, ms in ((0, 0.98, 0.97, 2.0), (1, 0.95, 0.99, 4.0), (2, 0.96, 0.96, 3.0))
    ]
    rows.append(
        {"generator": "h", "seed": 0, "size": 10, "method": "exact", "recall": 1.0, "ms_per_query_b1": 9.0}
    )
    ann, exact = bench_search.summary(rows)
    assert ann["seeds"] == [0, 1, 2] and ann["recall_min"] == 0.95 and ann["recall_held_out_min"] == 0.96
    assert ann["recall_mean"] == pytest.approx(0.9633, abs=1e-4) and ann["ms_per_query_b1"] == 3.0
    assert exact == {
        "generator": "h",
        "size": 10,
        "method": "exact",
        "seeds": [0],
        "recall_min": 1.0,
        "recall_mean": 1.0,
        "recall_held_out_min": None,
        "ms_per_query_b1": 9.0,
    }


def test_generators_seeds_and_a_custom_generator_are_parsed():
    args = bench_search.parse_args(
        ["--sizes", "3000", "--seeds", "0", "1", "--generators", "default", "noisy-text"]
    )
    assert [(s.generator, s.seed, s.text_noise, s.gap) for s in bench_search.sources(args)] == [
        ("default", 0, 1.2, 1.6),
        ("default", 1, 1.2, 1.6),
        ("noisy-text", 0, 2.0, 1.0),
        ("noisy-text", 1, 2.0, 1.0),
    ]
    custom = bench_search.parse_args(["--sizes", "3000", "--text-noise", "3.0"])
    assert [(s.generator, s.text_noise, s.gap) for s in bench_search.sources(custom)] == [
        ("custom", 3.0, 1.6)
    ]


def test_nothing_to_measure_and_a_negative_size_are_refused(capsys):
    for argv, message in (
        (["--sizes", "0"], "nothing to measure"),
        (["--sizes", "-5"], "--sizes must be >= 0"),
    ):
        with pytest.raises(SystemExit):
            bench_search.parse_args(argv)
        assert message in capsys.readouterr().err


def test_keep_folders_per_generator_and_seed(tmp_path, capsys):
    """The first generator's first seed keeps <DIR>/<size> (what bench_serving reads); the others a subfolder."""
    argv = ["--sizes", "3000", "--seeds", "0", "1", "--keep", str(tmp_path)]
    args = bench_search.parse_args(argv)
    folders = [bench_search.size_folders(args, source) for source in bench_search.sources(args)]
    assert folders == [[tmp_path / "3000"], [tmp_path / "default-seed1" / "3000"]]
    (tmp_path / "default-seed1" / "3000").mkdir(parents=True)
    with pytest.raises(SystemExit):
        bench_search.parse_args(argv)
    assert "default-seed1/3000 already exist" in capsys.readouterr().err


def test_a_negative_shard_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_search.parse_args(["--sizes", "3000", "--shard", "-1"])
    assert "--shard must be >= 0 rows" in capsys.readouterr().err


@pytest.mark.skipif(bench_search.faiss is None, reason="faiss is optional and not installed")
@pytest.mark.timeout(300)
def test_a_streamed_build_commits_shard_by_shard_and_answers_as_one_build(tmp_path):
    """``--shard``: 5,000 rows streamed as commits of 1,000 (the first trains the quantizer on 1,000 rows...
    retrained as the gallery asks for more lists) hold every row once, in order, in merged segments, and find
    the top-10 about as a one-commit build does."""
    gen, ids, gallery = bench_search.make_gallery(
        5000, bench_search.Source("default", 0, *bench_search.GENERATORS["default"])
    )
    paths = [f"{i:08d}.jpg" for i in range(5000)]
    query = bench_search.queries(gen, ids, 100, 23)
    exact = gi.chunked_topk(query, gallery, 10)[1]
    found = {}
    for shard in (1000, 0):
        out = tmp_path / f"shard{shard}"
        index = bench_search.build_ann(out, gallery, paths, "ivf", "combined", None, shard)
        segments = bench_search.index_meta(out)
        assert len(index) == 5000 and index.faiss_index.ntotal == 5000
        assert [s["start"] for s in segments] == sorted(s["start"] for s in segments)
        assert sum(s["rows"] for s in segments) == 5000
        assert torch.equal(index.embeds["global"][:].float(), gallery["global"].float())
        found[shard] = bench_search.recall(index.topk(query, 10)[1], exact)
    assert found[1000] >= 0.9 and abs(found[1000] - found[0]) <= 0.05, found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rows_per_generator_and_seed_and_their_minimum(tmp_path):
    out = tmp_path / "search.json"
    argv = ["--sizes", "2500", "--seeds", "0", "1", "--generators", "default", "noisy-text", "--no-tune"]
    payload = bench_search.main(
        [*argv, "--queries", "40", "--timed", "3", "--timed-exact", "2", "--output", str(out)]
    )
    assert json.loads(out.read_text())["summary"] == payload["summary"]
    rows = payload["rows"]
    tags = {(r["generator"], r["seed"]) for r in rows}
    assert tags == {("default", 0), ("default", 1), ("noisy-text", 0), ("noisy-text", 1)}
    generators = payload["generators"]
    assert (generators["noisy-text"]["text_noise"], generators["noisy-text"]["gap"]) == (2.0, 1.0)
    assert set(generators["default"]["matched_cosine"]) == {0, 1}
    noisy = generators["noisy-text"]["matched_cosine"][0]["text_image_matched"]
    assert noisy != generators["default"]["matched_cosine"][0]["text_image_matched"]
    if bench_search.faiss is None:
        return
    for name in ("default", "noisy-text"):
        ann = [r for r in rows if r["generator"] == name and r["method"] == "ann_combined"]
        (summary,) = [
            s for s in payload["summary"] if s["generator"] == name and s["method"] == "ann_combined"
        ]
        assert len(ann) == 2 and summary["seeds"] == [0, 1]
        assert summary["recall_min"] == min(r["recall"] for r in ann)
        assert summary["recall_held_out_min"] == min(r["recall_held_out"] for r in ann)
    assert [r["seed"] for r in first_seed_rows(payload)] == [0, 0]  # the search figure: default, seed 0
    results = tmp_path / "root" / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "search_cpu_seeds.json").write_text(out.read_text())
    table = render(FIGURES["search-seeds"], tmp_path / "root")
    assert "| noisy-text | 2,500 | [0, 1] |" in table and "text noise 2.0, modality gap 1.0" in table


@pytest.mark.slow
@pytest.mark.skipif(bench_search.faiss is None, reason="faiss is optional and not installed")
@pytest.mark.timeout(600)
def test_store_dtypes_build_one_index_each_against_the_same_exact_search(tmp_path):
    argv = [
        "--sizes",
        "2500",
        "--no-tune",
        "--store-dtype",
        "fp16",
        "int8",
        "--queries",
        "40",
        "--timed",
        "3",
    ]
    out = ["--keep", str(tmp_path / "keep"), "--output", str(tmp_path / "search.json")]
    payload = bench_search.main([*argv, "--timed-exact", "2", *out])
    ann = {r["store_dtype"]: r for r in payload["rows"] if r["method"] == "ann_combined"}
    assert set(ann) == {"fp16", "int8"} and ann["int8"]["ann_index_mib"] < 0.6 * ann["fp16"]["ann_index_mib"]
    assert all(0.8 <= r["recall"] <= 1.0 for r in ann.values())  # both against the fp16 exact top-10
    summary = {s["store_dtype"]: s for s in payload["summary"] if s["method"] == "ann_combined"}
    assert set(summary) == {"fp16", "int8"} and summary["int8"]["recall_min"] == ann["int8"]["recall"]
    stores = {
        json.loads((folder / "index.json").read_text())["store_dtype"]
        for folder in (tmp_path / "keep").rglob("ivf_combined*")
    }
    assert stores == {"fp16", "int8"}


def test_calibration_modes_build_one_index_each_and_skip_what_a_set_lacks(tmp_path):
    """`--calibration queries rows captions` on a generator: one index calibrated on rows + the generator's
    held-out text queries (kept in the index), one on rows alone; `captions` (a model set's) is skipped."""
    argv = ["--sizes", "2500", "--no-tune", "--calibration", "queries", "rows", "captions", "--queries", "40"]
    out = ["--keep", str(tmp_path / "keep"), "--output", str(tmp_path / "search.json")]
    payload = bench_search.main([*argv, "--timed", "3", "--timed-exact", "2", *out])
    ann = {r["calibration"]: r for r in payload["rows"] if r["method"] == "ann_combined"}
    assert set(ann) == {"rows+queries", "rows"}
    assert (
        ann["rows+queries"]["calibration_recall_queries"] >= 0.0
        and "calibration_recall_queries" not in ann["rows"]
    )
    summary = {s["calibration"] for s in payload["summary"] if s["method"] == "ann_combined"}
    assert summary == {"rows+queries", "rows"}
    kept = {
        folder.name: json.loads((folder / "index.json").read_text())["ann_request"]
        .get("queries", {})
        .get("rows")
        for folder in (tmp_path / "keep").rglob("ivf_combined*")
    }
    assert kept == {"ivf_combined": bench_search.annlib.CALIBRATION_QUERIES, "ivf_combined_rows": None}


def write_run_config(root: Path) -> Path:
    """A run folder whose config.json gives a tiny synthetic split; returns its model folder."""
    settings = {"synthetic.num_identities": 8, "synthetic.seed": 3, "synthetic.image_size": "[64, 32]"}
    settings |= {"synthetic.images_per_view": 1, "synthetic.test_fraction": 0.5}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(settings))
    return save_tiny_model(root / "best")


def test_model_set_crops_are_the_synthetic_test_images(tmp_path):
    """The rendered test split equals generate_dataset's test images and captions, crop for crop."""
    from PIL import Image

    from modeling_tagclip.data.synthetic import generate_dataset

    model = write_run_config(tmp_path / "run")
    settings = search_sets.split_settings(model)
    assert settings["num_identities"] == 8 and settings["image_size"] == [64, 32] and settings["seed"] == 3
    crops, captions = search_sets.test_crops(settings)
    generate_dataset(
        tmp_path / "data",
        8,
        seed=3,
        image_size=(64, 32),
        images_per_view=1,
        test_fraction=0.5,
        progress=False,
    )
    records = json.loads((tmp_path / "data" / "test_reid.json").read_text())
    assert len(crops) == len(records) > 0
    assert captions == [c for r in records for c in r["captions"]]
    for crop, record in zip(crops, records, strict=True):
        written = np.asarray(Image.open(tmp_path / "data" / "images" / record["file_path"]).convert("RGB"))
        assert np.array_equal(np.asarray(crop), written)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_search_measures_a_model_set(tmp_path):
    model = write_run_config(tmp_path / "run")
    out = tmp_path / "model.json"
    payload = bench_search.main(
        [
            "--sizes",
            "0",
            "--model",
            str(model),
            "--distractors",
            "24",
            "--timed",
            "2",
            "--timed-exact",
            "2",
            "--output",
            str(out),
        ]
    )
    info = payload["generators"]["model"]
    test_crops = len(search_sets.test_crops(search_sets.split_settings(model))[0])
    assert (
        info["test_crops"] == test_crops and info["distractors"] == 24 and info["captions"] == 2 * test_crops
    )
    (exact,) = payload["rows"]  # below the ANN's minimum size the gallery is searched exactly
    assert exact["generator"] == "model" and exact["size"] == test_crops + 24 and exact["recall"] == 1.0
    assert len(search_sets.test_people(search_sets.split_settings(model))) == test_crops
    assert 0.0 <= exact["person_r1"] <= 1.0


def test_person_r1_counts_the_first_results_that_show_the_querys_person():
    people = {"gallery": torch.tensor([5, 7, -1, 5]), "test": torch.tensor([5, 7, 9])}
    found = torch.tensor([[3, 1], [2, 1], [0, 2]])  # person 5 (right), a distractor (wrong), person 5 (wrong)
    assert bench_search.person_r1(found, people) == round(1 / 3, 4)


def test_test_people_follow_the_rendered_crops(tmp_path):
    """One person id per rendered test crop, in order: a person seen from both views has twice the crops."""
    settings = search_sets.split_settings(write_run_config(tmp_path / "run"))
    people = search_sets.test_people(settings)
    crops, captions = search_sets.test_crops(settings)
    assert len(people) == len(crops) and len(captions) == 2 * len(crops)
    assert people == sorted(people) and len(set(people)) < len(people)
