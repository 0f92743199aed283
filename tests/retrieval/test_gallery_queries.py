"""Queries taken from the gallery itself: hit ids, a crop's stored embeddings by id, a track's crops, and
``person_search`` with the mean and max set rules against brute-force TAG-PR Eq. 14 answers (in-memory index)."""

import pytest
import torch

from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
from modeling_tagclip.retrieval.encode import eq14_similarity
from modeling_tagclip.retrieval.gallery_types import GalleryIndexError, crop_id, parse_crop_id, path_id
from modeling_tagclip.retrieval.queries import example_embeddings, fuse, parse_track, person_search


def unit(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(
        torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1
    )


N = 24
PATHS = [f"cam{(i // 3) % 2}/t{i // 3}_{i % 3}.png" for i in range(N)]
EMBEDS = {"global": unit(N, 16, 0), "local": unit(N, 32, 1)}
RECORDS = [{"camera": f"cam{(i // 3) % 2}", "track": f"t{i // 3}"} for i in range(N)]


@pytest.fixture
def gallery() -> GalleryIndex:
    """An in-memory index of tracks of 3 crops on 2 cameras (t0-t6) and one track without a camera (t9)."""
    index = GalleryIndex({key: value[:0] for key, value in EMBEDS.items()}, [])
    records = [dict(r) for r in RECORDS]
    records[21], records[22], records[23] = {"track": "t9"}, {"track": "t9"}, {"track": "t9"}
    index.add(EMBEDS, PATHS, records)
    return index


def eq14(query, rows):
    return eq14_similarity(query["global"], rows["global"], query.get("local"), rows.get("local"))


def test_a_hit_id_is_the_16_hex_digits_of_the_path_key():
    assert crop_id("cam0/t0_0.png") == f"{path_id('cam0/t0_0.png'):016x}" and len(crop_id("x")) == 16
    assert parse_crop_id(crop_id("cam0/t0_0.png")) == path_id("cam0/t0_0.png")
    for bad in ("12", "zz" * 8, 5, None, crop_id("x") + "0"):
        with pytest.raises(GalleryIndexError, match="is not a hit id: a hit's 'id' is 16 hex digits"):
            parse_crop_id(bad)


def test_hits_carry_their_crop_id(gallery):
    hits = gallery.search({k: v[5:6] for k, v in EMBEDS.items()}, top_k=3)[0]
    assert hits[0]["index"] == 5 and hits[0]["id"] == crop_id(PATHS[5])
    assert [h["id"] for h in hits] == [crop_id(PATHS[h["index"]]) for h in hits]


def test_crop_embeddings_are_the_stored_rows_in_the_order_asked(gallery):
    got = gallery.crop_embeddings([crop_id(PATHS[7]), crop_id(PATHS[2]), crop_id(PATHS[7])])
    assert set(got) == {"global", "local"}
    for key in got:
        assert torch.equal(got[key], EMBEDS[key][[7, 2, 7]])


def test_an_unknown_or_removed_hit_id_is_refused(gallery):
    with pytest.raises(
        GalleryIndexError, match=f"no crop with hit id {crop_id('elsewhere.png')} in the gallery"
    ):
        gallery.crop_embeddings([crop_id("elsewhere.png")])
    gallery.remove(ids=[4])
    with pytest.raises(GalleryIndexError, match=f"no crop with hit id {crop_id(PATHS[4])}"):
        gallery.crop_embeddings([crop_id(PATHS[3]), crop_id(PATHS[4])])


def test_track_embeddings_are_the_tracks_searchable_crops_in_path_order(gallery):
    got = gallery.track_embeddings("cam1", "t3")
    assert all(torch.equal(got[key], EMBEDS[key][9:12]) for key in ("global", "local"))
    assert torch.equal(gallery.track_embeddings(None, "t9")["global"], EMBEDS["global"][21:24])
    gallery.remove(ids=[10])
    assert torch.equal(gallery.track_embeddings("cam1", "t3")["global"], EMBEDS["global"][[9, 11]])
    for camera, track in (("cam0", "t3"), ("cam1", "t99"), ("cam0", "t9")):  # t3 is on cam1, t9 has no camera
        with pytest.raises(GalleryIndexError, match=f"no track {camera}:{track} in the gallery"):
            gallery.track_embeddings(camera, track)


def test_parse_track_splits_at_the_last_colon():
    assert parse_track("ground-01:3") == ("ground-01", "3")
    assert parse_track("rtsp:cam:12") == ("rtsp:cam", "12")
    assert parse_track(":7") == (None, "7")
    for bad in ("ground-01", "cam:", "cam: "):
        with pytest.raises(ValueError, match="a track is CAMERA:TRACK"):
            parse_track(bad)


def test_example_embeddings_join_hit_ids_then_tracks(gallery):
    got = example_embeddings(gallery, [crop_id(PATHS[0])], ["cam1:t1", "cam0:t2"])
    assert torch.equal(got["global"], EMBEDS["global"][[0, 3, 4, 5, 6, 7, 8]])
    assert example_embeddings(gallery) is None


def scores_of(hits: list[dict]) -> dict[int, float]:
    return {h["index"]: h["score"] for h in hits}


@pytest.mark.parametrize("text_weight", [None, 0.3])
def test_the_mean_rule_ranks_by_the_mean_of_the_crops_scores(gallery, text_weight):
    crops = gallery.track_embeddings("cam1", "t5")
    text = {"global": unit(1, 16, 7), "local": unit(1, 32, 8)} if text_weight is not None else None
    hits = person_search(gallery, text, crops, top_k=N, text_weight=text_weight or 0.5)[0]
    expected = eq14(crops, EMBEDS).mean(dim=0)
    if text is not None:
        expected = text_weight * eq14(text, EMBEDS)[0] + (1 - text_weight) * expected
    assert [h["index"] for h in hits] == expected.argsort(descending=True).tolist()
    assert [h["score"] for h in hits] == pytest.approx(
        expected.sort(descending=True).values.tolist(), abs=1e-5
    )


@pytest.mark.parametrize("text_weight", [None, 0.3])
def test_the_max_rule_ranks_by_each_crops_best_score(gallery, text_weight):
    crops = {"global": unit(3, 16, 13), "local": unit(3, 32, 14)}  # crops not in the gallery: no tied scores
    text = {"global": unit(1, 16, 9), "local": unit(1, 32, 10)} if text_weight is not None else None
    hits = person_search(gallery, text, crops, top_k=5, text_weight=text_weight or 0.5, set_rule="max")[0]
    per_crop = eq14(crops, EMBEDS)
    if text is not None:
        per_crop = text_weight * eq14(text, EMBEDS) + (1 - text_weight) * per_crop
    best = per_crop.max(dim=0).values
    assert [h["index"] for h in hits] == best.argsort(descending=True)[:5].tolist()
    assert [h["rank"] for h in hits] == [1, 2, 3, 4, 5]
    assert [h["score"] for h in hits] == pytest.approx(
        best.sort(descending=True).values[:5].tolist(), abs=1e-5
    )


def test_several_descriptions_give_one_list_each(gallery):
    texts = {"global": unit(2, 16, 11), "local": unit(2, 32, 12)}
    crops = gallery.crop_embeddings([crop_id(PATHS[1])])
    for rule in ("mean", "max"):
        hits = person_search(gallery, texts, crops, top_k=4, text_weight=0.6, set_rule=rule)
        assert len(hits) == 2
        for i, found in enumerate(hits):
            one = {k: v[i : i + 1] for k, v in texts.items()}
            expected = eq14(fuse(one, crops, 0.6), EMBEDS)[0]
            assert [h["index"] for h in found] == expected.argsort(descending=True)[:4].tolist()


def test_bad_person_queries_are_refused(gallery):
    crops = gallery.crop_embeddings([crop_id(PATHS[1])])
    with pytest.raises(ValueError, match="set rule must be one of mean, max, got 'median'"):
        person_search(gallery, None, crops, 3, set_rule="median")
    with pytest.raises(ValueError, match="needs a description, crops of the person, a hit id or a track"):
        person_search(gallery, None, None, 3)
