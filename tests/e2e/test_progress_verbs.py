"""Progress of ``tagclip eval`` (encoding the gallery and the captions, scoring), ``tagclip eval --task reid``
and ``tagclip index``: in a log (not a terminal), plain lines that name the phase and count its work, and no
raw log records."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import model_and_gallery, tiny_visa_config, write_png

from modeling_tagclip.cli import main as tagclip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return model_and_gallery(tmp_path_factory.mktemp("progress"))


def phase_lines(err: str) -> list[str]:
    """The lines of stderr, each checked to be a user-facing line (no log record, dict repr or carriage return)."""
    assert "INFO " not in err and "{'" not in err and "\r" not in err, err
    return err.splitlines()


def test_eval_shows_encoding_and_scoring_with_their_counts(folders, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert tagclip(
        ["eval", "--model", str(folders["model"]), "--data", str(folders["data"]), "--output", str(out)]
    ) in (0, None)
    result = json.loads(out.read_text())
    images, captions = result["num_gallery"], result["num_queries"]
    assert images > 0 and captions > images  # more than one caption per image: the counts are told apart
    lines = phase_lines(capsys.readouterr().err)
    for expected in (
        f"encoding images: {images} images to do",
        f"encoding images: {images}/{images} images in ",
        f"encoding captions: {captions} captions to do",
        f"encoding captions: {captions}/{captions} captions in ",
        f"scoring: {captions} query captions against {images} gallery images",
        f"scoring: {captions}/{captions} captions in ",
    ):
        assert any(line.startswith(expected) for line in lines), (expected, lines)
    order = [
        next(i for i, line in enumerate(lines) if line.startswith(p))
        for p in ("encoding images", "encoding captions", "scoring")
    ]
    assert order == sorted(order)


def test_index_shows_the_images_indexed(folders, tmp_path, capsys):
    from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex

    out = tmp_path / "g.idx"
    assert tagclip(
        ["index", "--model", str(folders["model"]), "--images", str(folders["images"]), "--out", str(out)]
    ) in (0, None)
    count = len(GalleryIndex.load(out))
    lines = phase_lines(capsys.readouterr().err)
    assert f"indexing: {count} images to do" in lines
    assert any(line.startswith(f"indexing: {count}/{count} images in ") for line in lines), lines


def test_reid_encoding_shows_query_and_gallery_counts(tmp_path, capsys):
    from modeling_tagclip import ViSAModel
    from modeling_tagclip.evaluation.reid import encode

    paths = []
    for i in range(5):
        write_png(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    model = ViSAModel(tiny_visa_config()).eval()
    table = {"image_path": paths, "view": [0, 1, 0, 1, 1]}
    silent = encode(model, table, batch_size=2)
    assert capsys.readouterr().err == ""
    shown = encode(model, table, batch_size=2, progress=True, name="gallery")
    torch.testing.assert_close(shown, silent, atol=0, rtol=0)
    lines = phase_lines(capsys.readouterr().err)
    assert lines[0] == "encoding gallery images: 5 images to do"
    assert lines[-1].startswith("encoding gallery images: 5/5 images in "), lines
