"""The main job's CLIP pre-training phase at several initial similarity scales (`pretrain_clip.
logit_scale_init_value`): per seed, the epoch its loss leaves the chance plateau, its last-epoch loss and the
plain CLIP's zero-shot test R@1 (global features, text to image). Measures why the `default` recipe sets ln 50.

    python benchmarks/bench_pretrain_scale.py                      # scales 14.3 and 50, seeds 0 1 2
    python benchmarks/bench_pretrain_scale.py --scales 50 --seeds 0 --epochs 2   # a smoke run

Each run is `pretrain_clip` as the main job calls it (the recipe's epochs, batch size, learning rate; fused
AdamW, longest padding) on `data/synthetic`'s training split. Writes benchmarks/results/pretrain_scale.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, write_json  # noqa: E402

# Leaving the plateau: the epoch's mean loss is this far under chance, ln(batch size).
PLATEAU_MARGIN = 0.1


def zero_shot_r1(model, processor, rows) -> float:
    """Text-to-image R@1 (percent) of a plain ``CLIPModel`` on ``rows`` (image_path, person_id, captions)."""
    from PIL import Image

    from modeling_tagclip.metrics.retrieval import retrieval_metrics

    def features(output) -> torch.Tensor:
        return torch.nn.functional.normalize(getattr(output, "pooler_output", output), dim=-1)

    captions = [(caption, row["person_id"]) for row in rows for caption in row["captions"]]
    with torch.inference_mode():
        images = processor(images=[Image.open(row["image_path"]).convert("RGB") for row in rows])
        image = features(
            model.get_image_features(pixel_values=images["pixel_values"], interpolate_pos_encoding=True)
        )
        text = processor(text=[c for c, _ in captions], padding="longest", truncation=True)
        text = features(
            model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
        )
    metrics = retrieval_metrics(text @ image.T, [i for _, i in captions], [row["person_id"] for row in rows])
    return metrics["R@1"]


def run(scale: float, seed: int, cfg, splits, epochs: int) -> dict[str, Any]:
    """One pre-training run at similarity scale ``scale``; its row."""
    from transformers import CLIPModel

    from modeling_tagclip import TagClipProcessor
    from modeling_tagclip.engine.tasks.clip_pretraining import clip_config, epoch_losses, pretrain_clip

    pc = cfg.pretrain_clip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = pretrain_clip(
            splits.train,
            clip_config(cfg.model, cfg.image_size, math.log(scale)),
            Path(tmp),
            cfg.image_size,
            epochs=epochs,
            batch_size=pc.batch_size,
            lr=pc.learning_rate,
            seed=seed,
            fast=True,
            settings={"num_threads": torch.get_num_threads()},
        )
        losses = [round(loss, 4) for loss in epoch_losses(tmp)]
        model = CLIPModel.from_pretrained(hf_dir).eval()
    wall = time.perf_counter() - start
    chance = math.log(min(pc.batch_size, len(splits.train)))
    left = next((epoch for epoch, loss in enumerate(losses) if loss < chance - PLATEAU_MARGIN), None)
    processor = TagClipProcessor.from_defaults(*(int(v) for v in cfg.image_size))
    return {
        "scale": round(scale, 1),
        "seed": seed,
        "plateau_left_epoch": left,
        "final_loss": losses[-1],
        "chance_loss": round(chance, 4),
        "zero_shot_R@1": zero_shot_r1(model, processor, splits.test),
        "epoch_losses": losses,
        "wall_s": round(wall, 1),
    }


def mean_row(scale: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean ± 95% Student-t half-width of a scale's last-epoch loss and zero-shot R@1 over its seeds."""
    from modeling_tagclip.ablation import mean_ci

    row: dict[str, Any] = {"scale": round(scale, 1), "seed": "mean ± 95% CI"}
    for key in ("final_loss", "zero_shot_R@1"):
        stats = mean_ci([r[key] for r in rows])
        row[key] = f"{stats['mean']:.2f} ± {stats['ci95']:.2f}" if len(rows) > 1 else f"{stats['mean']:.2f}"
    return row


def main(argv: list[str] | None = None) -> Path:
    from modeling_tagclip.engine.cli import load_config, make_task

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scales",
        type=float,
        nargs="+",
        default=[1 / 0.07, 50.0],
        help="initial similarity scales (not their logs)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's pretrain_clip.epochs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "pretrain_scale.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config()
    task = make_task(cfg)
    task.prepare()
    epochs = args.epochs or cfg.pretrain_clip.epochs
    rows = []
    for scale in args.scales:
        for seed in args.seeds:
            rows.append(run(scale, seed, cfg, task.splits, epochs))
            print({k: v for k, v in rows[-1].items() if k != "epoch_losses"}, flush=True)
    rows += [mean_row(scale, [r for r in rows if r["scale"] == round(scale, 1)]) for scale in args.scales]
    payload = {
        "benchmark": "pretrain_scale",
        "epochs": epochs,
        "batch_size": cfg.pretrain_clip.batch_size,
        "learning_rate": cfg.pretrain_clip.learning_rate,
        "torch_threads": torch.get_num_threads(),
        "plateau_margin": PLATEAU_MARGIN,
        "rows": rows,
    }
    path = write_json(args.output, payload)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
