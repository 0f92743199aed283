"""Approximate (faiss ANN) gallery index: recall vs exact search, parameters kept on disk, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval import gallery_index as gi

faiss = pytest.importorskip("faiss")

SIZE, DIM, PER_IDENTITY = 4096, 64, 8


@pytest.fixture(autouse=True, scope="module")
def single_threads():
    """One torch and one faiss thread: on a busy 2-core CPU, idle torch OpenMP workers spinning beside faiss's
    training make building the small index 30x slower (1 s -> 30 s)."""
    threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    yield
    torch.set_num_threads(threads[0])
    faiss.omp_set_num_threads(threads[1])


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.fixture(scope="module")
def clustered():
    """A clustered gallery (``global`` + TSE ``local``, 8 views per identity) and noisier text queries.

    Identity centres mix a random 16-d subspace with isotropic noise, as in benchmarks/bench_search.py.
    """
    generator = torch.Generator().manual_seed(0)
    count = SIZE // PER_IDENTITY
    basis = torch.linalg.qr(torch.randn(2 * DIM, 16, generator=generator)).Q
    low_rank = _unit(torch.randn(count, 16, generator=generator) @ basis.T)
    centres = _unit(low_rank + 0.5 * _unit(torch.randn(count, 2 * DIM, generator=generator)))
    views = centres.repeat_interleave(PER_IDENTITY, 0)
    gallery = _unit(views + 0.8 * torch.randn(SIZE, 2 * DIM, generator=generator) / DIM**0.5)
    picked = centres[torch.randint(0, centres.shape[0], (200,), generator=generator)]
    queries = _unit(picked + 1.2 * torch.randn(200, 2 * DIM, generator=generator) / DIM**0.5)
    split = lambda x: {"global": _unit(x[:, :DIM]), "local": _unit(x[:, DIM:])}  # noqa: E731
    return split(gallery), split(queries)


def _recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    return float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean())


def _write_shards(out, embeds) -> dict:
    """An index directory whose rows are encoded (shards) but not finished, as build_index leaves it."""
    (out / "shards").mkdir(parents=True)
    save_file(embeds, str(out / "shards" / "shard_000000000.safetensors"))
    size = embeds["global"].shape[0]
    meta = {"format": gi.INDEX_FORMAT, "version": gi.INDEX_VERSION, "image_root": str(out),
            "paths": [f"{i}.jpg" for i in range(size)], "num_images": size, "num_done": size,
            "complete": False, "shard_size": size}  # fmt: skip
    (out / "index.json").write_text(json.dumps(meta))
    return meta


def test_ivf_preset_recall_and_params_survive_save_load(clustered, tmp_path):
    embeds, query = clustered
    meta = _write_shards(tmp_path / "idx", embeds)
    gi._finish(tmp_path / "idx", meta, True, "ivf", None)
    index = gi.GalleryIndex.load(tmp_path / "idx")

    ann = json.loads((tmp_path / "idx" / "index.json").read_text())["ann"]
    nlist = gi.ivf_lists(SIZE)
    assert ann["factory"] == f"IVF{nlist},PQ{DIM}x4fsr,RFlat"
    assert ann["params"] == {"nprobe": max(1, nlist // gi.IVF_PROBE_DIVISOR), "k_factor_rf": gi.IVF_K_FACTOR}
    assert faiss.extract_index_ivf(index.faiss_index).nprobe == ann["params"]["nprobe"]
    assert faiss.downcast_index(index.faiss_index).k_factor == gi.IVF_K_FACTOR

    scores, found = index.topk(query, 10)
    exact_scores, exact = gi.chunked_topk(query, embeds, 10)
    assert _recall(found, exact) >= 0.9
    hit = found == exact
    torch.testing.assert_close(scores[hit], exact_scores[hit], atol=1e-5, rtol=0)  # re-ranked exactly


def test_search_parameter_from_metadata_is_applied_on_load(clustered, tmp_path):
    embeds, query = clustered
    meta = _write_shards(tmp_path / "idx", embeds)
    gi._finish(tmp_path / "idx", meta, True, "ivf", {"nprobe": 1, "k_factor_rf": 1})
    low = gi.GalleryIndex.load(tmp_path / "idx")
    assert faiss.extract_index_ivf(low.faiss_index).nprobe == 1
    meta = json.loads((tmp_path / "idx" / "index.json").read_text())
    meta["ann"]["params"] = {"nprobe": gi.ivf_lists(SIZE), "k_factor_rf": 30}  # every list, re-rank 300
    (tmp_path / "idx" / "index.json").write_text(json.dumps(meta))
    high = gi.GalleryIndex.load(tmp_path / "idx")
    assert faiss.extract_index_ivf(high.faiss_index).nprobe == gi.ivf_lists(SIZE)
    assert faiss.downcast_index(high.faiss_index).k_factor == 30
    exact = gi.chunked_topk(query, embeds, 10)[1]
    assert _recall(low.topk(query, 10)[1], exact) < 0.6
    assert _recall(high.topk(query, 10)[1], exact) >= 0.99


def test_factory_string_with_params_and_small_gallery_stays_exact(clustered, tmp_path):
    embeds, query = clustered
    meta = _write_shards(tmp_path / "hnsw", embeds)
    gi._finish(tmp_path / "hnsw", meta, True, "HNSW16", {"efSearch": 48})
    index = gi.GalleryIndex.load(tmp_path / "hnsw")
    assert index.meta["ann"] == {"factory": "HNSW16", "params": {"efSearch": 48}}
    assert faiss.downcast_index(index.faiss_index).hnsw.efSearch == 48
    assert _recall(index.topk(query, 10)[1], gi.chunked_topk(query, embeds, 10)[1]) >= 0.9

    small = {key: value[: gi.ANN_MIN_SIZE - 1] for key, value in embeds.items()}
    meta = _write_shards(tmp_path / "small", small)
    gi._finish(tmp_path / "small", meta, True, "ivf", None)
    index = gi.GalleryIndex.load(tmp_path / "small")
    assert index.meta["ann"] is None and isinstance(index.faiss_index, faiss.IndexFlatIP)


def test_bad_ann_options_fail_clearly(clustered, tmp_path):
    with pytest.raises(gi.GalleryIndexError, match="unknown ANN index 'IVFbogus'.*ivf"):
        gi.ann_spec("IVFbogus", SIZE, 2 * DIM)
    embeds, _ = clustered
    meta = _write_shards(tmp_path / "idx", embeds)
    with pytest.raises(gi.GalleryIndexError, match="no parameter 'efSearch'"):
        gi._finish(tmp_path / "idx", meta, True, "ivf", {"efSearch": 16})


def test_cli_ann_flag(tmp_path, capsys):
    """`tagclip index --ann ivf --ann-param nprobe=64` parses; a malformed --ann-param is refused."""
    args = cli._parser().parse_args(
        ["index", "--model", "m", "--images", "i", "--out", "o", "--ann", "ivf", "--ann-param", "nprobe=64"]
    )
    assert (args.ann, cli._ann_params(args.ann_param)) == ("ivf", {"nprobe": 64.0})
    with pytest.raises(SystemExit, match="name=value"):
        cli._ann_params(["nprobe"])
