"""The demo's "Follow a person" flow without the page (modeling_tagclip.video.follow, app_follow's handlers):
the synthetic footage into a gallery, a description to one hit per track, a hit's track as the image query,
the per-camera timeline, and one-line errors."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import tiny_model

from modeling_tagclip.retrieval.encode import embedding_scores
from modeling_tagclip.video.follow import DEMO_FOOTAGE, FollowError, FollowSession, hit_caption
from modeling_tagclip.video.manifest import read_manifest

QUERY = "a woman in a red coat with a black backpack"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    model, processor = tiny_model()
    follow = FollowSession(model, processor, tmp_path_factory.mktemp("follow") / "gallery")
    follow.status = follow.use_synthetic()
    return follow


def _tracks(session) -> dict[tuple[str, str], list[dict]]:
    rows: dict[tuple[str, str], list[dict]] = {}
    for row in read_manifest(session.crops):
        rows.setdefault((row["camera"], row["track"]), []).append(row)
    return rows


def test_the_synthetic_footage_lands_in_the_gallery(session):
    tracks = _tracks(session)
    cameras = {camera for camera, _ in tracks}
    assert cameras == {"ground-01", "ground-02", "aerial-01"}  # DEMO_FOOTAGE: two street cameras, a drone
    assert DEMO_FOOTAGE["ground_cameras"] == 2 and DEMO_FOOTAGE["aerial_cameras"] == 1
    assert session.tracks() == len(tracks) >= 4
    assert len(session.index) == sum(len(rows) for rows in tracks.values())
    assert session.status == (
        f"Ingested 3 video(s): {len(tracks)} new track(s); the gallery holds {len(tracks)} track(s), "
        f"{len(session.index)} crop(s) in {session.folder}."
    )


def test_a_description_gives_one_hit_per_track_best_first(session):
    hits = session.search(QUERY, 50)
    keys = [(h["camera"], h["track"]) for h in hits]
    assert len(keys) == len(set(keys)) == session.tracks()  # every track once
    assert [h["rank"] for h in hits] == list(range(1, len(hits) + 1))
    assert all(a["score"] >= b["score"] for a, b in zip(hits, hits[1:], strict=False))
    assert len(session.search(QUERY, 2)) == 2
    # a track's score is its best crop's TAG-PR Eq. 14 score, and its seek second is that crop's frame in its video
    from modeling_tagclip.retrieval.encode import encode_texts

    text = encode_texts(session.model, session.processor, [QUERY])
    scores = embedding_scores(text, session.index.embeds)[0]
    for hit in hits:
        rows = session.index.mask({"camera": hit["camera"], "track": hit["track"]}).nonzero().squeeze(1)
        assert hit["score"] == pytest.approx(float(scores[rows].max()), abs=1e-5)
        assert hit["seek"] == pytest.approx(hit["frame"] / DEMO_FOOTAGE["fps"], abs=1e-6)
    assert re.fullmatch(
        r"#1 · \S+ · track \S+ · \d\d:\d\d:\d\d-\d\d:\d\d:\d\d · score -?\d\.\d{3}", hit_caption(hits[0])
    )


def _track_by_row(session) -> list[tuple[str, str]]:
    """The (camera, track) of every gallery row, from the crops' manifest."""
    root = session.crops.resolve()
    key = {(root / r["path"]).as_posix(): (r["camera"], r["track"]) for r in read_manifest(session.crops)}
    return [key[Path(path).resolve().as_posix()] for path in session.index.paths]


def test_more_like_this_queries_with_the_tracks_mean_embedding(session):
    hit = session.search(QUERY, 3)[1]
    owner = _track_by_row(session)
    rows = [i for i, key in enumerate(owner) if key == (hit["camera"], hit["track"])]
    assert len(rows) == len(_tracks(session)[(hit["camera"], hit["track"])]) >= 1
    mean = {key: session.index.embeds[key][rows].float().mean(0, keepdim=True) for key in ("global", "local")}
    query = session.track_query(hit)
    assert all(torch.allclose(query[key], mean[key]) for key in mean)
    crop_scores = embedding_scores(mean, session.index.embeds)[
        0
    ]  # the mean of its TAG-PR Eq. 14 scores, per crop
    best: dict[tuple[str, str], float] = {}
    for key, score in zip(owner, crop_scores.tolist(), strict=True):
        best[key] = max(best.get(key, -9.0), score)
    like = session.more_like(hit, 50)
    assert [(h["camera"], h["track"]) for h in like] == sorted(best, key=lambda k: -best[k])
    assert [h["score"] for h in like] == pytest.approx(sorted(best.values(), reverse=True), abs=1e-5)


