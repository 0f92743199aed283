"""The re-rank store: int8 rows (codes + a scale a row) and their recall against fp16, memory-mapped loading
equal to reading into memory (one segment, several, purged rows), rows read across segments without joining
them, and a mapped load that adds no copy of the rows to the process's anonymous memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from modeling_tagclip.retrieval.embedded import gallery_index as gi
from modeling_tagclip.retrieval.embedded import index_build
from modeling_tagclip.retrieval.embedded.row_store import (
    RowPlan,
    SegmentedRows,
    decoded,
    dequantize,
    dequantized,
    quantize_int8,
    store_rows,
    take,
)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def _rows(count: int, seed: int, dim: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "global": _unit(torch.randn(count, dim, generator=g)),
        "local": _unit(torch.randn(count, 2 * dim, generator=g)),
        "view_probs": torch.softmax(torch.randn(count, 2, generator=g), dim=1),
    }


def _paths(start: int, stop: int) -> list[str]:
    return [f"img/{i:05d}.jpg" for i in range(start, stop)]


def test_int8_codes_reconstruct_rows_within_half_a_step():
    rows = _rows(50, 0)["global"]
    codes, scale = quantize_int8(rows)
    assert codes.dtype == torch.int8 and scale.shape == (50,) and int(codes.abs().max()) == 127
    error = (codes.float() * scale[:, None] - rows).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())  # round to nearest: at most half a step
    zero_codes, zero_scale = quantize_int8(torch.zeros(2, 4))  # an all-zero row stays zero, no NaN
    assert not zero_codes.any() and not zero_scale.any()
    stored = store_rows(_rows(5, 1), torch.int8)
    assert sorted(stored) == ["global", "global_scale", "local", "local_scale", "view_probs"]
    back = decoded(stored)
    assert sorted(back) == ["global", "local", "view_probs"] and back["global"].dtype == torch.float32
    torch.testing.assert_close(back["local"], _rows(5, 1)["local"], atol=0.01, rtol=0)
    torch.testing.assert_close(dequantize(stored, "global", torch.tensor([3, 1])), back["global"][[3, 1]])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.float32])
def test_dequantize_equals_codes_times_scales_and_leaves_the_store_as_it_was(dtype):
    """The float copy is scaled in place: the values are the codes times their row scales to the bit, the
    stored codes, scales and (fp32: returned as is) rows are untouched, for slices, index tensors and
    segmented rows."""
    stored = store_rows(_rows(40, 2), dtype)
    before = {key: value.clone() for key, value in stored.items()}
    segmented = {key: SegmentedRows([value[:15], value[15:]]) for key, value in stored.items()}
    for rows in (stored, segmented):
        for index in (torch.tensor([7, 3, 31, 3]), slice(5, 25), torch.arange(40) % 3 == 0):
            got = dequantize(rows, "local", index)
            expected = stored["local"][index].float()
            if dtype == torch.int8:
                expected = expected * stored["local_scale"][index].float().unsqueeze(-1)
            assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert all(torch.equal(stored[key], before[key]) for key in stored)


def test_segmented_rows_read_like_the_joined_tensor():
    parts = [torch.arange(12.0).reshape(4, 3), torch.arange(12.0, 15.0).reshape(1, 3), torch.zeros(0, 3)]
    parts.append(torch.arange(15.0, 30.0).reshape(5, 3))
    rows, whole = SegmentedRows(parts), torch.cat(parts)
    assert rows.shape == whole.shape and len(rows) == 10 and rows.dtype == torch.float32
    for key in (slice(None), slice(2, 7), slice(4, 5), slice(5, 10), slice(8, 3), slice(0, 10, 3)):
        assert torch.equal(rows[key], whole[key]), key
    picked = torch.tensor([[9, 0], [4, 4]])
    assert torch.equal(rows[picked], whole[picked]) and torch.equal(rows[7], whole[7])
    assert torch.equal(rows[whole[:, 0] > 10], whole[whole[:, 0] > 10])  # a Boolean mask
    assert rows[4:5].data_ptr() == parts[1].data_ptr()  # inside one part: a view, no copy
    with pytest.raises(IndexError, match="out of range for 10 rows"):
        rows[torch.tensor([10])]
    with pytest.raises(IndexError, match="out of range for 10 rows"):
        rows[-11]
    assert torch.equal(rows[-1], whole[-1]) and torch.equal(rows[0], whole[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_segmented_rows_gather_any_order_as_the_joined_tensor(dtype):
    """A gather from a gallery of many segments (an ascending id list, the re-ranking's, read a slice a part;
    any other order sorted and put back) equals one from the joined tensor: repeats, one part, empty."""
    generator = torch.Generator().manual_seed(0)
    sizes = [50, 1, 0, 7, 30, 2]
    parts = [(torch.randn(n, 8, generator=generator) * 40).to(dtype) for n in sizes]
    rows, whole = SegmentedRows(parts), torch.cat(parts)
    for ids in (
        torch.randint(0, 90, (200,), generator=generator),
        torch.randint(0, 90, (200,), generator=generator).sort().values,
        torch.tensor([89, 0, 50, 50, 51, 57]),
        torch.tensor([10, 3, 44]),  # one part
        torch.tensor([], dtype=torch.long),
    ):
        assert torch.equal(rows[ids], whole[ids]), ids


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_take_gathers_rows_as_indexing_does(dtype):
    """``take`` (``index_select`` for a 1-d id tensor) returns exactly ``rows[index]``: ids in any order and
    repeated, a Boolean mask, a slice, an int, a 2-d id tensor; an id past the end is an IndexError."""
    rows = (torch.arange(40 * 6).reshape(40, 6) % 97 - 48).to(dtype)
    ids = torch.tensor([39, 0, 7, 7, 12])
    for index in (ids, ids.int(), rows[:, 0] > 3, slice(5, 9), 3, ids.reshape(1, 5), ids[:0]):
        got = take(rows, index)
        assert got.dtype == dtype and torch.equal(got, rows[index]), index
    with pytest.raises(IndexError):
        take(rows, torch.tensor([40]))
    scaled = store_rows({"global": rows.float()}, torch.int8)
    expected = scaled["global"][ids].float() * scaled["global_scale"][ids][:, None]
    assert torch.equal(dequantize(scaled, "global", ids), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_dequantized_locates_rows_once_and_reads_every_key_as_dequantize(dtype, monkeypatch):
    """``dequantized`` over segmented rows makes one ``RowPlan`` for all keys (scales included) and returns
    what ``dequantize`` of each key returns, for ascending, unordered and repeated ids and a mask; a plan read
    from rows with other part boundaries is an error, and plain tensors are read as they are."""
    stored = store_rows(_rows(60, 4), dtype)
    sizes = [35, 0, 15, 4, 6]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    segmented = {
        key: SegmentedRows([v[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        for key, v in stored.items()
    }
    plans = []
    original = SegmentedRows.plan
    monkeypatch.setattr(SegmentedRows, "plan", lambda self, flat: plans.append(flat) or original(self, flat))
    mask = torch.arange(60) % 7 == 3
    for ids in (
        torch.tensor([0, 34, 35, 49, 50, 59]),
        torch.tensor([59, 2, 40, 2, 53]),
        torch.arange(60),
        mask,
    ):
        plans.clear()
        got = dequantized(segmented, ["global", "local"], ids)
        assert len(plans) == 1  # located once for global, local and their scales
        for key in ("global", "local"):
            assert torch.equal(got[key], dequantize(stored, key, ids)), (key, ids)
    monkeypatch.undo()
    plan = segmented["global"].plan(torch.tensor([3, 52]))
    assert (
        isinstance(plan, RowPlan) and plan.count == 2 and [piece[0] for piece in plan.pieces] == [0, 2]
    )  # the empty part is dropped
    with pytest.raises(ValueError, match="part boundaries"):
        SegmentedRows([stored["global"][:30], stored["global"][30:]]).read(plan)
    with pytest.raises(TypeError, match="RowPlan is read from SegmentedRows"):
        take(stored["global"], plan)
    for index in (
        torch.tensor(41),
        torch.tensor([], dtype=torch.long),
        torch.tensor([52, 3], dtype=torch.int32),
    ):
        got = dequantized(segmented, ["global"], index)["global"]  # 0-d, empty, int32
        assert torch.equal(got, dequantize(stored, "global", index.long())), index
    plain = dequantized(stored, ["global"], torch.tensor([5, 1]))
    assert torch.equal(plain["global"], dequantize(stored, "global", torch.tensor([5, 1])))
    with pytest.raises(IndexError, match="out of range for 60 rows"):
        dequantized(segmented, ["global"], torch.tensor([1, 60]))


@pytest.fixture(scope="module")
def clustered():
    """Identities with 4 views each and noisy text-like queries: the ranking depends on small differences."""
    g = torch.Generator().manual_seed(3)
    centres = _unit(torch.randn(500, 96, generator=g))
    gallery = _unit(centres.repeat_interleave(4, 0) + 0.08 * torch.randn(2000, 96, generator=g))
    queries = _unit(centres[:200] + 0.12 * torch.randn(200, 96, generator=g))
    split = lambda x: {"global": _unit(x[:, :32]), "local": _unit(x[:, 32:])}  # noqa: E731
    return split(gallery), split(queries)


def _recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    return float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean())


def test_an_int8_store_costs_little_recall_and_half_the_bytes_of_fp16(clustered, tmp_path):
    embeds, query = clustered
    truth = gi.chunked_topk(query, embeds, 10)[1]
    recalls, sizes = {}, {}
    for dtype in ("fp16", "int8"):
        out = tmp_path / dtype
        index_build.index_embeddings(out, embeds, _paths(0, 2000), tmp_path, store_dtype=dtype)
        index = gi.GalleryIndex.load(out, cache=False)
        recalls[dtype] = _recall(index.topk(query, 10)[1], truth)
        sizes[dtype] = sum(f.stat().st_size for f in (out / "segments").iterdir())
        assert json.loads((out / "index.json").read_text())["store_dtype"] == dtype
    assert recalls["fp16"] >= 0.99 and recalls["int8"] >= 0.97  # exact search over the stored rows
    assert 0.5 < sizes["int8"] / sizes["fp16"] < 0.56  # 1 byte a dim + 4-byte scales + fp32 view_probs
    int8 = gi.GalleryIndex.load(tmp_path / "int8", cache=False)
    assert int8.store["global"].dtype == torch.int8 and set(int8.store) >= {"global_scale", "local_scale"}
    rows = int8.row_embeddings([5, 0])
    torch.testing.assert_close(rows["global"], embeds["global"][[5, 0]], atol=0.01, rtol=0)


@pytest.mark.slow
def test_int8_ann_index_grows_merges_and_matches_a_fresh_process(clustered, tmp_path):
    pytest.importorskip("faiss")
    embeds, query = clustered
    out = tmp_path / "idx"
    part = lambda a, b: {k: v[a:b] for k, v in embeds.items()}  # noqa: E731
    index_build.index_embeddings(
        out,
        part(0, 1600),
        _paths(0, 1600),
        tmp_path,
        store_dtype="int8",
        ann="ivf",
        ann_params={"nprobe": 64},
    )
    for start in range(1600, 2000, 100):  # 4 adds: the newest segments merge
        index_build.index_embeddings(out, part(start, start + 100), _paths(start, start + 100), tmp_path)
    index = gi.GalleryIndex.load(out, cache=False)
    assert len(index) == 2000 and index.store["global"].dtype == torch.int8
    scores, found = index.topk(query, 10)
    assert _recall(found, gi.chunked_topk(query, embeds, 10)[1]) >= 0.9
    script = textwrap.dedent(
        f"""
        import json, torch
        from modeling_tagclip.retrieval.embedded import gallery_index as gi
        query = torch.load({str(tmp_path / "q.pt")!r})
        scores, found = gi.GalleryIndex.load({str(out)!r}).topk(query, 10)
        print(json.dumps([scores.tolist(), found.tolist()]))
        """
    )
    torch.save(query, tmp_path / "q.pt")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    fresh_scores, fresh_found = json.loads(done.stdout.strip().splitlines()[-1])
    assert fresh_found == found.tolist() and fresh_scores == scores.tolist()  # same bits in a fresh process


def _write_segments(out, tmp_path, embeds, sizes, dtype="fp16", start=0):
    for size in sizes:
        rows = {k: v[start : start + size] for k, v in embeds.items()}
        index_build.index_embeddings(out, rows, _paths(start, start + size), tmp_path, store_dtype=dtype)
        start += size


def _same_answers(a: gi.GalleryIndex, b: gi.GalleryIndex, query, filters=None) -> None:
    x, y = a.topk(query, 10, filters=filters), b.topk(query, 10, filters=filters)
    assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_a_mapped_index_answers_as_one_read_into_memory(clustered, tmp_path, dtype):
    embeds, query = clustered
    out = tmp_path / "idx"
    _write_segments(out, tmp_path, embeds, [1000, 100, 100], dtype)  # tiers 4, 3, 3: three segments
    mapped = gi.GalleryIndex.load(out, cache=False)
    read = gi.GalleryIndex.load(out, cache=False, mmap=False)
    assert isinstance(mapped.store["global"], SegmentedRows) and isinstance(
        read.store["global"], torch.Tensor
    )
    for key in read.store:
        assert torch.equal(mapped.embeds[key], read.store[key]), key
    for filters in (None, {"view": "aerial"}):
        _same_answers(mapped, read, query, filters)
    mapped.remove(ids=list(range(1000, 1200, 7)))
    _write_segments(out, tmp_path, embeds, [100, 100], dtype, start=1200)  # four of tier 3 merge, purged
    segments = json.loads((out / "manifest.json").read_text())["segments"]
    assert [s["rows"] for s in segments] == [1000, 400] and segments[1].get("purged")
    grown = gi.GalleryIndex.load(out, cache=False)  # the purged segment is read, the other mapped
    again = gi.GalleryIndex.load(out, cache=False, mmap=False)
    _same_answers(grown, again, query)
    assert not set(grown.topk(query, 50)[1].flatten().tolist()) & set(range(1000, 1200, 7))


def test_a_served_mapped_index_maps_only_the_added_segment(clustered, tmp_path):
    embeds, query = clustered
    out = tmp_path / "idx"
    _write_segments(out, tmp_path, embeds, [1000])
    served = gi.GalleryIndex.load(out)
    assert served.store["global"].dtype == torch.float16 and isinstance(served.store["global"], torch.Tensor)
    held = served.store["global"]
    _write_segments(out, tmp_path, embeds, [100], start=1000)
    again = gi.GalleryIndex.load(out)
    assert again is served and isinstance(again.store["global"], SegmentedRows)
    assert again.store["global"].parts[0] is held  # the rows mapped before are kept, not read again
    fresh = gi.GalleryIndex.load(out, cache=False, mmap=False)
    assert torch.equal(again.topk(query, 10)[1], fresh.topk(query, 10)[1])


MEMORY = """
import json, sys, torch
from pathlib import Path
from modeling_tagclip.retrieval.embedded import gallery_index as gi

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no " + field)

