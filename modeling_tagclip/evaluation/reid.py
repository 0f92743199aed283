"""Evaluate a ViSA model on an image re-ID dataset: every protocol of the dataset, results JSON, retrieval grid.

Features are the model's test embedding (``pooler_output``: concat(BNNeck(z_inv), BNNeck(f_loc))) computed
with the view label of each image (from its camera); ranking is by cosine distance with fast-reid's
same-camera filtering (``modeling_tagclip.metrics.reid``, exact and streamed: no query x gallery matrix is
kept). The report names the dataset as loaded (``--dataset`` or the detected layout; the synthetic set by its
``dataset_info.json``). No flip test or query expansion (reference); k-reciprocal re-ranking with ``--rerank``.

Usage::

    tagclip eval --task reid --model outputs/visa-synthetic/best --data data/synthetic_reid \
        --output outputs/visa-synthetic/reid_results.json --grid outputs/visa-synthetic/reid_grid.png
    tagclip eval --task reid --model converted/visa-cargo --data datasets/ --dataset cargo --output r.json

Like ``modeling_tagclip.evaluation.text_retrieval``, it prints the results and writes files only where told
(``--output``, ``--grid``), never into the model folder. ``push_to_hub`` reads ``reid_results.json`` from the
checkpoint folder or the training run's folder above it (as in the first example), or ``--eval-results FILE``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from modeling_tagclip.atomic_io import write_results
from modeling_tagclip.data.reid import ReIDDataset, ReIDTransform, load_reid_dataset
from modeling_tagclip.evaluation.arguments import parse_reid_args
from modeling_tagclip.metrics.reid import evaluate_protocols
from modeling_tagclip.metrics.rerank import RerankConfig
from modeling_tagclip.models.tagclip.configuration_tagclip import VIEW_NAMES
from modeling_tagclip.retrieval.encode import load_rgb, progress_bar
from modeling_tagclip.retrieval.loading import load_visa

__all__ = ["encode", "evaluate_reid_model", "format_table", "load_visa", "main", "retrieval_grid"]

METRIC_KEYS = ("R1", "R5", "R10", "mAP", "mINP")


class _Batches(torch.utils.data.Dataset):
    """Item ``b`` = batch ``b``'s pixels (``ReIDTransform``) and view labels, built in a DataLoader worker."""

    def __init__(self, paths: list[str], views: np.ndarray, transform: ReIDTransform, batch_size: int):
        self.paths, self.views, self.transform, self.batch_size = paths, views, transform, batch_size

    def __len__(self) -> int:
        return -(-len(self.paths) // self.batch_size)

    def __getitem__(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(b * self.batch_size, (b + 1) * self.batch_size)
        pixels = torch.stack([self.transform(load_rgb(p)) for p in self.paths[rows]])
        return pixels, torch.as_tensor(self.views[rows])


@torch.no_grad()
def encode(
    model,
    table,
    batch_size: int = 64,
    transform: ReIDTransform | None = None,
    num_workers: int = 0,
    progress: bool = False,
    name: str = "",
) -> torch.Tensor:
    """Test embeddings [N, D] (float32, CPU) of a re-ID table (image_path, view), in row order; images are
    decoded in ``num_workers`` DataLoader processes. ``progress``: show "encoding NAME images"."""
    transform = transform or ReIDTransform(model.config.image_size)
    device = next(model.parameters()).device
    batches = _Batches(list(table["image_path"]), np.asarray(table["view"]), transform, batch_size)
    loader = torch.utils.data.DataLoader(
        batches, batch_size=None, num_workers=num_workers, pin_memory=device.type == "cuda"
    )
    features = []
    with progress_bar(len(batches.paths), progress, f"encoding {name} images", "image") as bar:
        for pixels, views in loader:
            out = model(pixel_values=pixels.to(device, non_blocking=True), view_labels=views.to(device))
            features.append(out.pooler_output.float().cpu())
            bar.update(pixels.shape[0])
    return torch.cat(features)


def evaluate_reid_model(
    model,
    data: ReIDDataset,
    batch_size: int = 64,
    num_workers: int = 0,
    rerank: RerankConfig | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Encode the query and gallery sets once and compute every protocol of `data` (re-ranked with
    ``rerank``); ``progress`` shows the encoding."""
    query = encode(model, data.query, batch_size, num_workers=num_workers, progress=progress, name="query")
    gallery = encode(
        model, data.gallery, batch_size, num_workers=num_workers, progress=progress, name="gallery"
    )
    results = evaluate_protocols(query, gallery, data.query, data.gallery, data.protocols, rerank=rerank)
    return {"dataset": data.name, "protocols": results, "features": {"query": query, "gallery": gallery}}


def format_table(results: dict[str, dict[str, float]]) -> str:
    """Plain-text table: one protocol per row, R1/R5/R10/mAP/mINP (%) and the number of queries."""
    header = f"{'protocol':<14}" + "".join(f"{k:>8}" for k in METRIC_KEYS) + f"{'queries':>9}"
    lines = [header, "-" * len(header)]
    for name, metrics in results.items():
        values = "".join(f"{metrics[k]:>8.2f}" if k in metrics else f"{'-':>8}" for k in METRIC_KEYS)
        lines.append(f"{name:<14}{values}{int(metrics.get('num_queries', 0)):>9}")
    return "\n".join(lines)


def retrieval_grid(
    data: ReIDDataset,
    query: torch.Tensor,
    gallery: torch.Tensor,
    path: str | os.PathLike,
    rows: int = 6,
    top: int = 5,
) -> Path:
    """PNG: `rows` queries (first column, labelled with identity and view) and their top-`top` gallery images
    (labelled with rank and cosine score; green = same identity, red = not), over the whole gallery with
    same-identity-same-camera items removed."""
    q = torch.nn.functional.normalize(query, dim=1)
    g = torch.nn.functional.normalize(gallery, dim=1)
    q_ids, q_cams = np.asarray(data.query["person_id"]), np.asarray(data.query["camera_id"])
    g_ids, g_cams = np.asarray(data.gallery["person_id"]), np.asarray(data.gallery["camera_id"])
    q_views = np.asarray(data.query["view"]) if "view" in data.query.column_names else None
    cell_w, cell_h, pad, label_h = 64, 128, 4, 14
    row_h = cell_h + label_h + pad
    sheet = Image.new("RGB", ((top + 1) * (cell_w + pad) + pad, rows * row_h + pad), "white")
    draw = ImageDraw.Draw(sheet)
    picks = np.linspace(0, len(q_ids) - 1, num=min(rows, len(q_ids))).round().astype(int)
    for r, qi in enumerate(picks):
        scores = q[qi] @ g.t()
        order = torch.argsort(-scores).numpy()
        order = order[~((g_ids[order] == q_ids[qi]) & (g_cams[order] == q_cams[qi]))][:top]
        paths = [data.query[int(qi)]["image_path"]] + [data.gallery[int(i)]["image_path"] for i in order]
        colors = ["blue"] + ["green" if g_ids[i] == q_ids[qi] else "red" for i in order]
        view = f" {VIEW_NAMES[int(q_views[qi])][0].upper()}" if q_views is not None else ""
        labels = [f"id {q_ids[qi]}{view}"] + [f"#{k + 1} {float(scores[i]):.2f}" for k, i in enumerate(order)]
        for c, (image_path, color, label) in enumerate(zip(paths, colors, labels, strict=True)):
            x, y = pad + c * (cell_w + pad), pad + r * row_h
            draw.text((x + 1, y), label, fill="black")  # query: id and view; hit: rank and cosine score
            sheet.paste(Image.open(image_path).convert("RGB").resize((cell_w, cell_h)), (x, y + label_h))
            draw.rectangle([x, y + label_h, x + cell_w - 1, y + label_h + cell_h - 1], outline=color, width=3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI: print every protocol's metrics; write the results JSON to ``--output`` and a retrieval grid to
    ``--grid`` (nothing is written unless asked)."""
    return run(parse_reid_args(argv))


def rerank_config(args: argparse.Namespace) -> RerankConfig | None:
    """The ``--rerank`` settings (None without ``--rerank``); a bad value is a ValueError naming it."""
    return RerankConfig(args.rerank_k1, args.rerank_k2, args.rerank_lambda) if args.rerank else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate with parsed ``tagclip eval --task reid`` arguments; returns the report."""
    rerank = rerank_config(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    data = load_reid_dataset(args.dataset, args.data) if args.dataset else load_reid_dataset(args.data)
    model = load_visa(args.model, device)
    run = evaluate_reid_model(
        model, data, args.batch_size, num_workers=args.workers, rerank=rerank, progress=True
    )
    print(f"{data.name}: {len(data.query)} query / {len(data.gallery)} gallery images")
    print(format_table(run["protocols"]))
    report = {
        "model": str(args.model),
        "dataset": data.name,
        "data": str(args.data),
        "protocols": run["protocols"],
        "rerank": None if rerank is None else {"method": "k-reciprocal", **dataclasses.asdict(rerank)},
    }
    if args.output:  # after the table: an unwritable --output loses no metric
        write_results(args.output, report)
        print(f"wrote the results to {args.output}")
    if args.grid:
        report["retrieval_grid"] = str(
            retrieval_grid(data, run["features"]["query"], run["features"]["gallery"], args.grid)
        )
        print(f"wrote the retrieval grid to {args.grid}")
    return report
