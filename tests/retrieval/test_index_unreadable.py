"""A gallery folder with files that cannot be decoded: the build finishes, those rows are flagged removed and
never returned, the warning names them; hidden files (``._x.jpg``) are not listed at all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fixtures import save_tiny_model, synthetic_gallery

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    root = tmp_path_factory.mktemp("unreadable")
    model, processor = cli.load_model(str(save_tiny_model(root / "model")))
    images = root / "images"
    shutil.copytree(synthetic_gallery(root / "data") / "images", images)
    good = gi.list_images(images)
    (images / "garbage.jpg").write_bytes(b"x")
    jpeg = good[0].read_bytes()
    (images / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 3])
    (images / "._resource_fork.jpg").write_bytes(b"\x00\x05\x16\x07")
    (images / ".thumbs").mkdir()
    shutil.copy(good[0], images / ".thumbs" / "copy.jpg")
    return {"model": model, "processor": processor, "images": images, "good": good}


def test_hidden_files_are_not_listed(gallery):
    names = [p.relative_to(gallery["images"]).as_posix() for p in gi.list_images(gallery["images"])]
    assert not any(name.startswith(".") or "/." in name for name in names)
    assert {"garbage.jpg", "truncated.jpg"} <= set(names)


def test_unreadable_images_are_skipped_not_fatal_and_never_returned(gallery, tmp_path):
    out = tmp_path / "idx"
    with pytest.warns(UserWarning, match=r"2 unreadable image\(s\) skipped") as caught:  # the CLI prints it
        index = index_build.build_index(
            gallery["model"],
            gallery["processor"],
            gallery["images"],
            out,
            batch_size=2,
            shard_size=3,
            progress=False,
        )
    err = "\n".join(str(warning.message) for warning in caught)
    assert "2 unreadable image(s) skipped" in err and "garbage.jpg: cannot decode image" in err
    assert "truncated.jpg" in err
    assert len(index) == len(gallery["good"]) + 2
    bad = {i for i, path in enumerate(index.paths) if Path(path).name in ("garbage.jpg", "truncated.jpg")}
    assert len(bad) == 2 and index.mask() is not None and not index.mask()[list(bad)].any()
    query = {key: value[:1].clone() for key, value in index.embeds.items() if key in ("global", "local")}
    for row in bad:  # even a query equal to an unreadable row's embedding never gets it back
        query = {key: index.embeds[key][row : row + 1].float() for key in query}
        _, rows = index.topk(query, len(index))
        assert bad.isdisjoint(rows[0].tolist()) and rows.shape[1] == len(gallery["good"])


def test_a_build_interrupted_after_an_unreadable_shard_resumes(gallery, tmp_path, monkeypatch):
    out = tmp_path / "idx"
    calls = {"n": 0}
    real = index_build.encode_batch

    def crash_on_third_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(index_build, "encode_batch", crash_on_third_batch)
    kwargs = dict(batch_size=2, shard_size=3, progress=False)
    with pytest.raises(KeyboardInterrupt):
        index_build.build_index(gallery["model"], gallery["processor"], gallery["images"], out, **kwargs)
    monkeypatch.setattr(index_build, "encode_batch", real)
    index = index_build.build_index(gallery["model"], gallery["processor"], gallery["images"], out, **kwargs)
    removed = sorted(int(i) for (i,) in index.db.execute("SELECT id FROM crops WHERE removed = 1"))
    assert [Path(index.paths[i]).name for i in removed] == ["garbage.jpg", "truncated.jpg"]
    assert torch.isfinite(index.embeds["global"]).all()


def test_a_folder_with_only_hidden_images_says_so(gallery, tmp_path):
    (tmp_path / ".cache").mkdir()
    shutil.copy(gallery["good"][0], tmp_path / ".cache" / "a.jpg")
    with pytest.raises(FileNotFoundError, match="hidden files and folders are skipped"):
        gi.list_images(tmp_path)


@pytest.mark.slow
def test_a_milvus_build_skips_unreadable_images_as_removed_rows_and_never_returns_them(gallery, tmp_path):
    pytest.importorskip("pymilvus")
    import warnings

    from PIL import Image

    from modeling_tagclip.retrieval.encode import encode_images
    from modeling_tagclip.retrieval.milvus import MilvusGallery, index_into_milvus

    model, processor, uri = gallery["model"], gallery["processor"], str(tmp_path / "g.db")
    with pytest.warns(UserWarning, match=r"2 unreadable image\(s\) skipped") as caught:
        added = index_into_milvus(model, processor, gallery["images"], uri, "g", batch_size=2, shard_size=50)
    err = "\n".join(str(warning.message) for warning in caught)
    assert "garbage.jpg: cannot decode image" in err and "truncated.jpg: cannot decode image" in err
    assert added == len(gallery["good"]) + 2
    with warnings.catch_warnings():  # resumed: both are present, nothing is decoded or warned again
        warnings.simplefilter("error")
        assert index_into_milvus(model, processor, gallery["images"], uri, "g", batch_size=2) == 0
    black = encode_images(model, processor, [Image.new("RGB", (1, 1))])  # what the unreadable rows hold
    with MilvusGallery(uri, "g") as store:
        assert len(store) == len(gallery["good"]) + 2
        rows = store.client.query("g", filter="removed == true", output_fields=["path", "vector"])
        assert sorted(row["path"] for row in rows) == ["garbage.jpg", "truncated.jpg"]
        stored = torch.tensor(rows[0]["vector"])
        hits = store.search(black, top_k=len(gallery["good"]) + 2)[0]
    torch.testing.assert_close(stored, gi.ann_vectors(black, "combined")[0], atol=1e-5, rtol=0)
    assert len(hits) == len(gallery["good"])  # the query equal to their vector never gets them back
    assert not {"garbage.jpg", "truncated.jpg"} & {Path(hit["path"]).name for hit in hits}