before, resident = status("RssAnon"), status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) counts from here
index = gi.GalleryIndex.load(sys.argv[1], cache=False, mmap=sys.argv[2] == "1")
assert index.count() == len(index) and index.row_embeddings([0, len(index) - 1])["local"].shape == (2, 512)
print(json.dumps({"anon": status("RssAnon") - before, "peak": status("VmHWM") - resident}))
"""


@pytest.mark.slow
def test_a_mapped_load_adds_no_copy_of_the_rows_to_anonymous_memory(tmp_path):
    g = torch.Generator().manual_seed(0)
    size = 50_000  # 50k x 768 fp16 = 73 MiB of rows
    rows = {
        "global": _unit(torch.randn(size, 256, generator=g)),
        "local": _unit(torch.randn(size, 512, generator=g)),
    }
    out = tmp_path / "idx"
    index_build.index_embeddings(out, rows, _paths(0, size), tmp_path, store_dtype="fp16")
    store = size * 768 * 2
    added, peak = {}, {}
    for mapped in ("1", "0"):
        done = subprocess.run(
            [sys.executable, "-c", MEMORY, str(out), mapped], capture_output=True, text=True, check=True
        )
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        added[mapped], peak[mapped] = measured["anon"], measured["peak"]
    # read into memory: the rows are anonymous memory, and nothing else of their size (the load's freed
    # buffers are handed back, not kept by the allocator)
    # (margins for a many-core machine: thread stacks and arenas; measured on 2 cores 1.05x, 0.05x and 1.04x)
    assert 0.9 * store < added["0"] < 1.25 * store
    assert added["1"] < 0.25 * store  # mapped: the masks and the database's page cache, never rows nor paths
    assert peak["0"] < 1.5 * store  # reading holds no second copy (file bytes, check temporaries) at any time
