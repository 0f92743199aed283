"""The `evaluate` metric modules load from their local folders and report exactly the project's metrics."""

from __future__ import annotations

from pathlib import Path

import evaluate  # the `train` extra
import numpy as np
import pytest
import torch

from modeling_tagclip.evaluation.text_retrieval import RetrievalRun, summarize
from modeling_tagclip.metrics.reid import evaluate_protocols, view_protocols

MODULES = Path(__file__).resolve().parents[2] / "modeling_tagclip" / "metrics" / "evaluate_modules"


def _run(seed: int = 0) -> RetrievalRun:
    rng = np.random.default_rng(seed)
    g_ids = np.repeat(np.arange(10), 3)
    views = rng.integers(0, 2, 30)
    q_source = rng.integers(0, 30, 50)
    unit = lambda x: torch.nn.functional.normalize(torch.from_numpy(x).float(), dim=1)  # noqa: E731
    centres = rng.standard_normal((10, 24))
    image = {
        "global": unit(centres[g_ids] + rng.standard_normal((30, 24))),
        "local": unit(rng.standard_normal((30, 8))),
    }
    text = {
        "global": unit(centres[g_ids[q_source]] + 1.5 * rng.standard_normal((50, 24))),
        "local": unit(rng.standard_normal((50, 8))),
    }
    return RetrievalRun(text, image, g_ids[q_source], g_ids, views, [], [], q_source)


def test_text_retrieval_module_equals_the_project_evaluator():
    run = _run()
    expected = summarize(run, probe=False)
    metric = evaluate.load(str(MODULES / "text_person_retrieval"))
    scores = run.similarity.numpy()
    for start in range(0, 50, 16):  # batches, as a user adds them
        metric.add_batch(
            predictions=scores[start : start + 16].tolist(), references=run.query_ids[start : start + 16]
        )
    got = metric.compute(gallery_ids=run.gallery_ids.tolist(), gallery_views=run.gallery_views.tolist())
    for key in ("R@1", "R@5", "R@10", "mAP", "mINP"):
        assert got[key] == pytest.approx(expected[key], abs=1e-9), key
    assert got["match_view_breakdown"].keys() == expected["match_view_breakdown"].keys()
    for name, row in expected["match_view_breakdown"].items():
        assert got["match_view_breakdown"][name] == pytest.approx(row, abs=1e-9)
    assert 0 < got["R@1"] < 100  # a ranking that is neither perfect nor hopeless


def test_text_retrieval_module_rejects_a_query_without_match():
    metric = evaluate.load(str(MODULES / "text_person_retrieval"))
    with pytest.raises(ValueError, match="no relevant gallery item"):
        metric.compute(predictions=[[0.1, 0.2]], references=[7], gallery_ids=[1, 2])


def test_reid_module_equals_evaluate_protocols():
    rng = np.random.default_rng(1)
    qf, gf = rng.standard_normal((12, 6)).astype(np.float32), rng.standard_normal((40, 6)).astype(np.float32)
    query = {
        "person_id": rng.integers(0, 5, 12),
        "camera_id": rng.integers(0, 4, 12),
        "view": rng.integers(0, 2, 12),
    }
    gallery = {
        "person_id": rng.integers(0, 5, 40),
        "camera_id": rng.integers(0, 4, 40),
        "view": rng.integers(0, 2, 40),
    }
    expected = evaluate_protocols(qf, gf, query, gallery, view_protocols(query["view"], gallery["view"]))
    metric = evaluate.load(str(MODULES / "aerial_ground_reid"))
    got = metric.compute(
        predictions=qf.tolist(),
        references=query["person_id"],
        query_camids=query["camera_id"],
        query_views=query["view"],
        gallery_embeddings=gf.tolist(),
        gallery_pids=gallery["person_id"].tolist(),
        gallery_camids=gallery["camera_id"].tolist(),
        gallery_views=gallery["view"].tolist(),
    )
    assert list(got) == ["ALL", "A<->G", "G<->G", "A<->A", "A<->G (VDT)", "G->A"]
    for name, row in expected.items():
        assert got[name] == pytest.approx(row, abs=1e-6), name
    assert got["ALL"]["num_queries"] > 0
    with pytest.raises(ValueError, match="protocols must be"):
        metric.compute(
            predictions=qf.tolist(),
            references=query["person_id"],
            query_camids=query["camera_id"],
            query_views=query["view"],
            gallery_embeddings=gf.tolist(),
            gallery_pids=gallery["person_id"],
            gallery_camids=gallery["camera_id"],
            gallery_views=gallery["view"],
            protocols="views2",
        )
