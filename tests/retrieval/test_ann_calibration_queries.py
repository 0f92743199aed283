"""Calibrating an ANN index on text queries it was given when built (``calibration_queries.safetensors``), beside
moved gallery rows: recall where the rows alone fall short, the file kept, checked and used again when the
gallery grows, bad queries refused before anything is written; ``build_index`` / ``tagclip index`` give the
model's embeddings of person descriptions by default, of the user's captions with ``--calibration-texts``."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import model_and_gallery

from modeling_tagclip.data.synthetic import person_descriptions
from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import ann as annlib
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build
from modeling_tagclip.retrieval.embedded.index_store import FixedSettingError, GalleryIndexError
from modeling_tagclip.retrieval.encode import encode_texts

faiss = pytest.importorskip("faiss")

SIZE, GLOBAL, WIDTH = 4096, 256, 768  # global 256-d + TSE 512-d: the "ivf" preset's PCA keeps 128 of 768


pytestmark = pytest.mark.usefixtures("faiss_one_thread")


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.fixture(scope="module")
def noisy_text():
    """(gallery, calibration queries, test queries): 2 images per identity in a 24-d subspace, an image and a
    text modality offset, and text queries with 4x the images' isotropic noise (matched cosine ~0.25): their
    top-10 is ranked by close scores, which moved gallery rows do not ask for."""
    g = torch.Generator().manual_seed(0)
    count = SIZE // 2
    basis = torch.linalg.qr(torch.randn(WIDTH, 24, generator=g)).Q
    ids = _unit(torch.randn(count, 24, generator=g) @ basis.T)
    ids = _unit(ids + 0.5 * _unit(torch.randn(count, WIDTH, generator=g)))
    offsets = torch.linalg.qr(torch.randn(WIDTH, 2, generator=g)).Q.T
    gallery = ids.repeat_interleave(2, 0) + 0.6 * torch.randn(SIZE, WIDTH, generator=g) / WIDTH**0.5

    def texts(n: int) -> torch.Tensor:
        picked = ids[torch.randint(0, count, (n,), generator=g)]
        return picked + 4.0 * torch.randn(n, WIDTH, generator=g) / WIDTH**0.5 + offsets[1]

    split = lambda x: {"global": _unit(x[:, :GLOBAL]), "local": _unit(x[:, GLOBAL:])}  # noqa: E731
    return split(gallery + offsets[0]), split(texts(256)), split(texts(300))


def _paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:05d}.jpg" for i in range(start, stop)]


def _recall(index: gi.GalleryIndex, query: dict, gallery: dict) -> float:
    found, exact = index.topk(query, 10)[1], gi.chunked_topk(query, gallery, 10)[1]
    return float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean())


def test_text_queries_calibrate_the_search_where_moved_rows_fall_short(noisy_text, tmp_path):
    """The same gallery, calibrated on moved rows alone and on rows + held-out text queries: only the second
    reaches recall@10 0.95 on other text queries of the same kind, by asking for more probes or candidates;
    its report gives each set's recall, both at the target."""
    gallery, calibration, test = noisy_text
    rows = index_build.index_embeddings(tmp_path / "rows", gallery, _paths(0, SIZE), tmp_path, ann="ivf")
    both = index_build.index_embeddings(
        tmp_path / "both", gallery, _paths(0, SIZE), tmp_path, ann="ivf", calibration_queries=calibration
    )
    assert _recall(rows, test, gallery) < 0.95 <= _recall(both, test, gallery)
    report = both.meta["ann"]["calibration"]
    assert set(report["sets"]) == {"rows", "queries"} and report["sets"]["queries"]["queries"] == 256
    assert min(s["recall_at_10"] for s in report["sets"].values()) >= annlib.CALIBRATION_TARGET
    assert report["queries"] == 512 and set(rows.meta["ann"]["calibration"]["sets"]) == {"rows"}
    cost = lambda p: annlib.search_cost(p["nprobe"], p["k_factor"], SIZE / 64)  # noqa: E731
    assert cost(both.meta["ann"]["params"]) > cost(rows.meta["ann"]["params"])


