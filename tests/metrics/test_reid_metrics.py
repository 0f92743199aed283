"""Re-ID metrics: known answers with same-camera filtering, parity with fast-reid's per-query loop, protocols."""

import numpy as np
import pytest

from modeling_tagclip.metrics.reid import (
    Protocol,
    cosine_distances,
    evaluate_protocols,
    reid_metrics,
    stream_reid_metrics,
    view_protocols,
)


def fastreid_loop(dist, q_pids, g_pids, q_cams, g_cams, max_rank=10):
    """fast-reid `eval_market1501` (Cython semantics) written as a plain per-query loop."""
    cmc_all, aps, inps = [], [], []
    for i in range(len(q_pids)):
        order = np.argsort(dist[i], kind="stable")
        keep = ~((g_pids[order] == q_pids[i]) & (g_cams[order] == q_cams[i]))
        raw = (g_pids[order] == q_pids[i])[keep].astype(np.int64)
        if not raw.any():
            continue
        cum = raw.cumsum()
        last = np.flatnonzero(raw == 1).max()
        inps.append(cum[last] / (last + 1.0))
        cmc = np.minimum(cum, 1)
        cmc = np.pad(cmc, (0, max(0, max_rank - len(cmc))), constant_values=1)[:max_rank]
        cmc_all.append(cmc)
        aps.append((cum / (np.arange(len(raw)) + 1.0) * raw).sum() / raw.sum())
    cmc = np.mean(cmc_all, axis=0)
    return {
        "R1": 100 * cmc[0],
        "R5": 100 * cmc[4],
        "R10": 100 * cmc[9],
        "mAP": 100 * np.mean(aps),
        "mINP": 100 * np.mean(inps),
    }


def test_known_answer_with_same_camera_removal():
    # query 0 (pid 1, cam 0): ranking g0 (pid1 cam0: removed), g1 miss, g2 hit, g3 miss, g4 hit
    # -> kept ranks: hit at 2 and 4: R1 0, AP (1/2 + 2/4) / 2 = 0.5, INP 2/4
    # query 1 (pid 3, cam 1): g3 (pid 3, cam 0) first -> R1 1, AP 1, INP 1; query 2 (pid 4) has no match: skipped
    g_pids = np.array([1, 2, 1, 3, 1])
    g_cams = np.array([0, 1, 1, 0, 2])
    dist = np.array(
        [
            [0.0, 0.1, 0.2, 0.3, 0.4],
            [0.5, 0.4, 0.3, 0.0, 0.6],
            [0.1, 0.2, 0.3, 0.4, 0.5],
        ]
    )
    out = reid_metrics(dist, [1, 3, 4], g_pids, [0, 1, 0], g_cams)
    assert out["num_queries"] == 2
    assert out["R1"] == pytest.approx(50.0) and out["R5"] == pytest.approx(100.0)
    assert out["mAP"] == pytest.approx(75.0) and out["mINP"] == pytest.approx(75.0)
    assert out["metric"] == pytest.approx(62.5)


def test_matches_fastreid_loop_on_random_data():
    rng = np.random.default_rng(0)
    q_pids, g_pids = rng.integers(0, 15, 40), rng.integers(0, 15, 300)
    q_cams, g_cams = rng.integers(0, 4, 40), rng.integers(0, 4, 300)
    dist = rng.random((40, 300))
    got = reid_metrics(dist, q_pids, g_pids, q_cams, g_cams, chunk_size=7)
    expected = fastreid_loop(dist, q_pids, g_pids, q_cams, g_cams)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key


def test_no_valid_query_and_bad_shapes_raise():
    with pytest.raises(ValueError, match="no query has a matching"):
        reid_metrics(np.zeros((1, 2)), [1], [1, 1], [0], [0, 0])
    with pytest.raises(ValueError, match="distances must be"):
        reid_metrics(np.zeros((2, 2)), [1], [1, 1], [0], [0, 0])


def test_cosine_distances():
    d = cosine_distances(np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[3.0, 0.0], [1.0, 1.0]]))
    np.testing.assert_allclose(d, [[0.0, 1 - 2**-0.5], [1.0, 1 - 2**-0.5]], atol=1e-6)


def hand_made_gallery():
    """Features are one-hot 'identities'; a query matches every gallery image of its identity equally well."""
    query = {"person_id": [1, 2, 1], "camera_id": [0, 6, 7], "view": [0, 1, 1]}
    gallery = {
        "person_id": [1, 1, 2, 2, 1],
        "camera_id": [0, 6, 1, 6, 3],
        "view": [0, 1, 0, 1, 0],
    }
    eye = np.eye(3)
    return eye[query["person_id"]], eye[gallery["person_id"]] + 1e-3 * np.arange(5)[:, None], query, gallery


