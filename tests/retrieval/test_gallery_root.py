"""No reader opens a crop outside the gallery root: a tampered ``index.json`` (``image_root`` "/"), a crop
path leaving the root or a link out of it is one error line naming the index or the row, through every entry
point (search table, --html, --png, serve, the endpoint handler, the demo, Milvus); nothing is written or
opened."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from fixtures import REPO_ROOT, save_tiny_model, synthetic_gallery
from PIL import Image

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.gallery_types import GalleryIndexError, crop_file, crop_path

ROOT_REFUSED = r"image root '/' is a filesystem root; refusing to read crops from it"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    model_dir = save_tiny_model(root / "model")
    images = synthetic_gallery(root / "data") / "images"
    args = ["index", "--model", str(model_dir), "--images", str(images), "--out", str(root / "idx")]
    assert cli.main([*args, "--batch-size", "4", "--workers", "0", "--quiet"]) == 0
    return {"model": model_dir, "images": images, "out": root / "idx"}


@pytest.fixture
def opened(monkeypatch):
    """Every file PIL opens during the test."""
    files, real = [], Image.open
    monkeypatch.setattr(Image, "open", lambda fp, *a, **k: files.append(str(fp)) or real(fp, *a, **k))
    return files


def _tampered(built, tmp_path):
    """A copy of the index whose header says its crops lie under "/"."""
    out = tmp_path / "idx"
    shutil.copytree(built["out"], out)
    header = json.loads((out / "index.json").read_text())
    header["image_root"] = "/"
    (out / "index.json").write_text(json.dumps(header))
    return out


def _search(built, out, *extra):
    return cli.main(
        ["search", "--index", str(out), "--model", str(built["model"]), "-k", "50", *extra, "a person"]
    )


def _one_error_line(capsys, pattern: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tagclip ")]
    assert len(err) == 1 and err[0].startswith("tagclip search: error: "), err
    assert pytest.importorskip("re").search(pattern, err[0]), err[0]
    return err[0]


def test_crop_path_and_crop_file_are_the_one_check(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(b"")
    (tmp_path / "a" / "out.png").symlink_to(tmp_path / "secret.png")
    assert crop_path(tmp_path / "a", "x.png", "row 0") == tmp_path / "a" / "x.png"
    assert crop_file(tmp_path / "a", "x.png", "row 0") == (tmp_path / "a" / "x.png").resolve()
    with pytest.raises(
        GalleryIndexError, match=r"^row 3: crop path '\.\./\.\./x' refused: it leaves the image root"
    ):
        crop_path(tmp_path / "a", "../../x", "row 3")
    with pytest.raises(GalleryIndexError, match=r"^row 4: image root '/' is a filesystem root"):
        crop_path("/", "etc/shadow", "row 4")
    with pytest.raises(
        GalleryIndexError, match=r"^row 5: crop path 'out\.png' refused: it resolves to .*secret"
    ):
        crop_file(tmp_path / "a", "out.png", "row 5")


@pytest.mark.parametrize("report", ["--html", "--png", None])
def test_search_refuses_an_image_root_of_slash_and_writes_nothing(built, tmp_path, capsys, opened, report):
    out = _tampered(built, tmp_path)
    target = tmp_path / "hits.out"
    assert _search(built, out, *([report, str(target)] if report else [])) == 2
    _one_error_line(capsys, rf"gallery index {out}: {ROOT_REFUSED}")
    assert not target.exists() and opened == []


@pytest.mark.parametrize("report", ["--html", "--png"])
def test_a_crop_linked_out_of_the_root_is_refused_naming_its_row(built, tmp_path, capsys, opened, report):
    out, images = tmp_path / "idx", tmp_path / "images"
    shutil.copytree(built["out"], out)
    shutil.copytree(built["images"], images)
    secret = tmp_path / "secret.png"
    Image.new("RGB", (4, 4), "red").save(secret)
    linked = gi.list_images(images)[0]
    linked.unlink()
    linked.symlink_to(secret)
    target = tmp_path / "hits.out"
    args = ["--image-root", str(images), report, str(target)]
    assert _search(built, out, *args) == 2
    rel = linked.relative_to(images).as_posix()
    _one_error_line(capsys, rf"error: row 0: crop path '{rel}' refused: it resolves to {secret}, outside")
    assert not target.exists() and str(secret) not in opened


def test_serve_and_the_handler_refuse_the_tampered_index(built, tmp_path, capsys):
    out = _tampered(built, tmp_path)
    assert cli.main(["serve", "--index", str(out), "--model", str(built["model"])]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tagclip ")]
    assert len(err) == 1 and ROOT_REFUSED in err[0]
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from handler import EndpointHandler
    finally:
        sys.path.remove(str(REPO_ROOT))
    with pytest.raises(GalleryIndexError, match=ROOT_REFUSED):
        EndpointHandler(str(built["model"]), gallery=str(out))


def test_the_demo_refuses_the_tampered_index(built, tmp_path):
    sys.path.insert(0, str(REPO_ROOT))
    try:
        import app
    finally:
        sys.path.remove(str(REPO_ROOT))
    with pytest.raises(GalleryIndexError, match=ROOT_REFUSED):
        app.load_searcher(str(built["model"]), None, index=str(_tampered(built, tmp_path)))


@pytest.mark.slow
def test_milvus_refuses_a_tampered_root_and_a_row_leaving_it(built, tmp_path):
    pytest.importorskip("pymilvus")
    from modeling_tagclip.retrieval.encode import encode_texts
    from modeling_tagclip.retrieval.milvus import META_KEY, MilvusGallery, index_into_milvus

    model, processor = cli.load_model(str(built["model"]))
    uri = str(tmp_path / "g.db")
    index_into_milvus(model, processor, built["images"], uri, "g")
    query = encode_texts(model, processor, ["a person"])
    with MilvusGallery(uri, "g") as gallery:
        row = gallery.client.query("g", filter="", output_fields=["*"], limit=1)[0]
        gallery.client.upsert("g", [{**row, "path": "../../etc/passwd"}])
        with pytest.raises(
            GalleryIndexError, match=rf"row {row['id']}: crop path '../../etc/passwd' refused"
        ):
            gallery.search(query, 50)
        meta = json.loads(gallery.client.describe_collection("g")["properties"][META_KEY])
        gallery.client.alter_collection_properties("g", {META_KEY: json.dumps({**meta, "image_root": "/"})})
    with pytest.raises(GalleryIndexError, match=rf"Milvus collection 'g' at {uri}: {ROOT_REFUSED}"):
        MilvusGallery(uri, "g")


def test_a_tampered_tags_value_in_the_database_is_one_line_naming_file_and_row(built, tmp_path, capsys):
    import sqlite3

    out = tmp_path / "idx"
    shutil.copytree(built["out"], out)
    db = sqlite3.connect(out / "gallery.sqlite")
    db.execute("UPDATE crops SET tags = '{not json' WHERE id = 3")
    db.commit()
    db.close()
    capsys.readouterr()
    assert _search(built, out, "--per-crop") == 2
    _one_error_line(capsys, r"gallery\.sqlite row 3: stored tags '\{not json' is not a JSON list")
