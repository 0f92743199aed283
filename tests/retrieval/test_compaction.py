"""Segment merging: size tiers bound the segments of a gallery grown by many adds; rows, ids and answers stay
those of an index built at once; a kill during a merge loses nothing; a server reads no row twice."""

from __future__ import annotations

import json

import pytest
import torch

from modeling_tagclip.retrieval.embedded import ann as annlib
from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build, index_commit, index_store
from modeling_tagclip.retrieval.embedded.compaction import merge_run, tier


def rows(count: int, seed: int, dim: int = 8) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"global": torch.nn.functional.normalize(torch.randn(count, dim, generator=generator), dim=-1)}


def paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:05d}.jpg" for i in range(start, stop)]


def grow(out, tmp_path, sizes: list[int], seed: int = 0, **kwargs) -> gi.GalleryIndex:
    """An index written by one commit per size (the first creates it)."""
    start, index = 0, None
    for j, size in enumerate(sizes):
        index = index_build.index_embeddings(
            out, rows(size, seed + j), paths(start, start + size), tmp_path, **(kwargs if j == 0 else {})
        )
        start += size
    return index


def test_tiers_and_runs_known_answers():
    assert [tier(n) for n in (1, 3, 4, 15, 16, 64, 1000, 1024)] == [0, 0, 1, 1, 2, 3, 4, 5]
    assert merge_run([100, 10, 10, 10]) == 0  # three of one tier
    assert merge_run([100, 10, 10, 10, 10]) == 4
    assert merge_run([10, 10, 10, 40]) == 0  # the newest four span two tiers
    assert merge_run([10, 10, 10, 10], max_rows=39) == 0  # too large to merge
    assert merge_run([5, 5, 5]) == 0


def test_many_adds_keep_few_segments_and_the_rows_of_one_build(tmp_path):
    sizes = [200] + [10] * 40
    grown = grow(tmp_path / "idx", tmp_path, sizes)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    counts = [s["rows"] for s in manifest["segments"]]
    assert counts == [200, 160, 160, 40, 40] and len(grown) == 600  # not 41 segments
    assert [s["start"] for s in manifest["segments"]] == [0, 200, 360, 520, 560]
    merged = manifest["segments"][1]
    assert (
        merged["file"] == "segments/seg_0000000200-0000000360.safetensors"
        and len(merged["merged_from"]) == 16
    )
    on_disk = sorted(
        p.relative_to(tmp_path / "idx").as_posix() for p in (tmp_path / "idx").rglob("*.safetensors")
    )
    assert on_disk == sorted(s["file"] for s in manifest["segments"])  # merged-away files are deleted
    expected = torch.cat([rows(size, j)["global"] for j, size in enumerate(sizes)])
    assert torch.equal(grown.embeds["global"], expected)
    assert grown.paths[-1].endswith("img/00599.jpg") and grown.paths[250].endswith("img/00250.jpg")
    picked = torch.arange(0, 600, 37)
    assert torch.equal(grown.topk({"global": expected[picked]}, 1)[1][:, 0], picked)


def test_a_kill_during_a_merge_keeps_the_committed_index_and_the_rerun_completes(tmp_path, monkeypatch):
    out = tmp_path / "idx"
    grow(out, tmp_path, [200, 10, 10, 10])
    real = index_commit.write_json

    def killed(path, obj, *args, **kwargs):
        if path.name == "manifest.json":
            raise OSError("killed before the manifest swap")
        return real(path, obj, *args, **kwargs)

    monkeypatch.setattr(index_commit, "write_json", killed)
    with pytest.raises(OSError, match="killed"):
        index_build.index_embeddings(out, rows(10, 4), paths(230, 240), tmp_path)
    assert (out / "segments" / "seg_0000000200-0000000240.safetensors").is_file()  # the merge was written
    before = gi.GalleryIndex.load(out, cache=False)
    assert len(before) == 230 and [s["rows"] for s in before._segments] == [200, 10, 10, 10]
    monkeypatch.setattr(index_commit, "write_json", real)
    after = index_build.index_embeddings(out, rows(10, 4), paths(230, 240), tmp_path)
    whole = grow(tmp_path / "whole", tmp_path, [200, 10, 10, 10, 10])
    assert segment_rows(out) == [200, 40]
    assert torch.equal(after.embeds["global"], whole.embeds["global"]) and after.paths[-1].endswith(
        "00239.jpg"
    )


