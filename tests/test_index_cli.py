"""Gallery index + ``tagclip`` CLI: index → search ranks as direct model scoring, resume, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from tagclip_tiny import save_tiny_model, synthetic_gallery

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval import gallery_index as gi

QUERIES = [
    "a man in a blue hooded sweatshirt with a brown bag",
    "a woman with long black hair in a red skirt",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    model_dir = save_tiny_model(root / "model")
    other_dir = save_tiny_model(root / "other", seed=1)
    images = synthetic_gallery(root / "data") / "images"
    model, processor = cli.load_model(str(model_dir))
    return {
        "root": root,
        "model_dir": model_dir,
        "other_dir": other_dir,
        "images": images,
        "model": model,
        "processor": processor,
    }


def _index(setup, out, *extra):
    args = ["index", "--model", str(setup["model_dir"]), "--images", str(setup["images"]), "--out", str(out)]
    return cli.main([*args, "--batch-size", "2", "--shard-size", "3", "--quiet", *extra])


def _direct_ranking(setup, k: int):
    """Top-k gallery paths and scores from the model's own Eq. 14 similarity over every image at once."""
    model, processor = setup["model"], setup["processor"]
    paths = gi.list_images(setup["images"])
    with torch.inference_mode():
        image = model.get_image_features(
            pixel_values=processor(images=[Image.open(p) for p in paths])["pixel_values"]
        )
        text = model.get_text_features(input_ids=processor(text=QUERIES)["input_ids"])
        scores = model.similarity(text, image)
    top = scores.topk(k, dim=1)
    return [[str(paths[i]) for i in row] for row in top.indices.tolist()], top.values


@pytest.fixture(scope="module")
def built(setup):
    out = setup["root"] / "idx"
    assert _index(setup, out, "--no-faiss") == 0
    return out


def test_index_then_search_matches_direct_scoring(setup, built, capsys):
    capsys.readouterr()
    assert cli.main(["search", "--index", str(built), "-k", "5", "--json", *QUERIES]) == 0
    results = json.loads(capsys.readouterr().out)
    paths, scores = _direct_ranking(setup, 5)
    assert [[h["path"] for h in r["hits"]] for r in results] == paths
    torch.testing.assert_close(
        torch.tensor([[h["score"] for h in r["hits"]] for r in results]), scores, atol=1e-5, rtol=0
    )
    assert all(
        h["view"] in ("aerial", "ground") and 0.5 <= h["view_score"] <= 1 for r in results for h in r["hits"]
    )
    meta = json.loads((built / "index.json").read_text())
    assert meta["complete"] and meta["num_images"] == len(gi.list_images(setup["images"]))
    assert not (built / "shards").exists() and not meta["faiss"]


