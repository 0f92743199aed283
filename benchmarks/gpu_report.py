"""One command for the GPU measurements of the model path; writes a markdown report.

On a CUDA machine (`--device cuda`, the default when one is present):
- host syncs per image / text forward, counted with `torch.cuda.set_sync_debug_mode("warn")` (eager; the
  value-reading input checks are switched off for the count, as they are under `torch.compile`);
- bf16-autocast vs fp32 parity of the global and TSE embeddings (TSE top-k sets equal, cosines), on a
  checkpoint (`--checkpoint`, e.g. the main job's `best/`) or a random model;
- image-tower time ratio vs `CLIPVisionModel` in bf16 and images/s at batch 64/256/512 (`bench_towers`),
  ViSA images/s at 256x128 (`bench_towers --towers visa`).
Not covered here: end-to-end indexing from JPEG files (`tagclip index`) and training samples/s
(`benchmarks/bench_train_step.py`); run those next to this report.

Without CUDA it runs the CPU-safe parts at tiny sizes (the smoke test does), and says that no GPU ran.

    python benchmarks/gpu_report.py --checkpoint outputs/tagclip-synthetic/best --out benchmarks/gpu_report.md
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def count_host_syncs(fn) -> int | None:
    """Device-to-host syncs of one call (CUDA only: `set_sync_debug_mode("warn")` warns once per sync)."""
    if not torch.cuda.is_available():
        return None
    fn()  # warm-up (lazy init may sync)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def bf16_parity(model: Any, pixels: torch.Tensor) -> dict[str, float]:
    """bf16 autocast vs fp32 image features: TSE top-k sets equal (fraction), TSE and global cosines."""
    device = pixels.device.type
    with torch.no_grad():
        full = model.get_image_features(pixels)
        with torch.autocast(device, dtype=torch.bfloat16):
            low = model.get_image_features(pixels)
    same = (full.tse_indices.sort(-1).values == low.tse_indices.sort(-1).values).all(-1).float().mean()
    tse = F.cosine_similarity(full.local_embeds.float(), low.local_embeds.float())
    glob = F.cosine_similarity(full.pooler_output.float(), low.pooler_output.float())
    return dict(images=pixels.shape[0], tse_topk_same=float(same), tse_cos_min=float(tse.min()),
                tse_cos_median=float(tse.median()), global_cos_min=float(glob.min()))  # fmt: skip


def load_or_build(checkpoint: str | None, device: torch.device) -> Any:
    from modeling_tagclip import TagClipConfig, TagClipModel

    if checkpoint:
        return TagClipModel.from_pretrained(checkpoint).to(device).eval()
    vision = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  image_size=[64, 32], patch_size=8, moe_layers=[1, 2])  # fmt: skip
    text = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    return TagClipModel(TagClipConfig(vision_config=vision, text_config=text)).to(device).eval()


def sync_rows(model: Any, device: torch.device) -> dict[str, int | None]:
    vision, text = model.config.vision_config, model.config.text_config
    pixels = torch.randn(8, 3, *vision.image_hw, device=device)
    ids = torch.zeros(8, text.max_position_embeddings, dtype=torch.long, device=device)
    ids[:, 0], ids[:, 1], ids[:, 2] = text.bos_token_id, 1, text.eos_token_id
    model.vision_model.embeddings.check_pixel_values = lambda pixels: None  # eager-only value checks

    def image():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model.get_image_features(pixels)

    def text_forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model.get_text_features(ids)

    return {"image forward": count_host_syncs(image), "text forward": count_host_syncs(text_forward)}


def tower_rows(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    from benchmarks import bench_towers

    common = ["--device", str(device), "--memory", "off", "--layer-batch", "0", "--output", "/dev/null"]
    if quick:
        return bench_towers.main(["--quick", "--repeats", "1", "--batch-sizes", "2", *common])["rows"]
    rows = bench_towers.main(["--dtype", "bf16", "--batch-sizes", "64", "256", "512", "--towers", "hrmoe",
                              *common])["rows"]  # fmt: skip
    return rows + bench_towers.main(["--towers", "visa", "--dtype", "bf16", "--batch-sizes", "64", *common])["rows"]


def markdown(device: torch.device, syncs: dict, parity: dict, towers: list[dict], checkpoint: str | None) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    lines = ["# GPU report", "", f"Device: {gpu or 'no GPU: CPU-safe parts only (tiny sizes), not GPU figures'}", ""]
    lines += ["## Host syncs per forward (bf16, eager)", ""]
    lines += [f"- {name}: {'n/a (no CUDA)' if n is None else n}" for name, n in syncs.items()]
    lines += ["", f"## bf16 vs fp32 ({checkpoint or 'random model'})", ""]
    lines += [f"- {key}: {value:.6g}" for key, value in parity.items()]
    lines += ["", "## Towers", "", "| tower | batch | images/s | ratio vs baseline | FLOP-ideal | overhead |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for row in towers:
        lines.append(f"| {row['tower']} | {row['batch']} | {row['images_per_s']:.1f} | {row['ratio_vs_baseline']:.3f} "
                     f"| {row['flop_ideal_ratio']:.3f} | {row['overhead']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "gpu_report.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    quick = device.type != "cuda"
    model = load_or_build(args.checkpoint, device)
    h, w = model.config.vision_config.image_hw
    parity = bf16_parity(model, torch.randn(64 if quick else 512, 3, h, w, device=device))
    report = markdown(device, sync_rows(model, device), parity, tower_rows(device, quick), args.checkpoint)
    args.out.write_text(report)
    print(report)
    return report


if __name__ == "__main__":
    main()
