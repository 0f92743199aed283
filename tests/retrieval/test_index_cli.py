"""Gallery index + ``tagclip`` CLI: index → search ranks as direct model scoring, resume byte-identically, integrity
(manifest checksums, missing/truncated shards, NaN rows, bad numbers), clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from fixtures import REPO_ROOT, model_and_gallery, save_tiny_model
from PIL import Image

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import ann as annlib
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build

QUERIES = [
    "a man in a blue hooded sweatshirt with a brown bag",
    "a woman with long black hair in a red skirt",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    found = model_and_gallery(tmp_path_factory.mktemp("index"))
    model, processor = cli.load_model(str(found["model"]))
    return {
        "root": found["root"],
        "model_dir": found["model"],
        "other_dir": save_tiny_model(found["root"] / "other", seed=1),
        "images": found["images"],
        "model": model,
        "processor": processor,
    }


def _index(setup, out, *extra):
    args = ["index", "--model", str(setup["model_dir"]), "--images", str(setup["images"]), "--out", str(out)]
    return cli.main([*args, "--batch-size", "2", "--shard-size", "3", "--workers", "0", "--quiet", *extra])


def _build(setup, out, **kwargs):
    options = dict(batch_size=2, shard_size=3, progress=False)
    return index_build.build_index(
        setup["model"], setup["processor"], setup["images"], out, **{**options, **kwargs}
    )


def _segment_bytes(out) -> bytes:
    manifest = json.loads((out / "manifest.json").read_text())
    return b"".join((out / s["file"]).read_bytes() for s in manifest["segments"])


def _direct_ranking(setup, k: int):
    """Top-k gallery paths and scores from the model's own TAG-PR Eq. 14 similarity over every image at once."""
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
    assert _index(setup, out) == 0
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
        h["view"] == h["predicted_view"] in ("aerial", "ground") and 0.5 <= h["predicted_view_score"] <= 1
        for r in results
        for h in r["hits"]
    )
    header = json.loads((built / "index.json").read_text())
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["num_rows"] == len(gi.list_images(setup["images"])) and header["ann"] is None
    assert "paths" not in header and not (built / "build").exists()


def test_search_table_html_and_png(built, tmp_path, capsys):
    html, png = tmp_path / "hits.html", tmp_path / "hits.png"
    args = ["search", "--index", str(built), "-k", "3", "--html", str(html), "--png", str(png), QUERIES[0]]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "score" in out and QUERIES[0] in out
    page = html.read_text()
    assert QUERIES[0] in page and page.count("data:image/png;base64,") == 3
    with Image.open(png) as sheet:
        assert sheet.width > 3 * 96 and sheet.height >= 192


def test_chunked_topk_equals_full_ranking_with_and_without_a_mask():
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
    mask = torch.arange(50) % 3 == 0  # 17 rows allowed: ranked among themselves, never padded with others
    allowed = mask.nonzero().squeeze(1)
    masked = full[:, allowed].topk(17, dim=1)
    scores, indices = gi.chunked_topk(query, gallery, 20, chunk_size=7, mask=mask)
    assert torch.equal(indices, allowed[masked.indices]) and scores.shape == (5, 17)


@pytest.mark.slow
def test_interrupted_index_resumes_byte_identically(setup, built, tmp_path, monkeypatch, capsys):
    out = tmp_path / "resumable"

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(setup, out, on_shard=interrupt)
    assert sorted(p.name for p in (out / "build").glob("shard_*")) == [
        "shard_0000000.json",
        "shard_0000000.safetensors",
    ]
    with pytest.raises(gi.GalleryIndexError, match="incomplete"):
        gi.GalleryIndex.load(out)
    assert cli.main(["search", "--index", str(out), "x"]) == 2
    assert "incomplete" in capsys.readouterr().err

    encoded = []
    real = index_build.encode_batch
    monkeypatch.setattr(
        index_build, "encode_batch", lambda m, px, *a: encoded.append(len(px)) or real(m, px, *a)
    )
    resumed = _build(setup, out)
    total = len(gi.list_images(setup["images"]))
    assert sum(encoded) == total - 3
    assert resumed.paths == gi.GalleryIndex.load(built).paths
    assert _segment_bytes(out) == _segment_bytes(built)
    encoded.clear()
    _build(setup, out)  # complete: nothing to do
    assert encoded == []


