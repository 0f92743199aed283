"""Tests for `tagclip eval` (modeling_tagclip.evaluation.text_retrieval: TAG-PR Eq. 14 retrieval evaluation, CLI, determinism, bad data) and plots."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image

from modeling_tagclip.data.text_retrieval import IMAGE_FEATURES
from modeling_tagclip.evaluation import text_retrieval as E


def test_retrieval_metrics_is_exposed():
    from modeling_tagclip.metrics.retrieval import retrieval_metrics

    assert E.retrieval_metrics is retrieval_metrics
    result = E.retrieval_metrics(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), [1, 2], [1, 2])
    assert result == {"R@1": 100.0, "R@5": 100.0, "R@10": 100.0, "mAP": 100.0, "mINP": 100.0}


def test_chance_r1():
    assert E.chance_r1(np.array([1, 1, 2]), np.array([1, 1, 2, 3])) == pytest.approx(
        100 * (2 + 2 + 1) / 3 / 4
    )


@pytest.mark.slow
def test_cli_writes_json_grid_and_is_deterministic(tmp_path, data_dir, model_dir, capsys):
    args = ["--model", str(model_dir), "--data", str(data_dir), "--batch_size", "8"]
    first = E.main([*args, "--output", str(tmp_path / "a.json"), "--grid", str(tmp_path / "grid.png")])
    printed = capsys.readouterr().out  # it says what it wrote, and where
    assert f"wrote the results to {tmp_path / 'a.json'}" in printed
    assert f"wrote the retrieval grid to {tmp_path / 'grid.png'}" in printed
    second = E.main([*args, "--output", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    assert first == second
    assert {"R@1", "R@5", "R@10", "mAP", "mINP", "match_view_breakdown", "view_probe", "chance_R@1"} <= set(
        first
    )
    assert set(first["match_view_breakdown"]) <= {"aerial-only", "ground-only", "aerial-and-ground"}
    assert {"accuracy", "majority_baseline"} == set(first["view_probe"])
    assert first["num_gallery"] == len(json.loads((data_dir / "test_reid.json").read_text()))
    assert first["num_queries"] == 2 * first["num_gallery"]
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_unwritable_output_loses_no_metric(tmp_path, data_dir, model_dir, capsys):
    """The metrics are printed before --output is written, and the write error names the file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = ["--model", str(model_dir), "--data", str(data_dir), "--batch_size", "8", "--no_probe"]
    with pytest.raises(OSError, match="cannot write --output .*a-file"):
        E.main([*args, "--output", str(blocker / "out.json")])
    printed = capsys.readouterr().out
    assert '"R@1"' in printed and "chance R@1" in printed


def test_similarity_is_eq14_of_the_model_features(data_dir, model_dir):
    model, processor = E.load_model(model_dir)
    dataset = E.load_eval_dataset(data_dir, "test")
    run = E.run_retrieval(model, processor, dataset, batch_size=5, progress=False)
    images = [E.load_image(p) for p in dataset["image_path"]]
    with torch.inference_mode():
        image = model.get_image_features(**processor(images=images, return_tensors="pt"))
        text = model.get_text_features(input_ids=processor(text=run.captions)["input_ids"])
        expected = model.similarity(text, image)
    torch.testing.assert_close(run.similarity, expected, atol=1e-5, rtol=0)
    assert run.similarity.shape == (len(run.captions), len(dataset))


def test_stochastic_routing_still_evaluates_deterministically(data_dir, model_dir):
    model, processor = E.load_model(model_dir)
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module.config, "routing"):
            module.config.routing = "gumbel"
    dataset = E.load_eval_dataset(data_dir, "test")
    a = E.run_retrieval(model, processor, dataset, progress=False)
    b = E.run_retrieval(model, processor, dataset, progress=False)
    assert torch.equal(a.similarity, b.similarity)


