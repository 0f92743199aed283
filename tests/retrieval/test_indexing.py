"""``index_gallery(model, processor, IndexRequest(...))``: one request object for either backend, refused in one
line when it mixes them; the embedded index it builds equals ``build_index``'s, and a second run adds nothing."""

from __future__ import annotations

import pytest
from fixtures import synthetic_gallery, tiny_model

from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex
from modeling_tagclip.retrieval.embedded.index_build import build_index
from modeling_tagclip.retrieval.encode import encode_texts
from modeling_tagclip.retrieval.indexing import IndexRequest, index_gallery


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "names one gallery: an index folder"),
        ({"out": "a", "milvus_uri": "g.db", "collection": "c"}, "names one gallery"),
        ({"milvus_uri": "g.db"}, "g.db is a Milvus URI: name the collection"),
        (
            {"milvus_uri": "g.db", "collection": "c", "ann": "ivf", "overwrite": True},
            "overwrite, ann are for the",
        ),
    ],
)
def test_a_request_that_mixes_the_backends_is_one_error(fields, message):
    with pytest.raises(ValueError, match=message):
        IndexRequest(images="crops", **fields)


def test_the_one_entry_builds_what_build_index_builds_and_a_rerun_adds_nothing(tmp_path):
    model, processor = tiny_model()
    images = synthetic_gallery(tmp_path / "data") / "images"
    metadata = {"test/00004/00004_c0_00.png": {"camera": "7", "track": "t1", "frame": 3}}
    request = IndexRequest(
        images=images, out=tmp_path / "one", batch_size=4, progress=False, metadata=metadata
    )
    assert index_gallery(model, processor, request) == 20
    direct = build_index(
        model, processor, images, tmp_path / "two", batch_size=4, progress=False, metadata=metadata
    )
    query = encode_texts(model, processor, ["a man in a red coat"])
    one = GalleryIndex.load(tmp_path / "one", cache=False).search(query, 20)
    two = direct.search(query, 20)
    assert [(h["path"], h["score"], h["track"]) for h in one[0]] == [
        (h["path"], h["score"], h["track"]) for h in two[0]
    ]
    assert sum(h["track"] == "t1" and h["frame"] == 3 for h in one[0]) == 1
    again = IndexRequest(images=images, out=tmp_path / "one", batch_size=4, progress=False, add=True)
    assert index_gallery(model, processor, again) == 0


@pytest.mark.slow
def test_the_one_entry_fills_a_milvus_collection_with_the_same_ranking(tmp_path):
    pytest.importorskip("pymilvus")
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    model, processor = tiny_model()
    images = synthetic_gallery(tmp_path / "data") / "images"
    uri = str(tmp_path / "g.db")
    request = IndexRequest(images=images, milvus_uri=uri, collection="g", batch_size=4, progress=False)
    assert index_gallery(model, processor, request) == 20
    assert index_gallery(model, processor, request) == 0  # resumed: everything is present
    direct = build_index(model, processor, images, tmp_path / "idx", batch_size=4, progress=False)
    query = encode_texts(model, processor, ["a man in a red coat"])
    with MilvusGallery(uri, "g") as milvus:
        assert [h["path"] for h in milvus.search(query, 20)[0]] == [
            h["path"] for h in direct.search(query, 20)[0]
        ]
