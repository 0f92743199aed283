"""benchmarks/bench_crossview.py: identities from the ground truth, the cross-view protocols and the description ->
timeline chain on known answers, parity with the search the demo runs, and a whole run at tiny size."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fixtures import make_visa_model, save_tiny_model, tiny_model

from benchmarks import bench_crossview as bench
from benchmarks.bench_crossview import Track, cross_view, follow, identity_of, track_query, track_scores
from modeling_tagclip.metrics.rerank import RerankConfig


def test_a_track_takes_the_identity_most_of_its_crops_overlap():
    gt = {
        "cam": {
            1: (np.array([7, 3]), np.array([[0, 0, 10, 20], [50, 0, 60, 20]], float)),
            2: (np.array([7, 3]), np.array([[2, 0, 12, 20], [50, 0, 60, 20]], float)),
        }
    }
    crop = lambda frame, box: {"camera": "cam", "frame": str(frame), "box": " ".join(map(str, box))}  # noqa: E731
    assert identity_of([crop(0, [0, 0, 10, 20]), crop(1, [2, 1, 12, 20]), crop(0, [50, 0, 60, 20])], gt) == 7
    assert identity_of([crop(0, [6, 0, 16, 20])], gt) == -1  # IoU 4/16 < 0.5: no one
    assert identity_of([crop(5, [0, 0, 10, 20])], gt) == -1  # a frame without ground truth


def _oracle(identities_by_track: list[tuple[str, int, int]]) -> tuple[list[Track], torch.Tensor]:
    """Tracks (view, identity, crops) whose crop vectors are one-hot by identity (distractors: a dimension of their
    own), each crop slightly different."""
    tracks, rows, dims = [], [], 10
    generator = torch.Generator().manual_seed(0)
    for k, (view, who, crops) in enumerate(identities_by_track):
        start = len(rows)
        for _ in range(crops):
            v = torch.zeros(dims)
            v[who if who >= 0 else dims - 1 - k % 3] = 1.0
            rows.append(v + 0.01 * torch.rand(dims, generator=generator))
        tracks.append(Track(f"{view}-cam", str(k), view, who, tuple(range(start, len(rows)))))
    return tracks, torch.nn.functional.normalize(torch.stack(rows), dim=1)


TRACKS = [
    ("ground", 1, 3),
    ("ground", 2, 2),
    ("ground", 3, 3),
    ("aerial", 1, 2),
    ("aerial", 2, 3),
    ("aerial", -1, 2),
    ("ground", 1, 1),
]


@pytest.mark.parametrize("rerank", [None, RerankConfig(k1=4, k2=2)])
def test_perfect_embeddings_score_100_in_both_directions(rerank):
    tracks, vectors = _oracle(TRACKS)
    g2a = cross_view(vectors, tracks, "ground->aerial", rerank)
    assert g2a == {"queries": 3, "gallery_tracks": 3, "R@1": 100.0, "mAP": 100.0}  # person 3 is never aerial
    a2g = cross_view(vectors, tracks, "aerial->ground", rerank)
    assert a2g == {
        "queries": 2,
        "gallery_tracks": 4,
        "R@1": 100.0,
        "mAP": 100.0,
    }  # the distractor asks nothing


def test_a_person_found_second_scores_r1_0_and_ap_50():
    tracks, vectors = _oracle(TRACKS)
    mixed = vectors.clone()  # person 2's ground crops now look more like person 1 than like person 2
    mixed[list(tracks[1].rows)] = torch.nn.functional.normalize(
        0.6 * torch.eye(10)[1] + 0.4 * torch.eye(10)[2], dim=0
    )
    # the two ground tracks of person 1 find aerial 1 first; ground 2 finds aerial 1 first, its own person second
    result = cross_view(mixed, tracks, "ground->aerial")
    assert result["R@1"] == pytest.approx(200 / 3) and result["mAP"] == pytest.approx((1 + 1 + 0.5) / 3 * 100)


def test_a_track_scores_as_its_best_crop_against_the_mean_of_the_query_crops():
    tracks, vectors = _oracle(TRACKS)
    query = track_query(vectors, tracks[0])
    assert torch.allclose(query, vectors[list(tracks[0].rows)].mean(0))
    scores = track_scores(query[None], vectors, tracks)[0]
    for j, t in enumerate(tracks):
        assert scores[j] == pytest.approx(float((vectors[list(t.rows)] @ query).max()))


def test_description_to_timeline_shares():
    tracks, vectors = _oracle(TRACKS)
    # captions of persons 1, 2, 3 that match one crop exactly: of ground 1, aerial 2 and ground 3
    text = vectors[[tracks[0].rows[0], tracks[4].rows[0], tracks[2].rows[0]]]
    result = follow(text, [1, 2, 3], vectors, vectors, tracks, top=3)
    assert result["all"] == {
        "queries": 3,
        "share": 100.0,
        "first_right": 100.0,
    }  # each person's tracks in its top 3
    assert result["ground->aerial"] == {
        "queries": 1,
        "share": 100.0,
        "first_right": 100.0,
    }  # person 3: no aerial
    assert result["aerial->ground"] == {"queries": 1, "share": 100.0, "first_right": 100.0}
    # person 2's crop, captioned as person 1: the first sighting is person 2, whose top 2 are person 2's tracks
    wrong = follow(vectors[[tracks[1].rows[0]]], [1], vectors, vectors, tracks, top=2)
    assert wrong["all"] == {"queries": 1, "share": 0.0, "first_right": 0.0}


@pytest.fixture(scope="module")
def footage_gallery(tmp_path_factory):
    """The demo's small synthetic footage ingested with the tiny model (FollowSession, as the demo does it)."""
    from modeling_tagclip.video.follow import FollowSession

    model, processor = tiny_model()
    session = FollowSession(model, processor, tmp_path_factory.mktemp("crossview") / "gallery")
    session.use_synthetic()
    return session


