"""benchmarks/gpu_report.py without a GPU: every section runs at tiny sizes on the CPU, carries real numbers,
names the script that measured it, and is labelled as not a GPU figure."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import bench_index, gpu_report

NOT_GPU = "(CPU, smoke-run sizes: NOT GPU figures)"


@pytest.fixture(autouse=True)
def keep_threads():
    """The bench scripts' --threads changes torch's global thread count: restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def sections(report: str) -> dict[str, str]:
    """Section heading (without its label) -> the section's text."""
    parts = re.split(r"^## ", report, flags=re.M)[1:]
    return {part.splitlines()[0].split(" (")[0]: part for part in parts}


def bullets(section: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"^- (\w+): ([-\d.e+]+)$", section, flags=re.M)}


def table(section: str) -> list[list[str]]:
    """Body rows of the section's markdown table (header and separator dropped)."""
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]


@pytest.mark.timeout(300)
def test_cpu_report_covers_every_section_with_real_numbers(tmp_path, data_dir, model_dir):
    out, raw = tmp_path / "report.md", tmp_path / "raw"
    argv = [
        "--device",
        "cpu",
        "--checkpoint",
        str(model_dir),
        "--data",
        str(data_dir),
        "--limit",
        "12",
        "--out",
        str(out),
        "--raw-dir",
        str(raw),
    ]
    report = gpu_report.main(argv)
    assert out.read_text() == report
    assert "**No GPU ran.**" in report and "no CUDA" in report and f"torch {torch.__version__}" in report
    assert f"- Command: `python benchmarks/gpu_report.py {' '.join(argv)}`" in report
    found = sections(report)
    assert list(found) == [
        "bf16 autocast vs fp32 embeddings",
        "Host syncs per forward, bf16, eager, batch 8",
        "Image towers, bf16 autocast",
        "Gallery encoding from JPEG files, bf16",
        "Training step, full loss, bfloat16 autocast, 1 device",
    ]
    # no CPU number can pass for a GPU figure: every heading says what ran
    assert all(part.splitlines()[0].endswith(NOT_GPU) for part in found.values())

    parity = bullets(found["bf16 autocast vs fp32 embeddings"])
    assert parity["images"] == 12 and parity["captions"] >= 12  # real images and their captions
    for side in ("image", "text"):
        assert 0.5 <= parity[f"{side}_tse_sets_equal"] <= 1
        for kind in ("tse", "global"):
            assert 0.98 < parity[f"{side}_{kind}_cos_min"] <= 1 + 1e-6
    assert "- image forward: n/a (no CUDA)" in found["Host syncs per forward, bf16, eager, batch 8"]

    towers = found["Image towers, bf16 autocast"]
    assert "bench_towers.py --quick" in towers
    rows = {row[0]: row for row in table(towers)}
    assert set(rows) == {"clip", "hrmoe", "hf-vit", "visa"}
    assert all(float(row[2]) > 0 and row[6] == "n/a (no known peak)" for row in rows.values())

    index = found["Gallery encoding from JPEG files, bf16"]
    assert "bench_index.py --tiny" in index and "--dtype bf16" in index
    [[forward, end_to_end, ratio]] = table(index)
    [measured] = json.loads((raw / "index.json").read_text())["rows"]  # what bench_index wrote
    assert measured["forward_img_s"] > 0 and measured["index_img_s"] > 0
    assert float(forward) == pytest.approx(measured["forward_img_s"], abs=0.05)
    assert float(end_to_end) == pytest.approx(measured["index_img_s"], abs=0.05)
    assert measured["ratio"] == pytest.approx(measured["index_img_s"] / measured["forward_img_s"], abs=2e-3)
    assert float(ratio) == pytest.approx(measured["ratio"], abs=5e-4)
    minutes = float(re.search(r"1M crops in ([\d.]+) min", index)[1])
    assert minutes == pytest.approx(1e6 / measured["index_img_s"] / 60, abs=0.05)
    assert "Extrapolation (not measured at 1M)" in index

    train = found["Training step, full loss, bfloat16 autocast, 1 device"]
    assert "bench_train_step.py --quick" in train and "DDP: not applicable" in train
    assert [row[0] for row in table(train)] == ["eager", "eager+ckpt"]
    assert all(float(row[2]) > 0 for row in table(train))

    index_json = json.loads((raw / "index.json").read_text())
    assert index_json["dtype"] == "bf16" and index_json["rows"][0]["workers"] == 1
    kept = {"index.json", "towers_hrmoe.json", "towers_visa.json", "train_step.json"}
    assert {p.name for p in raw.iterdir()} == kept


@pytest.mark.timeout(120)
def test_random_pixel_parity_without_data(tmp_path):
    report = gpu_report.main(["--device", "cpu", "--out", str(tmp_path / "r.md")])
    parity = bullets(sections(report)["bf16 autocast vs fp32 embeddings"])
    assert "Inputs: random pixels" in report and "captions" not in parity
    assert parity["images"] == 64 and 0.9 <= parity["image_tse_sets_equal"] <= 1
    assert 0.99 < parity["image_tse_cos_min"] <= 1 + 1e-6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "data/synthetic"], "--data needs --checkpoint"),
        (["--limit", "0"], "--limit: must be a positive integer"),
        (["--workers", "-1"], "--workers: must be a non-negative integer"),
        (["--device", "cuda:7"], "this machine has"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_report.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bench_index_refuses_the_cpu_clock_on_cuda(capsys):
    with pytest.raises(SystemExit):
        bench_index.main(["--device", "cuda", "--clock", "cpu"])
    assert "--clock cpu does not time GPU work" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, model, peak",
    [
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5),
        ("NVIDIA H200", "H200 SXM", 989.4),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5),
        ("NVIDIA GH200 480GB", "GH200 (Grace Hopper)", 989.4),
        ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
        ("NVIDIA T4", None, None),
    ],
)
def test_the_peak_is_the_exact_gpu_models(name, model, peak, monkeypatch):
    from benchmarks import common

    assert common.gpu_peak(name) == (None if model is None else (model, peak))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert common.peak_bf16_tflops(torch.device("cuda")) == peak
    line = gpu_report.peak_line(torch.device("cuda"), None)
    assert (
        (f"{peak:g} TFLOPS dense bf16, the {model}'s" in line)
        if model
        else "none known for `NVIDIA T4`" in line
    )


def test_a_given_peak_wins_and_the_cpu_has_none():
    assert (
        gpu_report.peak_line(torch.device("cuda"), 500.0)
        == "- MFU peak: 500 TFLOPS dense bf16 (`--peak-tflops`)."
    )
    assert gpu_report.peak_line(torch.device("cpu"), None) == "- MFU peak: none (no GPU)."
