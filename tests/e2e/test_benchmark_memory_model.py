"""The serving memory model (``benchmarks/memory_model.py``): its bytes a row follow the stored format, and it
predicts every committed serving measurement of 100k crops or more within its stated tolerance."""

from __future__ import annotations

import pytest
import torch

from benchmarks import memory_model as mm
from modeling_tagclip.retrieval.embedded.row_store import STORE_DTYPES, store_rows


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_store_bytes_a_row_are_those_a_segment_stores(dtype):
    rows = {"global": torch.randn(3, mm.GLOBAL_DIM), "local": torch.randn(3, mm.LOCAL_DIM)}
    rows["view_probs"] = torch.rand(3, mm.VIEWS)
    stored = store_rows(rows, STORE_DTYPES[dtype])
    assert sum(v.numel() * v.element_size() for v in stored.values()) / 3 == mm.store_bytes(dtype)


def test_the_model_predicts_the_measured_serving_memory_within_tolerance():
    checked = mm.check(mm.measured_rows())
    assert {row["size"] for row in checked} >= {100_000, 300_000}  # the committed measurements
    for row in checked:
        assert abs(row["model_over_measured"] - 1) <= mm.TOLERANCE, row


def test_ten_million_crops_fit_in_32_gib_only_with_the_store_mapped_or_int8():
    gib = {(r["size"], r["store"]): r for r in mm.table()}
    assert gib[(10_000_000, "fp16")]["anon_gib"] > 29  # read into memory: about 30 GiB anonymous
    assert gib[(10_000_000, "fp16 mapped")]["anon_gib"] < 2  # mapped: the store is file pages
    assert gib[(10_000_000, "int8")]["all_resident_gib"] < 17  # int8: everything resident in 17 GiB