def test_ingested_tracks_get_their_true_identities(footage_gallery):
    session = footage_gallery
    tracks = bench.gallery_tracks(session.index, session.crops, session.folder / "synthetic-footage" / "gt")
    cast = {
        int(k) for k in json.loads((session.folder / "synthetic-footage" / "identities.json").read_text())
    }
    found = {t.identity for t in tracks} - {-1}
    assert found <= cast and len(found) >= 3
    assert sorted(r for t in tracks for r in t.rows) == list(range(len(session.index)))
    assert {t.view for t in tracks} == {"ground", "aerial"}


def test_tagclip_scores_are_the_search_the_demo_runs(footage_gallery):
    session = footage_gallery
    tracks = bench.gallery_tracks(session.index, session.crops, session.folder / "synthetic-footage" / "gt")
    vectors = bench.tagclip_vectors(session.index.embeds)
    for hit in session.search("a person", 3):
        mine = next(t for t in tracks if (t.camera, t.track) == (hit["camera"], hit["track"]))
        ours = track_scores(track_query(vectors, mine)[None], vectors, tracks)[0]
        theirs = {(h["camera"], h["track"]): h["score"] for h in session.more_like(hit, len(tracks))}
        assert {(t.camera, t.track): float(s) for t, s in zip(tracks, ours, strict=True)} == pytest.approx(
            theirs, abs=1e-5
        )


@pytest.mark.slow
def test_a_whole_run_at_tiny_size_renders_both_figures(tmp_path):
    from benchmarks.figures import FIGURES
    from benchmarks.render import render

    model = save_tiny_model(tmp_path / "model")
    make_visa_model().save_pretrained(tmp_path / "visa")
    out = tmp_path / "benchmarks" / "results" / "crossview_cpu.json"
    footage = {
        "ground_cameras": 2,
        "aerial_cameras": 1,
        "people": 4,
        "people_per_camera": 3,
        "seconds": 6.0,
        "fps": 5.0,
        "size": [144, 256],
    }
    bench.main(
        [
            "--model",
            str(model),
            "--reid-models",
            str(tmp_path / "visa"),
            "--seeds",
            "1",
            "--footage",
            json.dumps(footage),
            "--output",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["machine"]["commit"] and data["footage"]["people"] == 4
    names = ["TAG-CLIP", "TAG-CLIP + re-ranking", "ViSA", "ViSA + re-ranking"]
    assert [(r["embedding"], r["direction"]) for r in data["rows"]] == [
        (n, d) for n in names for d in ("ground->aerial", "aerial->ground")
    ]
    (run,) = data["runs"]
    for row in data["rows"]:
        assert row["queries"] == run["image"][row["embedding"]][row["direction"]]["queries"]
        value = run["image"][row["embedding"]][row["direction"]]["R@1"]
        assert row["R@1"] == (None if value is None else f"{value:.2f}")
    assert [(r["embedding"], r["direction"]) for r in data["timeline_rows"]] == [
        (n, d) for n in ("TAG-CLIP", "ViSA") for d in ("ground->aerial", "aerial->ground", "all")
    ]
    assert run["tracks"] < 20 and data["timeline_rows"][2]["share"] == "100.00"  # a top 20 holds every track
    table = render(FIGURES["crossview"], tmp_path)
    assert table.count("\n| ") == 1 + 8 and "Measured by `python" in table
    assert render(FIGURES["crossview-timeline"], tmp_path).count("\n| ") == 1 + 6
    assert render(FIGURES["crossview"], tmp_path / "elsewhere").startswith(
        "Not measured: `python benchmarks/"
    )


def test_bad_footage_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--footage", "[1, 2]", "--output", "/dev/null"])
    assert "must be a JSON object of render_footage options" in capsys.readouterr().err