def test_the_queries_are_kept_checked_and_used_again_when_the_gallery_grows(
    noisy_text, tmp_path, monkeypatch
):
    """The queries are stored (normalised float32) with their checksum in index.json; the calibration after
    the gallery doubles (the quantizer kept) uses them again; a corrupt file is named when the next calibration
    reads it."""
    monkeypatch.setattr(annlib, "RETRAIN_GROWTH", 1000)  # recalibrations only, no retraining
    gallery, calibration, _ = noisy_text
    out, half = tmp_path / "idx", SIZE // 2
    part = lambda a, b: {key: value[a:b] for key, value in gallery.items()}  # noqa: E731
    raw = {key: 3 * value for key, value in calibration.items()}  # unnormalised: stored normalised
    built = index_build.index_embeddings(
        out, part(0, half), _paths(0, half), tmp_path, ann="ivf", calibration_queries=raw
    )
    entry = json.loads((out / "index.json").read_text())["ann_request"]["queries"]
    assert entry["file"] == annlib.QUERIES_FILE and entry["rows"] == 256
    torch.testing.assert_close(annlib.read_calibration_queries(out, entry)["local"], calibration["local"])
    assert built.meta["ann"]["calibrations"] == 1
    grown = index_build.index_embeddings(out, part(half, SIZE), _paths(half, SIZE), tmp_path)
    assert (grown.meta["ann"]["trainings"], grown.meta["ann"]["calibrations"]) == (1, 2)
    assert set(grown.meta["ann"]["calibration"]["sets"]) == {"rows", "queries"}
    (out / annlib.QUERIES_FILE).write_bytes((out / annlib.QUERIES_FILE).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(GalleryIndexError, match="calibration_queries.safetensors is corrupt"):
        index_build.index_embeddings(out, gallery, _paths(SIZE, 2 * SIZE), tmp_path)  # 2x rows: recalibrates


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda q: {"global": q["global"][:, :8], "local": q["local"]},
            "'global' have 8 dims, the gallery 256",
        ),
        (lambda q: {"global": q["global"]}, r"hold \['global'\], the gallery \['global', 'local'\]"),
        (lambda q: {**q, "extra": q["global"]}, r"unknown entries \['extra'\]"),
        (lambda q: {**q, "local": q["local"][:10]}, "same number of rows"),
        (lambda q: {k: v[:0] for k, v in q.items()}, "must hold 1 to 4096 rows, got 0"),
        (lambda q: {k: v.repeat(17, 1) for k, v in q.items()}, "must hold 1 to 4096 rows, got 4352"),
        (
            lambda q: {**q, "global": q["global"].clone().index_fill_(0, torch.tensor([3]), float("nan"))},
            "NaN",
        ),
        (lambda q: {**q, "global": q["global"].long()}, "2-d float tensor"),
        (lambda q: [q["global"]], "must be a dict"),
    ],
)
def test_bad_calibration_queries_are_refused_before_anything_is_written(
    noisy_text, tmp_path, change, message
):
    gallery, calibration, _ = noisy_text
    with pytest.raises((GalleryIndexError, ValueError), match=message):
        index_build.index_embeddings(
            tmp_path / "idx",
            gallery,
            _paths(0, SIZE),
            tmp_path,
            ann="ivf",
            calibration_queries=change(calibration),
        )
    assert not (tmp_path / "idx").exists()


def test_queries_need_an_ann_and_are_fixed_when_the_index_is_built(noisy_text, tmp_path):
    gallery, calibration, _ = noisy_text
    with pytest.raises(GalleryIndexError, match="give ann= too"):
        index_build.index_embeddings(
            tmp_path / "a", gallery, _paths(0, SIZE), tmp_path, calibration_queries=calibration
        )
    index_build.index_embeddings(tmp_path / "b", gallery, _paths(0, SIZE), tmp_path, ann="ivf")
    with pytest.raises(FixedSettingError, match="given when it is built, not on an add"):
        index_build.index_embeddings(
            tmp_path / "b", gallery, _paths(SIZE, 2 * SIZE), tmp_path, calibration_queries=calibration
        )
    assert not (tmp_path / "b" / annlib.QUERIES_FILE).exists()