def test_view_protocols_on_hand_made_gallery():
    qf, gf, query, gallery = hand_made_gallery()
    protocols = view_protocols(query["view"], gallery["view"])
    assert list(protocols["A<->G"].query) == [0] and list(protocols["A<->G"].gallery) == [1, 3]
    assert list(protocols["G<->G"].query) == [1, 2] and list(protocols["A<->A"].gallery) == [0, 2, 4]
    results = evaluate_protocols(qf, gf, query, gallery, protocols)
    # A<->G: aerial query pid 1 vs ground gallery {g1 (pid 1), g3 (pid 2)}: views differ, nothing filtered
    assert results["A<->G"]["num_queries"] == 1 and results["A<->G"]["R1"] == 100.0
    # A<->A: query pid 1 on cam 0; g0 (pid 1, cam 0) removed, g4 (pid 1, cam 3) remains
    assert results["A<->A"]["num_queries"] == 1 and results["A<->A"]["mAP"] == 100.0
    # G<->G: query pid 2 (cam 6): its only ground match g3 is on cam 6 -> removed; query pid 1 (cam 7): g1 kept
    assert results["G<->G"]["num_queries"] == 1
    # VDT pooled: cameras collapse to views; query 0 (aerial, pid 1) loses g0 and g4 (aerial), keeps g1
    assert results["A<->G (VDT)"]["num_queries"] == 3
    assert results["ALL"]["num_queries"] == 3
    # G->A: ground queries vs aerial gallery: pid 2 -> g2, pid 1 -> g0 / g4
    assert results["G->A"]["num_queries"] == 2 and results["G->A"]["R1"] == 100.0


def test_vdt_pooled_differs_from_camera_filtering():
    # aerial query pid 1 on cam 2; its only match is aerial on cam 3: valid with cameras, removed with views
    qf, gf = np.eye(2)[[0]], np.eye(2)[[0, 1]]
    query = {"person_id": [1], "camera_id": [2], "view": [0]}
    gallery = {"person_id": [1, 2], "camera_id": [3, 7], "view": [0, 1]}
    protocols = {"cams": Protocol(), "views": Protocol(camera_ids="view")}
    results = evaluate_protocols(qf, gf, query, gallery, protocols)
    assert results["cams"]["R1"] == 100.0 and results["views"] == {"num_queries": 0}


@pytest.mark.parametrize("chunk_size", [1, 5, 256])
def test_matches_fastreid_loop_with_tied_distances_and_junk(chunk_size):
    """Coarse distances (many ties) and few cameras (many same-camera items removed)."""
    rng = np.random.default_rng(1)
    q_pids, g_pids = rng.integers(0, 6, 30), rng.integers(0, 6, 90)
    q_cams, g_cams = rng.integers(0, 2, 30), rng.integers(0, 2, 90)
    dist = np.round(rng.random((30, 90)), 1).astype(np.float32)
    got = reid_metrics(dist, q_pids, g_pids, q_cams, g_cams, chunk_size=chunk_size)
    expected = fastreid_loop(dist, q_pids, g_pids, q_cams, g_cams)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key


def test_large_identities_take_the_sorting_path():
    """An identity with more gallery images than COUNT_RANKS_MAX is ranked by sorting: same numbers."""
    rng = np.random.default_rng(2)
    g_pids = np.concatenate([np.zeros(60, dtype=int), rng.integers(1, 4, 40)])
    q_pids = rng.choice(g_pids, 25)
    q_cams, g_cams = rng.integers(0, 3, 25), rng.integers(0, 3, 100)
    dist = np.round(rng.random((25, 100)), 2).astype(np.float32)
    got = reid_metrics(dist, q_pids, g_pids, q_cams, g_cams)
    for key, value in fastreid_loop(dist, q_pids, g_pids, q_cams, g_cams).items():
        assert got[key] == pytest.approx(value, abs=1e-9), key


def test_streamed_from_features_equals_the_distance_matrix():
    rng = np.random.default_rng(3)
    qf, gf = rng.standard_normal((20, 8)), rng.standard_normal((70, 8))
    q_pids, g_pids = rng.integers(0, 7, 20), rng.integers(0, 7, 70)
    q_cams, g_cams = rng.integers(0, 3, 20), rng.integers(0, 3, 70)
    expected = reid_metrics(cosine_distances(qf, gf), q_pids, g_pids, q_cams, g_cams)
    got = stream_reid_metrics(qf, gf, q_pids, g_pids, q_cams, g_cams, chunk_size=6)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_synthetic_set_is_named_as_itself_not_cargo(tmp_path):
    """Regression: the synthetic set is in CARGO's layout and was reported as "CARGO"."""
    from modeling_tagclip.data.reid import load_reid_dataset
    from modeling_tagclip.data.synthetic_reid import generate_reid_dataset

    generate_reid_dataset(
        tmp_path, num_identities=2, image_size=(16, 8), aerial_per_id=2, ground_per_id=2, progress=False
    )
    assert load_reid_dataset(str(tmp_path)).name == "synthetic_reid"
