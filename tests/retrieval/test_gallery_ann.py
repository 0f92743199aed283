"""Approximate (faiss ANN) gallery index: PCA + IVF-PQ candidates re-ranked exactly (recall vs exact, save/load
round trip), parameters kept on disk, filters applied inside faiss (ID selector), growing segments, vectors
added in bounded-memory chunks, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from modeling_tagclip.retrieval import cli
from modeling_tagclip.retrieval.embedded import ann as annlib
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build

faiss = pytest.importorskip("faiss")

SIZE, DIM, PER_IDENTITY = 4096, 64, 8


pytestmark = pytest.mark.usefixtures("faiss_one_thread")


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.fixture(scope="module")
def clustered():
    """A clustered gallery (``global`` + TSE ``local`` sharing identity structure, 8 views per identity) and
    noisier text queries."""
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


def _paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:05d}.jpg" for i in range(start, stop)]


def _metadata(start: int, stop: int) -> dict[str, dict]:
    return {
        p: {"camera": str(i % 5), "timestamp": 1_700_000_000 + i}
        for i, p in enumerate(_paths(0, stop))
        if i >= start
    }


def _write(out, embeds, start=0, stop=SIZE, **kwargs):
    """Index rows [start, stop) (ANN over the default combined vectors)."""
    rows = {key: value[start:stop] for key, value in embeds.items()}
    if (
        kwargs.get("ann") == "ivf"
    ):  # 10 of the 16 lists: these noisy queries' neighbours spread over many lists
        kwargs.setdefault("ann_params", {"nprobe": 10})
    return index_build.index_embeddings(
        out, rows, _paths(start, stop), out.parent, metadata=_metadata(start, stop), **kwargs
    )


def test_ivf_lists_are_about_a_quarter_of_sqrt_n_with_64_rows_a_list():
    """Known answers: the power of two nearest sqrt(N) / 4 (a half rounded up: 2^4.5 -> 32 at 8192 rows), never
    under 64 rows a list on average."""
    sizes = (1, 2, 100, 1000, 2048, 4096, 5000, 8192, 30_000, 100_000, 300_000, 10**6, 10**7)
    lists = (1, 1, 1, 8, 16, 16, 16, 32, 32, 64, 128, 256, 1024)
    assert [annlib.ivf_lists(size) for size in sizes] == list(lists)
    assert all(size / n >= annlib.MIN_LIST_ROWS for size, n in zip(sizes[3:], lists[3:], strict=True))


def test_calibration_grid_and_cost():
    assert annlib._probe_grid(1024) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 1024]
    assert annlib._probe_grid(2) == [1, 2]
    # 192 of 256 lists of ~3906 rows and 600 candidates: 192 x (3906 + 500) + 950 x 600
    assert annlib.search_cost(192, 60, 3906.0) == 192 * 4406 + 570_000
    assert annlib.search_cost(10, 1, 0.0, k=1) == 10 * annlib.LIST_COST + annlib.RERANK_COST


def test_ivf_preset_sizes():
    nlist = annlib.ivf_lists(10**6)
    assert nlist == 256 and annlib.ivf_lists(SIZE) == 16
    params = {"k_factor": annlib.IVF_K_FACTOR, "nprobe": nlist // annlib.IVF_PROBE_DIVISOR}
    for on, dim, m in (("global", 512, 256), ("combined", 1536, 384)):
        full = annlib.ann_spec("ivf-full", 10**6, dim, on=on)
        assert full["factory"] == f"IVF{nlist},PQ{m}x4fsr" and full["on"] == on and full["params"] == params
        spec = annlib.ann_spec("ivf", 10**6, dim, on=on)  # 128 principal components, one 4-bit code each
        assert spec["factory"] == f"PCA128,IVF{nlist},PQ128x4fs" and spec["params"] == params
    assert (
        annlib.ann_spec("ivf", SIZE, 96)["factory"] == "PCA96,IVF16,PQ96x4fs"
    )  # never more components than dims


def test_ivf_recall_reranked_scores_and_params_survive_save_load(clustered, tmp_path):
    embeds, query = clustered
    _write(tmp_path / "idx", embeds, ann="ivf")
    index = gi.GalleryIndex.load(tmp_path / "idx", cache=False)

    ann = json.loads((tmp_path / "idx" / "index.json").read_text())["ann"]
    assert ann["factory"] == f"PCA128,IVF{annlib.ivf_lists(SIZE)},PQ128x4fs" and ann["on"] == "combined"
    assert ann["params"]["nprobe"] == 10 and annlib.ANN_ON == "combined"  # given: kept; k_factor calibrated
    assert ann["params"]["k_factor"] in annlib.CALIBRATION_K_FACTORS and ann["fixed"] == ["nprobe"]
    assert faiss.extract_index_ivf(index.faiss_index).nprobe == 10
    assert index.faiss_index.ntotal == SIZE and index.embeds["global"].dtype == torch.float16  # no fp32 copy

    scores, found = index.topk(query, 10)
    exact_scores, exact = gi.chunked_topk(query, index.embeds, 10)
    assert _recall(found, exact) >= 0.95
    hit = found == exact
    torch.testing.assert_close(scores[hit], exact_scores[hit], atol=1e-5, rtol=0)  # re-ranked exactly


def test_search_parameters_from_the_header_are_applied_on_load(clustered, tmp_path):
    embeds, query = clustered
    _write(tmp_path / "idx", embeds, ann="ivf", ann_params={"nprobe": 1, "k_factor": 1})
    low = gi.GalleryIndex.load(tmp_path / "idx", cache=False)
    assert faiss.extract_index_ivf(low.faiss_index).nprobe == 1
    header = json.loads((tmp_path / "idx" / "index.json").read_text())
    header["ann"]["params"] = {"nprobe": annlib.ivf_lists(SIZE), "k_factor": 30}  # every list, re-rank 300
    (tmp_path / "idx" / "index.json").write_text(json.dumps(header))
    high = gi.GalleryIndex.load(tmp_path / "idx", cache=False)
    assert faiss.extract_index_ivf(high.faiss_index).nprobe == annlib.ivf_lists(SIZE)
    exact = gi.chunked_topk(query, high.embeds, 10)[1]
    assert _recall(low.topk(query, 10)[1], exact) < 0.6
    assert _recall(high.topk(query, 10)[1], exact) >= 0.99


@pytest.fixture(scope="module")
def wide():
    """Global 128-d + TSE 256-d (combined 384-d, so the "ivf" preset's PCA keeps a third of it): 2 images per
    identity, identity content in a 24-d subspace shared by both, noisier text queries."""
    generator = torch.Generator().manual_seed(1)
    count, rank = SIZE // 2, 24
    basis = torch.linalg.qr(torch.randn(384, rank, generator=generator)).Q
    ids = _unit(torch.randn(count, rank, generator=generator) @ basis.T)
    ids = _unit(ids + 0.3 * _unit(torch.randn(count, 384, generator=generator)))
    gallery = ids.repeat_interleave(2, 0) + 0.6 * torch.randn(SIZE, 384, generator=generator) / 384**0.5
    picked = ids[torch.randperm(count, generator=generator)[:200]]
    queries = picked + 1.2 * torch.randn(200, 384, generator=generator) / 384**0.5
    split = lambda x: {"global": _unit(x[:, :128]), "local": _unit(x[:, 128:])}  # noqa: E731
    return split(gallery), split(queries)


def test_pca_preset_recall_vs_exact_and_save_load_round_trip(wide, tmp_path):
    """The default preset reduces 384-d to 128 principal components inside the faiss file, keeps recall@10
    >= 0.95 vs the exact TAG-PR Eq. 14 ranking with its own nprobe, and a reload answers identically."""
    embeds, query = wide
    built = index_build.index_embeddings(tmp_path / "idx", embeds, _paths(0, SIZE), tmp_path, ann="ivf")
    assert built.meta["ann"]["factory"] == "PCA128,IVF16,PQ128x4fs"
    calibration, params = built.meta["ann"]["calibration"], built.meta["ann"]["params"]
    assert calibration["recall_at_10"] >= annlib.CALIBRATION_TARGET and calibration["queries"] > 100
    assert params["nprobe"] in annlib._probe_grid(16) and params["k_factor"] in annlib.CALIBRATION_K_FACTORS
    loaded = gi.GalleryIndex.load(tmp_path / "idx", cache=False)
    pca = faiss.downcast_VectorTransform(faiss.downcast_index(loaded.faiss_index).chain.at(0))
    assert (pca.d_in, pca.d_out) == (384, 128) and faiss.extract_index_ivf(loaded.faiss_index).code_size == 64
    scores, found = loaded.topk(query, 10)
    exact_scores, exact = gi.chunked_topk(query, loaded.embeds, 10)
    assert _recall(found, exact) >= 0.95
    hit = found == exact
    torch.testing.assert_close(scores[hit], exact_scores[hit], atol=1e-5, rtol=0)
    before = built.topk(query, 10)
    assert torch.equal(before[1], found) and torch.equal(before[0], scores)
    few = dict(built.ann_params, nprobe=2)  # the probes matter: two of 64 lists lose most neighbours
    for ann in loaded.ann_indexes:
        annlib.set_search_params(ann, few)
    assert _recall(loaded.topk(query, 10)[1], exact) < 0.8


def test_pca_is_uncentred_so_a_shared_mean_does_not_reorder_rows(wide, tmp_path):
    """Trained embeddings share a large mean m (|m| 0.80 for the main job's model): a centred PCA would rank rows
    by q . x - m . x. The preset's PCA has no bias (y = A x), so inner products keep the exact order: with a
    shared mean of norm ~0.8 added to ``wide``, 40 candidates over every list hold >= 0.95 of the exact top 10
    (a centred PCA: 0.35)."""
    embeds, query = wide
    generator = torch.Generator().manual_seed(5)
    shared = {key: _unit(torch.randn(value.shape[1], generator=generator)) for key, value in embeds.items()}
    weight = 0.6 + 1.6 * torch.rand(SIZE, 1, generator=generator)  # rows lie unequally far along the mean
    embeds = {key: _unit(value + weight * shared[key]) for key, value in embeds.items()}
    query = {key: _unit(value + 0.4 * shared[key]) for key, value in query.items()}
    assert float(annlib.ann_vectors(embeds, "combined").mean(0).norm()) > 0.75
    params = {"nprobe": 16, "k_factor": 4}
    built = index_build.index_embeddings(
        tmp_path / "idx", embeds, _paths(0, SIZE), tmp_path, ann="ivf", ann_params=params
    )
    pca = faiss.downcast_VectorTransform(faiss.downcast_index(built.faiss_index).chain.at(0))
    assert not pca.have_bias
    exact = gi.chunked_topk(query, built.embeds, 10)[1]
    assert _recall(built.topk(query, 10)[1], exact) >= 0.95
    loaded = gi.GalleryIndex.load(tmp_path / "idx", cache=False)
    assert torch.equal(loaded.topk(query, 10)[1], built.topk(query, 10)[1])


def test_train_transforms_uncentred_projects_without_the_mean():
    """Known answer: the trained PCA maps x to A x (no -A m), and leaves its sub-index untrained."""
    generator = torch.Generator().manual_seed(0)
    sample = (torch.randn(2000, 32, generator=generator) + 3.0).numpy()
    index = faiss.index_factory(32, "PCA8,IVF4,Flat", faiss.METRIC_INNER_PRODUCT)
    annlib.train_transforms_uncentred(index, sample)
    pca = faiss.downcast_VectorTransform(index.chain.at(0))
    matrix = torch.from_numpy(faiss.vector_to_array(pca.A)).view(8, 32)
    torch.testing.assert_close(
        torch.from_numpy(pca.apply(sample[:5])), torch.from_numpy(sample[:5]) @ matrix.T
    )
    assert pca.is_trained and not index.index.is_trained


def test_ann_vectors_are_added_in_chunks_with_the_same_result(wide, tmp_path, monkeypatch):
    """Bounded memory: rows are converted to float32 and added ANN_ADD_CHUNK at a time; the faiss files are
    byte-identical to adding the whole segment at once."""
    embeds, _ = wide
    whole = index_build.index_embeddings(tmp_path / "a", embeds, _paths(0, SIZE), tmp_path, ann="ivf")
    added = []
    real = faiss.IndexPreTransform.add_with_ids
    monkeypatch.setattr(
        faiss.IndexPreTransform, "add_with_ids", lambda s, x, i: added.append(len(x)) or real(s, x, i)
    )
    monkeypatch.setattr(annlib, "ANN_ADD_CHUNK", 1000)
    chunked = index_build.index_embeddings(tmp_path / "b", embeds, _paths(0, SIZE), tmp_path, ann="ivf")
    assert added == [1000, 1000, 1000, 1000, 96]
    files = lambda out: json.loads((out / "manifest.json").read_text())["segments"][0]["ann_sha256"]  # noqa: E731
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert whole.meta["ann"]["trained_sha256"] == chunked.meta["ann"]["trained_sha256"]


def test_filters_are_applied_inside_faiss(clustered, tmp_path, monkeypatch):
    """camera + time filters through an IDSelectorBitmap: k hits, all matching, ~ the exact filtered ranking."""
    embeds, query = clustered
    index = _write(tmp_path / "idx", embeds, ann="ivf")
    monkeypatch.setattr(index, "crossover_rows", lambda: 0)  # force the ANN path for this small selection
    searched = []
    real = gi.GalleryIndex._ann
    monkeypatch.setattr(gi.GalleryIndex, "_ann", lambda self, *a: searched.append(1) or real(self, *a))
    filters = {"camera": "3", "after": 1_700_000_000 + 1000}
    scores, found = index.topk(query, 10, filters=filters)
    assert searched and found.shape == (200, 10)
    allowed = torch.tensor([i % 5 == 3 and i >= 1000 for i in range(SIZE)])
    assert allowed[found].all()
    exact = gi.chunked_topk(query, index.embeds, 10, mask=allowed)[1]
    assert _recall(found, exact) >= 0.95
    searched.clear()
    monkeypatch.setattr(index, "crossover_rows", lambda: 65536)  # selections below the crossover: exact
    assert torch.equal(index.topk(query, 10, filters=filters)[1], exact) and not searched


def test_add_grows_the_ann_index_by_a_segment(clustered, tmp_path):
    embeds, query = clustered
    _write(tmp_path / "idx", embeds, 0, 3072, ann="ivf")
    trained = (tmp_path / "idx" / "ann_trained.faiss").read_bytes()
    grown = _write(tmp_path / "idx", embeds, 3072, SIZE - 64)  # 4096 rows would call for 2x the lists
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert [(s["start"], s["rows"]) for s in manifest["segments"]] == [(0, 3072), (3072, 960)]
    assert all(s["ann_file"] for s in manifest["segments"])
    assert (
        len(grown.ann_indexes) == 1 and grown.faiss_index.ntotal == SIZE - 64
    )  # one merged index is searched
    assert (tmp_path / "idx" / "ann_trained.faiss").read_bytes() == trained  # no retraining, no rebuild
    exact = gi.chunked_topk(query, grown.embeds, 10)[1]
    assert _recall(grown.topk(query, 10)[1], exact) >= 0.95
    new_rows = {key: value[3072:3080].float() for key, value in grown.embeds.items() if key != "view_probs"}
    assert torch.equal(grown.topk(new_rows, 1)[1][:, 0], torch.arange(3072, 3080))


def test_small_gallery_stays_exact_with_a_warning_until_add_makes_it_large(clustered, tmp_path):
    embeds, query = clustered
    with pytest.warns(UserWarning, match=f"not built yet: 1000 images < {annlib.ANN_MIN_SIZE}"):
        small = _write(tmp_path / "idx", embeds, 0, 1000, ann="ivf")
    assert (
        small.faiss_index is None and json.loads((tmp_path / "idx" / "index.json").read_text())["ann"] is None
    )
    grown = _write(tmp_path / "idx", embeds, 1000, SIZE)
    assert len(grown.ann_indexes) == 1 and grown.faiss_index.ntotal == SIZE
    assert _recall(grown.topk(query, 10)[1], gi.chunked_topk(query, grown.embeds, 10)[1]) >= 0.95


def test_factory_string_with_params_wraps_non_ivf_indexes_in_an_id_map(clustered, tmp_path):
    embeds, query = clustered
    index = _write(tmp_path / "hnsw", embeds, ann="HNSW16", ann_params={"efSearch": 64})
    assert index.meta["ann"]["params"] == {"k_factor": annlib.IVF_K_FACTOR, "efSearch": 64}
    assert isinstance(index.faiss_index, faiss.IndexIDMap2)
    assert faiss.downcast_index(index.faiss_index.index).hnsw.efSearch == 64
    assert _recall(index.topk(query, 10)[1], gi.chunked_topk(query, index.embeds, 10)[1]) >= 0.9


def test_bad_ann_options_fail_clearly_before_writing(clustered, tmp_path):
    with pytest.raises(gi.GalleryIndexError, match="unknown ANN index 'IVFbogus'.*ivf"):
        annlib.ann_spec("IVFbogus", SIZE, DIM)
    embeds, _ = clustered
    with pytest.raises(gi.GalleryIndexError, match="no parameter 'efSearch'"):
        _write(tmp_path / "idx", embeds, ann="ivf", ann_params={"efSearch": 16})
    with pytest.raises(gi.GalleryIndexError, match="k_factor must be a positive number"):
        _write(tmp_path / "idx", embeds, ann="ivf", ann_params={"k_factor": 0})
    assert not (tmp_path / "idx").exists()


def test_cli_ann_flag(tmp_path, capsys):
    """`tagclip index --ann ivf --ann-param nprobe=64` parses; a malformed --ann-param is refused."""
    from modeling_tagclip.cli import parse

    args = parse(
        "index",
        ["--model", "m", "--images", "i", "--output", "o", "--ann", "ivf", "--ann-param", "nprobe=64"],
    )
    assert (args.ann, cli._ann_params(args.ann_param)) == ("ivf", {"nprobe": 64.0})
    for bad in ("nprobe", "nprobe=nan", "=3"):
        with pytest.raises(SystemExit, match="name=value"):
            cli._ann_params([bad])


def test_ivf_preset_is_calibrated_on_held_out_rows_at_build(clustered, tmp_path):
    """Without --ann-param, nprobe and k_factor are chosen when the quantizer is trained, from proxy queries
    built on gallery rows outside the training sample, and kept in index.json with the recall they reached;
    the noisier text-like queries keep recall@10 >= 0.95 at those settings."""
    embeds, query = clustered
    index = index_build.index_embeddings(tmp_path / "idx", embeds, _paths(0, SIZE), tmp_path, ann="ivf")
    ann = json.loads((tmp_path / "idx" / "index.json").read_text())["ann"]
    assert ann["fixed"] == [] and ann["calibration"]["recall_at_10"] >= annlib.CALIBRATION_TARGET
    assert ann["params"]["nprobe"] in annlib._probe_grid(16)
    assert ann["params"]["k_factor"] in annlib.CALIBRATION_K_FACTORS
    exact = gi.chunked_topk(query, index.embeds, 10)[1]
    assert _recall(index.topk(query, 10)[1], exact) >= 0.95
    trained = annlib._training_rows(
        SIZE, faiss.index_factory(128, ann["factory"], faiss.METRIC_INNER_PRODUCT)
    )
    held_out = annlib._held_out_rows(SIZE, trained)
    assert len(held_out) == annlib.CALIBRATION_QUERIES and not set(held_out.tolist()) & set(trained.tolist())
