"""Index segment I/O: tensors written streamed and read back in one hashed pass (no bytes copy beside the
tensors), every corruption a GalleryIndexError, never a huge allocation from a forged header."""

from __future__ import annotations

import json

import pytest
import torch

from modeling_tagclip.retrieval.embedded.gallery_index import _concat
from modeling_tagclip.retrieval.embedded.index_store import GalleryIndexError, read_tensors, write_tensors


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


def test_segments_are_joined_in_order():
    parts = [_tensors(), {k: v[:3] for k, v in _tensors().items()}]
    expected = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    joined = _concat(list(parts))
    assert all(torch.equal(joined[k], expected[k]) for k in expected)
    single = _tensors()
    assert _concat([single]) is single and _concat([]) == {}