def segment_rows(out) -> list[int]:
    return [s["rows"] for s in json.loads((out / "manifest.json").read_text())["segments"]]


def test_a_served_index_reads_only_the_segment_with_new_rows_across_a_merge(tmp_path, monkeypatch):
    out = tmp_path / "idx"
    grow(out, tmp_path, [200, 10, 10, 10])
    served = gi.GalleryIndex.load(out)  # cached, as a server holds it
    assert len(served.embeds["global"]) == 230
    read, real, mapped = [], index_store._read_hashed, index_store.map_tensors
    monkeypatch.setattr(
        index_store, "_read_hashed", lambda path, sha: read.append(path.name) or real(path, sha)
    )
    monkeypatch.setattr(  # a served index maps its segments: opening one counts as reading it
        index_store, "map_tensors", lambda path, sha, n: read.append(path.name) or mapped(path, sha, n)
    )
    index_build.index_embeddings(out, rows(10, 3), paths(230, 240), tmp_path)
    read.clear()  # the commit read the merged parts; the server's refresh is what counts
    again = gi.GalleryIndex.load(out)
    assert again is served and len(again.embeds["global"]) == 240 and segment_rows(out) == [200, 40]
    assert read == ["seg_0000000200-0000000240.safetensors"]  # the merge holding the new rows, not segment 0
    assert torch.equal(again.embeds["global"][230:], rows(10, 3)["global"])
    index_build.index_embeddings(out, rows(10, 4), paths(240, 250), tmp_path)
    read.clear()
    assert len(gi.GalleryIndex.load(out).embeds["global"]) == 250
    assert read == ["seg_0000000240.safetensors"]  # only the new segment


def clustered(count: int, seed: int, dim: int = 16) -> dict[str, torch.Tensor]:
    """Unit ``global`` and ``local`` rows around fixed centres (one draw of ``count`` rows per seed)."""
    centres = torch.randn(64, 2 * dim, generator=torch.Generator().manual_seed(99))
    generator = torch.Generator().manual_seed(seed)
    picked = centres[torch.randint(0, 64, (count,), generator=generator)]
    mixed = picked + 0.3 * torch.randn(count, 2 * dim, generator=generator)
    unit = torch.nn.functional.normalize
    return {"global": unit(mixed[:, :dim], dim=-1), "local": unit(mixed[:, dim:], dim=-1)}


@pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")
def test_ann_after_adds_searches_one_index_and_answers_as_a_fresh_build(tmp_path):
    threads = annlib.faiss.omp_get_max_threads()
    annlib.faiss.omp_set_num_threads(1)
    sizes = [4096] + [256] * 9
    parts = [clustered(size, j) for j, size in enumerate(sizes)]
    try:
        start, out = 0, tmp_path / "grown"
        for j, part in enumerate(parts):
            extra = {"ann": "ivf", "ann_params": {"nprobe": 8, "k_factor": 20}} if j == 0 else {}
            grown = index_build.index_embeddings(out, part, paths(start, start + sizes[j]), tmp_path, **extra)
            start += sizes[j]
        whole = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        fresh = index_build.index_embeddings(
            tmp_path / "fresh",
            whole,
            paths(0, start),
            tmp_path,
            ann="ivf",
            ann_params={"nprobe": 8, "k_factor": 20},
        )
        assert segment_rows(out) == [4096, 1024, 1024, 256]  # 8 adds merged in 2
        assert len(grown.ann_indexes) == 1 and grown.faiss_index.ntotal == start  # one index is searched
        queries = {key: value[::97].float() for key, value in whole.items()}
        exact = gi.chunked_topk(queries, grown.embeds, 10)[1]
        found = grown.topk(queries, 10)[1]
        assert float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean()) >= 0.95
        assert fresh.faiss_index.ntotal == grown.faiss_index.ntotal
    finally:
        annlib.faiss.omp_set_num_threads(threads)