def _dataset(tmp_path: Path, bad: str) -> Dataset:
    rows = []
    for i in range(4):
        path = tmp_path / f"{i}.png"
        Image.new("RGB", (32, 64), (40 * i, 0, 0)).save(path)
        rows.append(
            {
                "image_path": str(path),
                "person_id": i // 2,
                "captions": ["a red top"],
                "view": i % 2,
                "split": "test",
            }
        )
    if bad == "missing":
        rows[1]["image_path"] = str(tmp_path / "nope.png")
    elif bad == "corrupt":
        (tmp_path / "1.png").write_bytes(b"\x89PNG garbage")
    elif bad == "empty":
        rows[1]["captions"] = ["   "]
    return Dataset.from_list(rows, features=IMAGE_FEATURES)


@pytest.mark.parametrize(
    "bad, message", [("missing", "nope.png"), ("corrupt", "1.png"), ("empty", "empty captions")]
)
def test_bad_data_raises_clear_errors(tmp_path, model_dir, bad, message):
    model, processor = E.load_model(model_dir)
    with pytest.raises(ValueError, match=message):
        E.evaluate_model(model, processor, _dataset(tmp_path, bad), progress=False)


def test_training_curves_png(tmp_path):
    from modeling_tagclip.plots import read_metrics, training_curves

    lines = [
        {"step": s, "kind": "train", "loss": 5.0 / s, "loss_nitc": 3.0 / s, "lr": 1e-4, "view_accuracy": 0.5}
        for s in (1, 2, 3)
    ]
    lines += [
        {"step": 2, "kind": "train", "loss": 9.0, "lr": 1e-4},
        {"step": 3, "kind": "validation", "R@1": 10.0, "mAP": 12.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_metrics(path)
    assert [r["loss"] for r in records if r["kind"] == "train"] == [
        5.0,
        9.0,
        5.0 / 3,
    ]  # a re-logged step wins
    assert training_curves(path, tmp_path / "curves.png").stat().st_size > 0


def test_streamed_summary_equals_the_argsort_evaluator(data_dir, model_dir):
    """The numbers are those of the evaluator that sorted every row of the full similarity matrix."""
    from fixtures import argsort_reference

    model, processor = E.load_model(model_dir)
    run = E.run_retrieval(model, processor, E.load_eval_dataset(data_dir, "test"), progress=False)
    result = E.summarize(run, probe=False, chunk_size=7)
    expected, breakdown = argsort_reference(
        run.similarity.numpy(), run.query_ids, run.gallery_ids, run.gallery_views
    )
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9), key
    assert result["match_view_breakdown"].keys() == breakdown.keys()
    for name, row in breakdown.items():
        assert result["match_view_breakdown"][name] == pytest.approx(row, abs=1e-9), name


def _distributed_worker(
    rank: int, world: int, rendezvous: str, model_dir: str, data_dir: str, out: str
) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    try:
        model, processor = E.load_model(model_dir)
        dataset = E.load_eval_dataset(data_dir, "test")
        result = E.evaluate_model(
            model, processor, dataset, batch_size=4, probe=False, progress=False, distributed=True
        )
        Path(f"{out}.{rank}").write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # starts two processes
def test_two_ranks_give_the_single_process_numbers(tmp_path, data_dir, model_dir):
    """Encoding split over 2 gloo ranks and gathered, queries scored per rank and the sums all-reduced."""
    out = tmp_path / "result"
    args = (2, str(tmp_path / "rendezvous"), str(model_dir), str(data_dir), str(out))
    torch.multiprocessing.spawn(_distributed_worker, args=args, nprocs=2, join=True)
    model, processor = E.load_model(model_dir)
    expected = E.evaluate_model(
        model, processor, E.load_eval_dataset(data_dir, "test"), batch_size=4, probe=False, progress=False
    )
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        for key in ("R@1", "R@5", "R@10", "mAP", "mINP", "num_queries", "num_gallery"):
            assert got[key] == pytest.approx(expected[key], abs=1e-6), (rank, key)
        assert got["match_view_breakdown"].keys() == expected["match_view_breakdown"].keys()
