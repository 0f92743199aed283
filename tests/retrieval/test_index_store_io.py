"""Index segment I/O: tensors written streamed and read back in one hashed pass (no bytes copy beside the
tensors), every corruption a GalleryIndexError, never a huge allocation from a forged header."""

from __future__ import annotations

import json

import pytest
import torch

from modeling_tagclip.retrieval.embedded.gallery_index import _concat
from modeling_tagclip.retrieval.embedded.index_store import (
    GalleryIndexError,
    map_tensors,
    read_tensors,
    write_tensors,
)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "global": torch.randn(7, 5, generator=g),
        "local": torch.randn(7, 3, generator=g).half(),
        "view_probs": torch.rand(7, 2, generator=g).bfloat16(),
    }


def test_round_trip_every_dtype(tmp_path):
    tensors = _tensors()
    record = write_tensors(tmp_path / "seg.safetensors", tensors)
    back = read_tensors(tmp_path / "seg.safetensors", record["sha256"], 7)
    assert record["rows"] == 7 and set(back) == set(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    with pytest.raises(GalleryIndexError, match="does not hold the 8 rows"):
        read_tensors(tmp_path / "seg.safetensors", record["sha256"], 8)


@pytest.mark.parametrize("damage", ["flip_data", "truncate", "append", "huge_shape", "bad_json", "missing"])
def test_every_corruption_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "seg.safetensors"
    record = write_tensors(path, _tensors())
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    if damage == "flip_data":
        data[-3] ^= 0xFF
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "append":
        data += b"\x00"
    elif damage == "huge_shape":  # a forged header must not make the reader allocate 2^60 floats
        header = json.loads(data[8 : 8 + size])
        header["global"]["shape"] = [2**30, 2**30]
        body = json.dumps(header).encode().ljust(size)[:size]
        data = data[:8] + body + data[8 + size :]
    elif damage == "bad_json":
        data[8:12] = b"\xff\xfe{["
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(bytes(data))
    with pytest.raises(GalleryIndexError, match="corrupt|missing or unreadable"):
        read_tensors(path, record["sha256"], 7)
    with pytest.raises(GalleryIndexError, match="corrupt|missing or unreadable"):
        map_tensors(path, record["sha256"], 7)


def test_segments_are_joined_in_order_one_at_a_time():
    parts = [_tensors(), {k: v[:3] for k, v in _tensors().items()}]
    expected = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    produced = []

    def lazily():  # the second segment is read only after the first is copied: never both beside the buffer
        for part in parts:
            produced.append(len(produced))
            yield part

    joined = _concat(lazily(), 10)
    assert all(torch.equal(joined[k], expected[k]) for k in expected) and produced == [0, 1]
    single = _tensors()
    assert _concat(iter([single]), 7) is single and _concat(iter([]), 0) == {}


def test_mapped_tensors_equal_the_read_ones_and_flag_non_finite_rows(tmp_path):
    tensors = _tensors()
    tensors["global"][4, 2] = float("nan")
    tensors["local"][6, 0] = float("inf")
    record = write_tensors(tmp_path / "seg.safetensors", tensors)
    mapped, bad = map_tensors(tmp_path / "seg.safetensors", record["sha256"], 7)
    read = read_tensors(tmp_path / "seg.safetensors", record["sha256"], 7)
    assert set(mapped) == set(read)
    for key, value in read.items():
        assert mapped[key].dtype == value.dtype and torch.equal(mapped[key].nan_to_num(), value.nan_to_num())
    assert bad.tolist() == [False, False, False, False, True, False, True]
    with pytest.raises(GalleryIndexError, match="does not hold the 8 rows"):
        map_tensors(tmp_path / "seg.safetensors", record["sha256"], 8)


def test_mapped_tensors_are_copy_on_write_and_outlive_the_mapping_object(tmp_path):
    import gc

    path = tmp_path / "seg.safetensors"
    record = write_tensors(path, _tensors())
    before = path.read_bytes()
    mapped, _ = map_tensors(path, record["sha256"], 7)
    gc.collect()  # the mmap object is referenced only by the tensors' storage
    expected = _tensors()["global"]
    assert torch.equal(mapped["global"], expected)
    mapped["global"][0] = 42.0  # a write stays in this process: the file is unchanged
    assert path.read_bytes() == before and torch.equal(
        read_tensors(path, record["sha256"], 7)["global"], expected
    )


def test_mapping_reads_in_chunks_across_row_boundaries(tmp_path, monkeypatch):
    from modeling_tagclip.retrieval.embedded import index_store

    monkeypatch.setattr(
        index_store, "MAP_CHUNK_BYTES", 24
    )  # 1 row of 5 fp32 a chunk: many chunks, a short last
    tensors = {
        "global": torch.arange(35.0).reshape(7, 5),
        "local": torch.arange(21).reshape(7, 3).to(torch.int8),
    }
    tensors["global"][3, 1] = float("-inf")
    record = write_tensors(tmp_path / "seg.safetensors", tensors)
    mapped, bad = map_tensors(tmp_path / "seg.safetensors", record["sha256"], 7)
    assert torch.equal(mapped["local"], tensors["local"]) and bad.nonzero().squeeze(1).tolist() == [3]