def test_a_merge_purges_removed_rows_from_its_file_and_keeps_every_other_answer(tmp_path):
    out = tmp_path / "idx"
    grow(out, tmp_path, [200, 10, 10, 10])
    index = gi.GalleryIndex.load(out, cache=False)
    everything = index.embeds["global"].clone()
    gone = [203, 204, 215, 0]
    assert index.remove(ids=gone) == 4
    before = index.topk({"global": everything}, 5)
    index_build.index_embeddings(out, rows(10, 4), paths(230, 240), tmp_path)  # four of a tier: merged
    manifest = json.loads((out / "manifest.json").read_text())
    merged = manifest["segments"][1]
    assert segment_rows(out) == [200, 40] and merged["purged"] == [[203, 205], [215, 216]]
    stored = index_store.read_tensors(out / merged["file"], merged["sha256"], 37)  # 40 ids, 3 purged
    kept = [i for i in range(200, 240) if i not in gone]
    whole = torch.cat([everything, rows(10, 4)["global"]])
    assert torch.equal(stored["global"], whole[kept])
    assert manifest["segments"][0]["rows"] == 200 and "purged" not in manifest["segments"][0]  # not merged
    fresh = gi.GalleryIndex.load(out, cache=False)  # what a new process reads
    assert len(fresh) == 240 and fresh.count() == 236 and fresh.paths[239].endswith("img/00239.jpg")
    assert torch.equal(fresh.embeds["global"][kept], whole[kept])
    allowed = torch.ones(240, dtype=torch.bool)
    allowed[gone] = False
    expected = gi.chunked_topk(
        {"global": everything}, {"global": whole}, 5, mask=allowed
    )  # the unpurged rows
    after = fresh.topk({"global": everything}, 5)
    assert torch.equal(after[1], expected[1]) and torch.equal(after[0], expected[0])
    assert not torch.isin(after[1], torch.tensor(gone)).any()
    own = torch.tensor([i for i in range(230) if i not in gone])
    assert torch.equal(before[1][own, 0], own) and torch.equal(after[1][own, 0], own)  # each row finds itself


@pytest.mark.skipif(annlib.faiss is None, reason="faiss is optional and not installed")
def test_a_merge_drops_removed_rows_from_the_ann_index(tmp_path):
    threads = annlib.faiss.omp_get_max_threads()
    annlib.faiss.omp_set_num_threads(1)
    sizes = [4096, 256, 256, 256, 256]
    parts = [clustered(size, j) for j, size in enumerate(sizes)]
    try:
        out, start = tmp_path / "idx", 0
        for j, part in enumerate(parts[:4]):
            extra = {"ann": "ivf", "ann_params": {"nprobe": 16, "k_factor": 20}} if j == 0 else {}
            index = index_build.index_embeddings(out, part, paths(start, start + sizes[j]), tmp_path, **extra)
            start += sizes[j]
        gone = list(range(4100, 4150)) + [4400]
        index.remove(ids=gone)
        grown = index_build.index_embeddings(out, parts[4], paths(start, start + 256), tmp_path)
        manifest = json.loads((out / "manifest.json").read_text())
        assert segment_rows(out) == [4096, 1024] and manifest["segments"][1]["purged"] == [
            [4100, 4150],
            [4400, 4401],
        ]
        assert grown.faiss_index.ntotal == 5120 - 51  # the purged rows have no vector
        whole = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        queries = {key: value[::61].float() for key, value in whole.items()}
        allowed = torch.ones(5120, dtype=torch.bool)
        allowed[gone] = False
        exact = gi.chunked_topk(queries, grown.embeds, 10, mask=allowed)[1]
        found = grown.topk(queries, 10)[1]
        assert not torch.isin(found, torch.tensor(gone)).any()
        assert float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean()) >= 0.95
    finally:
        annlib.faiss.omp_set_num_threads(threads)
