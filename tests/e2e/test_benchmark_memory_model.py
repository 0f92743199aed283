"""The serving memory model (``benchmarks/memory_model.py``): its bytes a row follow the stored format, and it
predicts every committed serving measurement of 100k crops or more within its stated tolerance."""

from __future__ import annotations

import pytest
import torch

from benchmarks import memory_model as mm
from benchmarks.scaling_plot import STORE_MODES
from modeling_tagclip.retrieval.embedded.row_store import STORE_DTYPES, store_rows


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_store_bytes_a_row_are_those_a_segment_stores(dtype):
    rows = {"global": torch.randn(3, mm.GLOBAL_DIM), "local": torch.randn(3, mm.LOCAL_DIM)}
    rows["view_probs"] = torch.rand(3, mm.VIEWS)
    stored = store_rows(rows, STORE_DTYPES[dtype])
    assert sum(v.numel() * v.element_size() for v in stored.values()) / 3 == mm.store_bytes(dtype)


def test_the_model_predicts_the_measured_serving_memory_within_tolerance():
    checked = mm.check(mm.measured_rows())
    assert {row["size"] for row in checked} >= {100_000, 300_000, 1_000_000}  # the committed measurements
    for row in checked:
        assert row["within"], row
        if row["mapped"]:  # the queries touch at most the whole store file (plus a few pages of code)
            assert row["measured_file_mib"] <= row["store_file_mib"] + mm.SLACK_MIB, row


def test_the_store_modes_file_when_committed_covers_mapped_and_int8():
    if not (mm.RESULTS_DIR / mm.MODES_FILE).is_file():
        pytest.skip(f"{mm.MODES_FILE} is not measured yet: `{STORE_MODES[1]}` writes it")
    checked = {(r["size"], r["store_dtype"], r["mapped"]) for r in mm.check(mm.measured_rows())}
    assert {(100_000, "fp16", True), (100_000, "int8", True), (100_000, "int8", False)} <= checked


def _row(size, dtype, mapped, rss, anon=None, file=None):
    row = {"size": size, "ann": "PCA128,IVF1024,PQ128x4fsr", "store_dtype": dtype, "mapped": mapped}
    row |= {"added_rss_mib": rss}
    return row | ({"added_anon_mib": anon, "added_file_mib": file} if anon is not None else {})


def test_check_compares_the_anonymous_part_and_reports_a_miss():
    model = {
        (dtype, mapped): mm.predict(100_000, dtype, mapped, 1024)["total"] / 2**20
        for dtype in ("fp16", "int8")
        for mapped in (False, True)
    }
    assert model[("fp16", True)] == model[("int8", True)] < 20 < 150 < model[("int8", False)] < 170
    rows = [
        _row(100_000, "fp16", True, rss=300.0),  # mapped, no anonymous part recorded: not checkable
        _row(100_000, "fp16", True, rss=300.0, anon=model[("fp16", True)] + 7, file=290.0),  # within 8 MiB
        _row(100_000, "int8", False, rss=500.0, anon=model[("int8", False)] * 1.09, file=4.0),
        _row(100_000, "int8", False, rss=500.0, anon=model[("int8", False)] * 1.2, file=4.0),
        _row(100_000, "fp16", False, rss=model[("fp16", False)] * 0.95),  # an old row: its RSS
        _row(50_000, "fp16", False, rss=1.0),  # below min_size
    ]
    checked = mm.check(rows)
    assert [(r["store_dtype"], r["mapped"], r["within"]) for r in checked] == [
        ("fp16", True, True),
        ("int8", False, True),
        ("int8", False, False),
        ("fp16", False, True),
    ]
    assert checked[0]["measured_file_mib"] == 290.0 and checked[0]["store_file_mib"] == pytest.approx(
        100_000 * mm.store_bytes("fp16") / 2**20, abs=0.1
    )


def test_ten_million_crops_fit_in_32_gib_only_with_the_store_mapped_or_int8():
    gib = {(r["size"], r["store"]): r for r in mm.table()}
    assert gib[(10_000_000, "fp16")]["anon_gib"] > 29  # read into memory: about 30 GiB anonymous
    assert gib[(10_000_000, "fp16 mapped")]["anon_gib"] < 2  # mapped: the store is file pages
    assert gib[(10_000_000, "int8")]["all_resident_gib"] < 17  # int8: everything resident in 17 GiB
