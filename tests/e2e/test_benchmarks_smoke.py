"""Benchmarks: each script runs end to end with `--quick` and writes valid JSON; helpers are exact.

Timings are not asserted (shared CPU); the MAC counter is checked against a hand count (TAG-CLIP) and forward
hooks (ViSA), `chunked_topk` against a full top-k.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from fixtures import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import bench_search, bench_towers, bench_train_step
from benchmarks.common import chunked_topk, visa_macs, vision_tower_macs
from modeling_tagclip.retrieval.embedded import ann as annlib


@pytest.fixture(autouse=True)
def keep_threads():
    """The scripts' --threads changes torch's global thread count: restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def load_rows(path) -> list[dict]:
    payload = json.loads(path.read_text())
    assert payload["machine"]["cpu"] and payload["rows"]
    return payload["rows"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_towers_quick(tmp_path):
    out = tmp_path / "towers.json"
    bench_towers.main(
        [
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--batch-sizes",
            "2",
            "--towers",
            "vit",
            "hrmoe",
            "hrmoe-dense",
            "--peak-tflops",
            "0.5",
            "--output",
            str(out),
        ]
    )
    rows = load_rows(out)
    assert [r["tower"] for r in rows] == ["clip", "vit", "hrmoe", "hrmoe-dense"]
    for r in rows:  # MFU = 2 x executed MACs per second / peak FLOPs
        macs = (r["gmacs_linear"] + r["gmacs_attention_matmul"]) * 1e9
        assert r["mfu"] == pytest.approx(2 * macs / r["median_s"] / 0.5e12, rel=1e-6)
    by_tower = {r["tower"]: r for r in rows}
    assert by_tower["clip"]["flop_ideal_ratio"] == 1.0
    hrmoe, dense = by_tower["hrmoe"]["flop_ideal_ratio"], by_tower["hrmoe-dense"]["flop_ideal_ratio"]
    assert dense > hrmoe > 2  # dense dispatch runs all experts
    assert all(r["images_per_s"] > 0 and r["memory_peak_mib"] is not None for r in rows)
    assert {r["dispatch"] for r in json.loads(out.read_text())["moe_layer"]} >= {"sparse", "dense"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_towers_quick_visa(tmp_path):
    """Tiny ViSA (32x16, patch 8 / stride 6 = 5x2 patches) and its trunk vs the overlapping-patch ViTModel."""
    out = tmp_path / "visa.json"
    bench_towers.main(
        [
            "--quick",
            "--threads",
            "1",
            "--repeats",
            "1",
            "--batch-sizes",
            "2",
            "--towers",
            "visa",
            "visa-vit",
            "--output",
            str(out),
        ]
    )
    rows, payload = load_rows(out), json.loads(out.read_text())
    assert payload["baseline"] == "hf-vit" and payload["moe_layer"] == []
    assert payload["config"]["grid_size"] == [5, 2] and payload["config"]["gflops_paper"] > 0
    assert [r["tower"] for r in rows] == ["hf-vit", "visa", "visa-vit"]
    by_tower = {r["tower"]: r for r in rows}
    assert by_tower["hf-vit"]["ratio_vs_baseline"] == by_tower["visa-vit"]["flop_ideal_ratio"] == 1.0
    assert by_tower["visa"]["flop_ideal_ratio"] > 1  # the trunk plus view token, experts, GCN and fusion
    assert all(r["baseline"] == "hf-vit" for r in rows)
    assert all(r["images_per_s"] > 0 and r["memory_peak_mib"] is not None for r in rows)


def test_towers_of_both_families_are_refused():
    with pytest.raises(SystemExit):
        bench_towers.parse_args(["--towers", "hrmoe", "visa"])


def hooked_linear_macs(model: torch.nn.Module, inputs: dict, monkeypatch) -> int:
    """Linear + Conv2d MACs of one forward, counted by forward hooks on the executed modules, plus the grouped
    GEMMs of the routed experts (rows x in x out)."""
    from modeling_tagclip.models.visa import modeling_visa

    total = []

    def count(module, _, out):
        fan_in = module.in_features if isinstance(module, torch.nn.Linear) else module.weight[0].numel()
        total.append(out.numel() * fan_in)

    def grouped(inputs, layers, experts, offsets):
        total.append(inputs.shape[0] * layers[0].in_features * layers[0].out_features)
        return grouped_linear(inputs, layers, experts, offsets)

    grouped_linear = modeling_visa.grouped_linear
    monkeypatch.setattr(modeling_visa, "grouped_linear", grouped)
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    handles = [layer.register_forward_hook(count) for layer in layers]
    with torch.inference_mode():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return sum(total)


@pytest.mark.parametrize("name", ["visa", "visa-vit", "hf-vit"])
def test_visa_macs_match_forward_hooks(name, monkeypatch):
    """`visa_macs` (tiny ViSA, a mixed-view batch: both view branches run) = the Linear/Conv MACs executed,
    but for the view routers: both run on every image (D x E MACs each) so no per-view subset is needed."""
    model = bench_towers.build_tower(name, "tiny")
    inputs = bench_towers.make_inputs(name, 3, "tiny", torch.device("cpu"))
    counted = bench_towers.tower_macs(name, model, inputs["pixel_values"], "tiny")
    config = model.config if name == "visa" else None
    both_routers = 3 * config.hidden_size * config.num_experts if config is not None else 0
    assert counted["linear"] + both_routers == hooked_linear_macs(model, inputs, monkeypatch)
    config = bench_towers.visa_config(name if name != "hf-vit" else "visa-vit", "tiny")
    assert counted == visa_macs(config, 3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_train_step_quick(tmp_path):
    out = tmp_path / "train.json"
    bench_train_step.main(["--quick", "--threads", "1", "--repeats", "1", "--output", str(out)])
    rows = load_rows(out)
    assert [r["variant"] for r in rows] == ["eager", "eager+ckpt"]
    assert all(r["samples_per_s"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_search_quick(tmp_path):
    out = tmp_path / "search.json"
    bench_search.main(["--quick", "--threads", "1", "--output", str(out)])
    rows = load_rows(out)
    exact = next(r for r in rows if r["method"] == "exact")
    assert exact["recall"] == 1.0 and exact["ms_per_query_b1"] > 0
    if bench_search.faiss is not None:
        assert {"ann_global", "ann_combined"} <= {r["method"] for r in rows}
        ann = [r for r in rows if r["method"] == "ann_combined"]
        assert [r["params"] for r in ann] == ["preset", "tuned"]
        # the preset row runs the k_factor the index calibrated at build time
        assert ann[0]["k_factor"] in annlib.CALIBRATION_K_FACTORS and "calibration_recall_proxies" in ann[0]
        assert all(
            0.0 <= r["recall"] <= 1.0 and r["ann_index_mib"] > 0 for r in rows if r["method"] != "exact"
        )


def test_bench_search_keep_refuses_a_folder_holding_a_size(tmp_path, capsys):
    """An index folder left there would get the new rows appended: refused before anything runs."""
    assert bench_search.parse_args(["--quick", "--keep", str(tmp_path)]).keep == str(tmp_path)
    (tmp_path / "4096").mkdir()
    with pytest.raises(SystemExit):
        bench_search.parse_args(["--quick", "--keep", str(tmp_path)])
    assert f"{tmp_path / '4096'} already exist" in capsys.readouterr().err


def test_vision_tower_macs_hand_count():
    """Tiny tower: D=32, I=48, 4 blocks, 32x16 image / patch 8 = 8 patches, HR-MoE in blocks 1-2, batch 2."""
    config = tiny_config().vision_config
    pairs = 2 * 10 * 5  # 2 images x (CLS + 8 patches + view) tokens x 5 experts each
    macs = vision_tower_macs(config, batch=2, executed_experts=[pairs, pairs])
    patch = 2 * 8 * (3 * 8 * 8) * 32
    block0 = 4 * 20 * 32 * 32 + 2 * 20 * 32 * 48  # view token present: 20 tokens
    moe_block = 4 * 20 * 32 * 32 + 2 * pairs * 32 * 48 + 20 * 32 * 6 + 2 * 32 * 2  # + routers
    block3 = 4 * 18 * 32 * 32 + 2 * 18 * 32 * 48  # view token dropped after the last MoE block
    assert macs["linear"] == patch + block0 + 2 * moe_block + block3 == 1_156_864
    assert macs["attention_matmul"] == 3 * 2 * 2 * 10 * 10 * 32 + 2 * 2 * 9 * 9 * 32

    vit = tiny_config(vision=dict(block_type="vit", use_view_token=False)).vision_config
    assert vision_tower_macs(vit, batch=2)["linear"] == patch + 4 * (4 * 18 * 32 * 32 + 2 * 18 * 32 * 48)
    with pytest.raises(ValueError):
        vision_tower_macs(config, batch=2)


def test_tower_macs_reads_the_expert_mask():
    """Argmax HR-MoE with top-5 of a 5-expert group: every token of every image runs 5 experts."""
    from modeling_tagclip.models.tagclip.modeling_tagclip import TagClipVisionModel

    model = TagClipVisionModel(tiny_config().vision_config).eval()
    pixels = torch.randn(3, 3, 32, 16)
    assert bench_towers.executed_expert_pairs(model, pixels) == [3 * 10 * 5] * 2


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_topk_matches_full_topk(chunk):
    generator = torch.Generator().manual_seed(0)
    queries, gallery = torch.randn(5, 16, generator=generator), torch.randn(300, 16, generator=generator)
    scores, index = chunked_topk(queries, gallery, 10, chunk)
    full = (queries @ gallery.T).topk(10, dim=1)
    torch.testing.assert_close(scores, full.values)
    assert torch.equal(index, full.indices)
    assert chunked_topk(queries, gallery[:4], 10, chunk)[1].shape == (5, 4)
    with pytest.raises(ValueError):
        chunked_topk(queries, gallery[:, :8], 10, chunk)
