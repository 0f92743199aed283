"""Results per person: crop hits collapse into one hit per track; the per-camera timeline orders sightings and
marks the pauses."""

import pytest

from modeling_tagclip.retrieval.timeline import per_track, timeline


def hit(score, camera="3", track="7", t=100.0, path=None, **extra):
    return {
        "score": score,
        "camera": camera,
        "track": track,
        "timestamp": t,
        "t_start": t - 1,
        "t_end": t + 1,
        "path": path or f"{camera}/{track}_{t}.jpg",
        "offset": t - 90,
        "source": f"cam{camera}.mp4",
        **extra,
    }


def test_one_hit_per_track_keeps_its_best_crop_and_spans_every_matched_crop():
    hits = [hit(0.5, t=100), hit(0.9, t=130), hit(0.7, track="8", t=50), hit(0.6, t=110, camera="4")]
    tracks = per_track(hits)
    assert [(h["camera"], h["track"], h["score"], h["crops"]) for h in tracks] == [
        ("3", "7", 0.9, 2),
        ("3", "8", 0.7, 1),
        ("4", "7", 0.6, 1),
    ]
    best = tracks[0]
    assert (best["t_start"], best["t_end"], best["seek"], best["rank"]) == (99, 131, 40, 1)
    assert best["path"] == "3/7_130.jpg" and [h["rank"] for h in tracks] == [1, 2, 3]
    assert len(per_track(hits, top_k=2)) == 2


def test_crops_without_a_track_stay_separate():
    loose = [
        {"score": s, "path": p, "index": i, "camera": "1", "timestamp": None}
        for i, (s, p) in enumerate([(0.4, "a.png"), (0.8, "b.png")])
    ]
    tracks = per_track(loose)
    assert [h["path"] for h in tracks] == ["b.png", "a.png"] and tracks[0]["t_start"] is None


def test_timeline_orders_cameras_and_sightings_and_marks_gaps():
    hits = [
        hit(0.9, camera="ground-2", t=1000),
        hit(0.8, camera="ground-2", track="9", t=1300),
        hit(0.7, camera="drone-7", t=900),
        hit(0.2, camera="drone-7", track="5", t=2000),
        {"score": 0.95, "path": "x.png", "camera": "1", "timestamp": None},
    ]
    line = timeline(hits, min_score=0.5, gap_seconds=120)
    assert list(line.cameras) == ["drone-7", "ground-2"]  # by first sighting
    assert [(s.t_start, s.t_end) for s in line.cameras["ground-2"]] == [(999, 1001), (1299, 1301)]
    assert line.gaps == {"drone-7": [], "ground-2": [(1001, 1299)]}
    assert line.span == (899, 1301) and [h["path"] for h in line.undated] == ["x.png"]
    assert "drone-7" in line.as_dict()["cameras"] and line.as_dict()["cameras"]["ground-2"]["gaps"] == [
        [1001, 1299]
    ]
    assert timeline(hits, gap_seconds=400).gaps["ground-2"] == []


def test_a_long_sighting_covers_the_pause_between_later_short_ones():
    long = {**hit(0.9, track="1", t=50), "t_start": 0, "t_end": 100}
    line = timeline([long, hit(0.8, track="2", t=11), hit(0.7, track="3", t=91)], gap_seconds=60)
    assert line.gaps["3"] == []


def test_a_bad_gap_is_refused():
    with pytest.raises(ValueError, match="gap must be a number of seconds"):
        timeline([], gap_seconds=float("nan"))


def test_the_html_timeline_has_a_row_per_camera_and_a_linked_marker_per_track():
    from html.parser import HTMLParser

    from modeling_tagclip.retrieval.timeline import timeline_html, video_link

    hits = [
        hit(0.9, camera="ground-2", t=1000),
        hit(0.8, camera="ground-2", track="9", t=1300),
        hit(0.7, camera="drone-7", t=900),
    ]
    page = timeline_html(timeline(hits, gap_seconds=120), lambda h: f"thumb:{h['path']}", video_link)

    class Collect(HTMLParser):
        rows, links, gaps, marks = [], [], 0, []

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "div" and attrs.get("class") == "row":
                self.rows.append(attrs["data-camera"])
            if tag == "a":
                self.links.append(attrs["href"])
            if tag == "span" and attrs.get("class") == "gap":
                self.gaps += 1
            if tag == "span" and attrs.get("class") == "mark":
                self.marks.append(attrs["style"])

    parsed = Collect()
    parsed.feed(page)
    assert parsed.rows == ["drone-7", "ground-2"] and parsed.gaps == 1
    assert parsed.links == [
        "camdrone-7.mp4#t=810.00",
        "camground-2.mp4#t=910.00",
        "camground-2.mp4#t=1210.00",
    ]
    assert parsed.marks == ["left:0.0%", "left:24.876%", "left:99.502%"]  # 899, 999, 1299 over 899..1301
    assert video_link({"source": "rtsp://cam/1", "seek": 3}) is None and video_link({"path": "a.png"}) is None