@pytest.mark.slow
def test_kill_9_mid_index_then_resume_is_byte_identical(setup, built, tmp_path):
    """A real SIGKILL (no cleanup runs) after the second shard, then `tagclip index` resumes (same torch thread
    count as this process: BLAS results depend on it at the last bit)."""
    out = tmp_path / "killed"
    script = (
        "import os, signal, sys, torch\n"
        "from modeling_tagclip.retrieval import cli\n"
        "from modeling_tagclip.retrieval.embedded import index_build\n"
        f"torch.set_num_threads({torch.get_num_threads()})\n"
        "model, processor = cli.load_model(sys.argv[1])\n"
        "kill = lambda done, total: done >= 6 and os.kill(os.getpid(), signal.SIGKILL)\n"
        "index_build.build_index(model, processor, sys.argv[2], sys.argv[3], batch_size=2, shard_size=3,\n"
        "                        progress=False, on_shard=kill)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(setup["model_dir"]), str(setup["images"]), str(out)]
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists() and len(list((out / "build").glob("shard_*.json"))) == 2
    assert _index(setup, out) == 0
    assert _segment_bytes(out) == _segment_bytes(built)


@pytest.mark.slow
def test_missing_or_truncated_shard_is_re_encoded_not_trusted(setup, built, tmp_path, monkeypatch):
    out = tmp_path / "damaged"
    stop_after = lambda done, total: done >= 12 and (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        _build(setup, out, on_shard=stop_after)
    build = out / "build"
    (build / "shard_0000001.safetensors").unlink()  # a missing middle shard
    data = (build / "shard_0000002.safetensors").read_bytes()
    (build / "shard_0000002.safetensors").write_bytes(data[: len(data) // 2])  # a truncated one
    redone = []
    real = index_build._encode_shards
    monkeypatch.setattr(
        index_build,
        "_encode_shards",
        lambda m, p, f, todo, *a: redone.extend(todo) or real(m, p, f, todo, *a),
    )
    _build(setup, out)
    assert redone[:2] == [1, 2] and 0 not in redone and 3 not in redone
    assert _segment_bytes(out) == _segment_bytes(built)


def test_corrupt_committed_index_refuses_to_load(setup, built, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    segment = next((copy / "segments").glob("*.safetensors"))
    data = segment.read_bytes()
    segment.write_bytes(data[:-8])
    with pytest.raises(gi.GalleryIndexError, match="corrupt"):
        gi.GalleryIndex.load(copy, cache=False)
    segment.unlink()
    with pytest.raises(gi.GalleryIndexError, match="missing"):
        gi.GalleryIndex.load(copy, cache=False)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["num_rows"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(gi.GalleryIndexError, match="row count"):
        gi.GalleryIndex.load(copy, cache=False)


def test_paths_leaving_the_image_root_are_skipped(setup, built, tmp_path):
    import shutil
    import sqlite3

    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    with sqlite3.connect(copy / "gallery.sqlite") as db:
        db.execute("UPDATE crops SET path = '../../etc/passwd' WHERE id = 1")
    with pytest.warns(UserWarning, match=r"1 row\(s\) skipped .* rows \[1\]"):  # reported, skipped
        index = gi.GalleryIndex.load(copy, cache=False)
    assert index.paths[1] is None and not index.mask()[1] and bool(index.mask()[0])
    loaded = gi.GalleryIndex.load(copy, cache=False, allow_outside_root=True)  # the user's explicit choice
    assert loaded.paths[1].endswith("etc/passwd")


def test_nan_embedding_is_refused_naming_the_image_and_poisons_nothing(setup, built, tmp_path, monkeypatch):
    out = tmp_path / "nan"
    real = index_build.encode_batch

    def nan_in_batch_3(model, pixels, *args):
        rows = real(model, pixels, *args)
        if len(nan_in_batch_3.calls) == 2:  # batches (0, 1), (2,), (3, 4): image 4
            rows["local"] = rows["local"].clone()
            rows["local"][1] = float("nan")
        nan_in_batch_3.calls.append(1)
        return rows

    nan_in_batch_3.calls = []
    monkeypatch.setattr(index_build, "encode_batch", nan_in_batch_3)
    with pytest.raises(ValueError, match=r"non-finite.*local embedding for image 4 \(.*00005_c0_00\.png\)"):
        _build(setup, out)
    monkeypatch.setattr(index_build, "encode_batch", real)
    _build(setup, out)  # a later valid run resumes and finishes the same index
    assert _segment_bytes(out) == _segment_bytes(built)
    index = gi.GalleryIndex.load(out)
    query = gi.encode_texts(setup["model"], setup["processor"], QUERIES)
    query["global"] = query["global"].clone()
    query["global"][0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite.*query 0"):
        index.topk(query, 3)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-size", "-4"], "--batch-size: must be a positive integer"),
        (["--batch-size", "0"], "--batch-size: must be a positive integer"),
        (["--shard-size", "0"], "--shard-size: must be a positive integer"),
        (["--workers", "-1"], "--workers: must be a non-negative integer"),
        (["--dtype", "int8"], "--dtype: invalid choice"),
    ],
)
def test_bad_index_numbers_are_argparse_errors_and_write_nothing(setup, tmp_path, capsys, extra, message):
    args = ["index", "--model", str(setup["model_dir"]), "--images", str(setup["images"])]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--out", str(tmp_path / "o"), *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        _build(setup, tmp_path / "o", batch_size=-4)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("k", ["0", "-1", "x"])
def test_bad_top_k_is_an_argparse_error(built, capsys, k):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--index", str(built), "-k", k, "a man"])
    assert exit_info.value.code == 2 and "--top-k: must be a positive integer" in capsys.readouterr().err


def test_json_output_is_valid_even_with_no_hits(built, capsys):
    capsys.readouterr()
    assert cli.main(["search", "--index", str(built), "--json", "--camera", "nowhere", "a man"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"query": "a man", "hits": []}]
    assert (
        cli.main(["search", "--index", str(built), "--after", "2026-01-02", "--before", "2026-01-01", "x"])
        == 2
    )
    assert "empty time window" in capsys.readouterr().err


def test_out_folder_that_is_not_an_index_is_never_written_or_deleted(setup, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert _index(setup, tmp_path / "mine", "--overwrite") == 2
    assert "holds no gallery index" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


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


def test_eval_and_push_are_verbs_of_the_same_front_door(capsys):
    from modeling_tagclip.cli import main as tagclip

    for command, option in (("eval", "--data"), ("push", "--repo-id")):
        with pytest.raises(SystemExit) as exit_info:
            tagclip([command, "--help"])
        assert exit_info.value.code == 0
        assert option in capsys.readouterr().out


@pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")
def test_index_ann_flag_is_validated_and_never_silently_ignored(setup, tmp_path, capsys):
    """`--ann` refuses a bad index string before encoding; under ANN_MIN_SIZE it warns that search stays exact."""
    assert _index(setup, tmp_path / "bad", "--ann", "IVFbogus") == 2
    assert "unknown ANN index 'IVFbogus'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert _index(setup, tmp_path / "small", "--ann", "ivf", "--ann-param", "nprobe=8") == 0
    captured = capsys.readouterr()  # the CLI prints the library's warning as one stderr line
    assert "search: exact" in captured.out
    assert "tagclip index: warning: ANN index 'ivf' not built yet: 20 images < 2048" in captured.err
    header = json.loads((tmp_path / "small" / "index.json").read_text())
    queries = header["ann_request"].pop("queries")  # the default person descriptions, embedded
    assert queries["file"] == annlib.QUERIES_FILE and queries["rows"] == index_build.CALIBRATION_TEXTS
    assert header["ann"] is None and header["ann_request"] == {
        "ann": "ivf",
        "params": {"nprobe": 8.0},
        "on": "combined",
    }


@pytest.mark.slow
def test_bf16_autocast_and_dataloader_workers(setup, built, tmp_path):
    """`--dtype bf16` runs the model under autocast (stored rows stay fp32 unless --store-dtype fp16)."""
    bf16 = _build(setup, tmp_path / "bf16", dtype="bf16", store_dtype="fp16")
    fp32 = gi.GalleryIndex.load(built)
    assert bf16.embeds["global"].dtype == torch.float16 and fp32.embeds["global"].dtype == torch.float32
    for key in ("global", "local"):
        cosine = torch.nn.functional.cosine_similarity(bf16.embeds[key].float(), fp32.embeds[key], dim=1)
        assert cosine.min() > 0.98 and not torch.equal(bf16.embeds[key].float(), fp32.embeds[key])
    with_workers = _build(setup, tmp_path / "workers", num_workers=2)  # decoding in 2 worker processes
    assert _segment_bytes(tmp_path / "workers") == _segment_bytes(built) and len(with_workers) == len(fp32)