def test_the_timeline_has_a_row_per_camera_and_a_marker_per_track(session):
    like = session.more_like(session.search(QUERY, 1)[0], 50)
    page = session.timeline_html(like)
    rows = re.findall(r"data-camera='([^']+)'", page)
    assert sorted(rows) == sorted({h["camera"] for h in like})
    assert page.count("class='mark'") == len(like)
    links = re.findall(r"href='([^']+)'", page)
    assert len(links) == len(like) and all(
        re.fullmatch(r"/gradio_api/file=/\S+\.mp4#t=\d+\.\d\d", x) for x in links
    )
    assert all(str(session.folder.resolve()) in x or str(session.folder) in x for x in links)
    threshold = sorted(h["score"] for h in like)[len(like) // 2]
    kept = [h for h in like if h["score"] >= threshold]
    assert session.timeline_html(like, threshold).count("class='mark'") == len(kept) < len(like)


def test_reopening_the_folder_finds_the_gallery_and_ingesting_again_adds_nothing(session):
    again = FollowSession(session.model, session.processor, session.folder)
    assert again.index is not None and len(again.index) == len(session.index)
    assert again.use_synthetic().startswith("Ingested 0 video(s) (3 already in the gallery): 0 new track(s)")
    assert len(again.index) == len(session.index)


def test_an_uploaded_video_is_copied_into_the_folder(session, tmp_path):
    upload = tmp_path / "street cam.mp4"
    shutil.copyfile(session.folder / "synthetic-footage" / "videos" / "ground-01.mp4", upload)
    mine = FollowSession(session.model, session.processor, tmp_path / "mine")
    status = mine.ingest([upload])
    assert (
        status.startswith("Ingested 1 video(s): ")
        and (tmp_path / "mine" / "videos" / "street cam.mp4").is_file()
    )
    assert {r["camera"] for r in read_manifest(mine.crops)} == {
        "street cam"
    }  # no camera file: the file's name


def test_a_temporary_folder_is_made_under_the_parent(tmp_path):
    model, processor = tiny_model()
    follow = FollowSession(model, processor, None, parent=tmp_path)
    assert follow.folder.parent == tmp_path and follow.folder.is_dir() and follow.index is None


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (
            lambda s, tmp: s.search(QUERY),
            "the gallery is empty: ingest a video or use the synthetic footage first",
        ),
        (lambda s, tmp: s.ingest([]), "no video given: upload a video file or use the synthetic footage"),
        (lambda s, tmp: s.ingest([tmp / "gone.mp4"]), "no video file at "),
        (lambda s, tmp: s.ingest([_text_file(tmp)]), "notes.mp4"),
        (lambda s, tmp: s.ingest([_still_video(tmp)]), "no person was found in the footage"),
    ],
)
def test_bad_steps_are_one_line_errors(tmp_path, step, message):
    model, processor = tiny_model()
    follow = FollowSession(model, processor, tmp_path / "gallery")
    with pytest.raises(FollowError) as error:
        step(follow, tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_empty_description_and_a_file_as_folder_are_errors(session, tmp_path):
    with pytest.raises(FollowError, match="type a description of the person first"):
        session.search("   ")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FollowError, match="is a file, not a folder"):
        FollowSession(session.model, session.processor, tmp_path / "file")


def _text_file(tmp):
    path = tmp / "notes.mp4"
    path.write_text("not a video")
    return path


def _still_video(tmp):
    """Two seconds of one unchanging frame: nothing moves, so the motion detector finds no one."""
    import av
    import numpy as np

    path = tmp / "still.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        frame = np.full((96, 128, 3), 90, np.uint8)
        for _ in range(10):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return path


def test_page_handlers_show_one_line_errors(session, tmp_path):
    import app_follow

    state, items, status, like, timeline = app_follow.find(None, QUERY, 4)
    assert status == "Error: the gallery is empty: ingest a video or use the synthetic footage first"
    assert items == [] and timeline == app_follow.NO_TIMELINE
    state = {"session": session, "hits": [], "like": []}
    assert app_follow.pick(state, 4, -1, 0)[2] == "Error: click one of the hits first"
    state, items, status, _, _ = app_follow.find(state, QUERY, 4)
    assert len(items) == len(state["hits"]) == 4 and status.startswith("4 track(s) for")
    assert items[0][1] == hit_caption(state["hits"][0])
    like, timeline, status = app_follow.pick(state, 5, -1, 2)
    assert len(like) == 5 and timeline.count("class='mark'") == 5
    assert status.startswith(
        f"More like #3 ({state['hits'][2]['camera']}, track {state['hits'][2]['track']}): 5"
    )
    state, message = app_follow.ingest(
        None, str(tmp_path / "gone.mp4"), session.model, session.processor, None, str(tmp_path)
    )
    assert message == f"Error: no video file at {tmp_path / 'gone.mp4'}"