def test_person_descriptions_are_distinct_and_fixed_per_seed():
    texts = person_descriptions(300)
    assert (
        len(set(texts)) == 300 and texts == person_descriptions(300) and texts != person_descriptions(300, 1)
    )
    assert texts[:5] == person_descriptions(5)  # a prefix: the first people do not depend on the count
    with pytest.raises(ValueError, match="count must be >= 1"):
        person_descriptions(0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    found = model_and_gallery(tmp_path_factory.mktemp("calibration"))
    model, processor = cli.load_model(str(found["model"]))
    return found, model, processor


def _build(tiny, out, **kwargs):
    found, model, processor = tiny
    options = dict(batch_size=4, shard_size=8, progress=False, ann="ivf")
    return index_build.build_index(model, processor, found["images"], out, **{**options, **kwargs})


def _stored(out):
    entry = json.loads((out / "index.json").read_text())["ann_request"].get("queries")
    return annlib.read_calibration_queries(out, entry) if entry else None


def test_build_index_keeps_the_models_embeddings_of_the_calibration_texts(tiny, tmp_path):
    """Default: the model's normalised embeddings of ``CALIBRATION_TEXTS`` person descriptions; a list: those
    captions; ``()``: none (rows alone). An add keeps the file as it is and refuses new texts."""
    _, model, processor = tiny
    _build(tiny, tmp_path / "default")
    stored = _stored(tmp_path / "default")
    expected = encode_texts(model, processor, person_descriptions(index_build.CALIBRATION_TEXTS))
    for key in ("global", "local"):
        torch.testing.assert_close(stored[key], _unit(expected[key].float()))
    _build(
        tiny,
        tmp_path / "mine",
        calibration_texts=(t for t in ["a man in a red coat", "a woman with a black bag"]),
    )
    assert _stored(tmp_path / "mine")["global"].shape[0] == 2
    _build(tiny, tmp_path / "none", calibration_texts=())
    assert _stored(tmp_path / "none") is None and not (tmp_path / "none" / annlib.QUERIES_FILE).exists()
    before = (tmp_path / "mine" / annlib.QUERIES_FILE).read_bytes()
    _build(tiny, tmp_path / "mine", add=True, ann=None)
    assert (tmp_path / "mine" / annlib.QUERIES_FILE).read_bytes() == before
    with pytest.raises(FixedSettingError, match="calibration texts .* given when it is built"):
        _build(tiny, tmp_path / "mine", add=True, ann=None, calibration_texts=["a child"])
    with pytest.raises(ValueError, match="must be a list of captions"):
        _build(tiny, tmp_path / "str", calibration_texts="a man in a red coat")


def test_a_build_killed_after_writing_its_queries_starts_again(tiny, tmp_path):
    """A new ANN index writes its calibration queries before index.json: a folder holding only them (or their
    temporary file), left by a build killed in between, is built into; any other file there is refused."""
    out = tmp_path / "idx"
    out.mkdir()
    (out / annlib.QUERIES_FILE).write_bytes(b"partial")
    (out / f".{annlib.QUERIES_FILE}.123.abcd.tmp").write_bytes(b"partial")
    _build(tiny, out, calibration_texts=["a man in a red coat"])
    assert _stored(out)["global"].shape[0] == 1 and not list(out.glob("*.tmp"))
    other = tmp_path / "other"
    other.mkdir()
    (other / annlib.QUERIES_FILE).write_bytes(b"partial")
    (other / "notes.txt").write_text("mine")
    with pytest.raises(GalleryIndexError, match="non-empty folder that holds no gallery index"):
        _build(tiny, other)
    assert (other / "notes.txt").read_text() == "mine"


def _index(tiny, out, *extra):
    found = tiny[0]
    args = ["index", "--model", str(found["model"]), "--images", str(found["images"]), "--out", str(out)]
    return cli.main([*args, "--batch-size", "4", "--workers", "0", "--quiet", *extra])


def test_tagclip_index_calibration_texts_flag(tiny, tmp_path, capsys):
    captions = tmp_path / "captions.txt"
    captions.write_text("a man in a red coat\n\n  a woman with a black bag  \n", encoding="utf-8")
    assert _index(tiny, tmp_path / "file", "--ann", "ivf", "--calibration-texts", str(captions)) == 0
    assert _stored(tmp_path / "file")["global"].shape[0] == 2
    assert _index(tiny, tmp_path / "none", "--ann", "ivf", "--calibration-texts", "none") == 0
    assert _stored(tmp_path / "none") is None
    capsys.readouterr()
    assert _index(tiny, tmp_path / "file", "--add", "--calibration-texts", str(captions)) == 2
    assert "given when it is built, not on an add; run --add without" in capsys.readouterr().err
    assert _stored(tmp_path / "file")["global"].shape[0] == 2
    (tmp_path / "latin1.txt").write_bytes("un homme \xe0 la veste rouge\n".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("\n \n")
    for name, message in (
        ("latin1.txt", "is not UTF-8 text"),
        ("empty.txt", r"holds no caption \(use 'none' for none\)"),
        ("absent.txt", "is not a file"),
    ):
        with pytest.raises(SystemExit, match=message):
            _index(
                tiny, tmp_path / f"out-{name}", "--ann", "ivf", "--calibration-texts", str(tmp_path / name)
            )
        assert not (tmp_path / f"out-{name}").exists()
    with pytest.raises(SystemExit, match="--calibration-texts needs --ann"):
        _index(tiny, tmp_path / "exact", "--calibration-texts", str(captions))
    assert not (tmp_path / "exact").exists()