def test_search_table_html_and_png(built, tmp_path, capsys):
    html, png = tmp_path / "hits.html", tmp_path / "hits.png"
    assert (
        cli.main(
            ["search", "--index", str(built), "-k", "3", "--html", str(html), "--png", str(png), QUERIES[0]]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rank" in out and "score" in out and QUERIES[0] in out
    page = html.read_text()
    assert QUERIES[0] in page and page.count("data:image/png;base64,") == 3
    with Image.open(png) as sheet:
        assert sheet.width > 3 * 96 and sheet.height >= 192


def test_chunked_topk_equals_full_ranking():
    generator = torch.Generator().manual_seed(0)
    gallery = {
        k: torch.nn.functional.normalize(torch.randn(50, d, generator=generator), dim=-1)
        for k, d in (("global", 8), ("local", 6))
    }
    query = {
        k: torch.nn.functional.normalize(torch.randn(5, d, generator=generator), dim=-1)
        for k, d in (("global", 8), ("local", 6))
    }
    full = 0.5 * (query["global"] @ gallery["global"].t() + query["local"] @ gallery["local"].t())
    expected = full.topk(7, dim=1)
    for chunk, query_chunk in ((7, 2), (50, 5), (1, 1)):
        scores, indices = gi.chunked_topk(query, gallery, 7, chunk_size=chunk, query_chunk=query_chunk)
        assert torch.equal(indices, expected.indices)
        torch.testing.assert_close(scores, expected.values)
    assert gi.chunked_topk(query, gallery, 80)[1].shape == (5, 50)  # k larger than the gallery


@pytest.mark.skipif(gi.faiss is None, reason="faiss is optional and not installed")
def test_faiss_index_ranks_like_torch(setup, tmp_path):
    index = gi.build_index(
        setup["model"], setup["processor"], setup["images"], tmp_path / "f", progress=False
    )
    assert index.meta["faiss"] and index.faiss_index is not None
    query = gi.encode_texts(setup["model"], setup["processor"], QUERIES)
    scores, indices = index.topk(query, 5)
    exact = gi.chunked_topk(query, index.embeds, 5)
    assert torch.equal(indices, exact[1])
    torch.testing.assert_close(scores, exact[0], atol=1e-5, rtol=0)


def test_interrupted_index_resumes_where_it_stopped(setup, built, tmp_path, monkeypatch, capsys):
    out = tmp_path / "resumable"
    model, processor = setup["model"], setup["processor"]

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gi.build_index(
            model,
            processor,
            setup["images"],
            out,
            batch_size=2,
            shard_size=3,
            progress=False,
            on_shard=interrupt,
            use_faiss=False,
        )
    meta = json.loads((out / "index.json").read_text())
    assert (meta["complete"], meta["num_done"]) == (False, 3)
    with pytest.raises(gi.GalleryIndexError, match="incomplete"):
        gi.GalleryIndex.load(out)
    assert cli.main(["search", "--index", str(out), "x"]) == 2
    assert "incomplete" in capsys.readouterr().err

    encoded = []
    real = gi.encode_images
    monkeypatch.setattr(
        gi, "encode_images", lambda m, p, imgs, *a, **k: encoded.extend(imgs) or real(m, p, imgs, *a, **k)
    )
    resumed = gi.build_index(
        model, processor, setup["images"], out, batch_size=2, shard_size=3, progress=False, use_faiss=False
    )
    assert len(encoded) == meta["num_images"] - 3
    full = gi.GalleryIndex.load(built)
    assert resumed.paths == full.paths
    for key in ("global", "local", "view_probs"):
        torch.testing.assert_close(resumed.embeds[key], full.embeds[key], atol=1e-6, rtol=0)
    encoded.clear()
    gi.build_index(model, processor, setup["images"], out, progress=False)  # complete: nothing to do
    assert encoded == []


def test_missing_index_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["search", "--index", str(tmp_path / "nowhere"), "a man"]) == 2
    err = capsys.readouterr().err
    assert "no gallery index" in err and "tagclip index" in err


def test_corrupt_or_foreign_index_is_a_clear_error(tmp_path):
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(gi.GalleryIndexError, match="corrupt"):
        gi.GalleryIndex.load(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(gi.GalleryIndexError, match="not a tagclip-gallery-index"):
        gi.GalleryIndex.load(tmp_path)


def test_index_of_another_model_is_a_clear_error(setup, built, capsys):
    assert cli.main(["search", "--index", str(built), "--model", str(setup["other_dir"]), "a man"]) == 2
    assert "different model" in capsys.readouterr().err
    args = [
        "index",
        "--model",
        str(setup["other_dir"]),
        "--images",
        str(setup["images"]),
        "--out",
        str(built),
    ]
    assert cli.main([*args, "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_fingerprint_is_stable_across_save_and_load(setup):
    from modeling_tagclip import TagClipModel

    reloaded = TagClipModel.from_pretrained(setup["model_dir"])
    assert gi.model_fingerprint(reloaded) == gi.model_fingerprint(setup["model"])
    other = TagClipModel.from_pretrained(setup["other_dir"])
    assert gi.model_fingerprint(other) != gi.model_fingerprint(setup["model"])


def test_missing_images_folder_is_a_clear_error(setup, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gi.list_images(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images"):
        gi.list_images(tmp_path / "empty")


def test_eval_and_push_delegate_to_the_training_modules(capsys):
    for command, option in (("eval", "--data"), ("push", "--repo-id")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0
        assert option in capsys.readouterr().out


@pytest.mark.skipif(gi.faiss is None, reason="faiss is optional and not installed")
def test_index_ann_flag(setup, tmp_path, capsys):
    """`--ann` refuses a bad index string before encoding; a gallery this small keeps the exact index."""
    assert _index(setup, tmp_path / "bad", "--ann", "IVFbogus") == 2
    assert "unknown ANN index 'IVFbogus'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert _index(setup, tmp_path / "small", "--ann", "ivf", "--ann-param", "nprobe=8") == 0
    assert "search: faiss (exact)" in capsys.readouterr().out
    assert json.loads((tmp_path / "small" / "index.json").read_text())["ann"] is None
