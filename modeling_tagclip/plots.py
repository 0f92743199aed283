"""Figures for a training run: loss/lr/accuracy curves from ``metrics.jsonl`` and a retrieval grid.

``training_curves(metrics_file, png)`` plots the per-step loss terms, learning rate, view-router accuracy and
the validation R@1/mAP. ``retrieval_grid(run, png)`` shows example queries with their top-5 gallery images
(green border = same identity, red = wrong) and an aerial/ground badge on every image.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from modeling_tagclip.models.tagclip.configuration_tagclip import AERIAL, GROUND

__all__ = ["read_metrics", "retrieval_grid", "training_curves"]

LOSS_KEYS = ("loss", "loss_nitc", "loss_ritc", "loss_id", "loss_view", "loss_ortho")
VIEW_BADGE = {AERIAL: ("A", "#1f77b4"), GROUND: ("G", "#8c564b")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl``; for a step logged twice (a resumed run) the last record wins."""
    records: dict[tuple[int, str], dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[(int(record.get("step", 0)), str(record.get("kind", "train")))] = record
    return [records[key] for key in sorted(records)]


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*pairs, strict=True)
    return np.asarray(steps), np.asarray(values, dtype=float)


def _save(fig, out_png: str | os.PathLike, dpi: int) -> Path:
    """Lay out ``fig``, write it to ``out_png`` (creating its folder) at ``dpi``, close it; return the path."""
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=dpi)
    _pyplot().close(fig)
    return out_png


def training_curves(metrics_file: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Plot loss terms, lr, view accuracy and validation metrics of a run into one PNG."""
    plt = _pyplot()
    records = read_metrics(metrics_file)
    train = [r for r in records if r.get("kind", "train") == "train"]
    val = [r for r in records if r.get("kind") == "validation"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for key in LOSS_KEYS:
        steps, values = _series(train, key)
        if len(steps):
            axes[0, 0].plot(steps, values, label=key, lw=1.6 if key == "loss" else 1.0)
    axes[0, 0].set(title="training losses", xlabel="step", yscale="log")
    axes[0, 0].legend(fontsize=8)
    axes[0, 1].plot(*_series(train, "lr"), color="tab:purple")
    axes[0, 1].set(title="learning rate (base group)", xlabel="step")
    axes[1, 0].plot(*_series(train, "view_accuracy"), color="tab:green")
    axes[1, 0].set(title="view-router accuracy (train)", xlabel="step", ylim=(0, 1.05))
    for key in ("R@1", "mAP", "R@5"):
        steps, values = _series(val, key)
        if len(steps):
            axes[1, 1].plot(steps, values, marker="o", label=f"val {key}")
    axes[1, 1].set(title="validation retrieval (%)", xlabel="step")
    if val:
        axes[1, 1].legend(fontsize=8)
    return _save(fig, out_png, dpi=100)


def _show_image(ax, path: str, view: int, border: str | None) -> None:
    from PIL import Image

    with Image.open(path) as img:
        ax.imshow(np.asarray(img.convert("RGB")))
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(border is not None)
        if border is not None:
            spine.set_edgecolor(border)
            spine.set_linewidth(4)
    letter, color = VIEW_BADGE.get(int(view), ("?", "grey"))
    ax.text(
        0.04,
        0.96,
        letter,
        transform=ax.transAxes,
        va="top",
        ha="left",
        fontsize=9,
        color="white",
        fontweight="bold",
        bbox={"boxstyle": "round,pad=0.2", "facecolor": color, "edgecolor": "none"},
    )


def retrieval_grid(
    run, out_png: str | os.PathLike, num_queries: int = 6, top_k: int = 5, seed: int = 0
) -> Path:
    """Grid: one row per sampled query (caption, its source image) then its top-``top_k`` gallery images.

    ``run`` is a ``modeling_tagclip.evaluation.text_retrieval.RetrievalRun``. Borders: green = right identity, red = wrong.
    Badges: A = aerial, G = ground.
    """
    plt = _pyplot()
    rng = np.random.default_rng(seed)
    n = min(num_queries, len(run.query_ids))
    queries = np.sort(rng.choice(len(run.query_ids), size=n, replace=False))
    fig, axes = plt.subplots(n, top_k + 2, figsize=(2.0 * (top_k + 2), 2.6 * n), squeeze=False)
    for row, q in enumerate(queries):
        axes[row, 0].axis("off")
        caption = "\n".join(textwrap.wrap(run.captions[q], 26)[:9])
        axes[row, 0].text(
            0, 0.5, caption, va="center", ha="left", fontsize=7, transform=axes[row, 0].transAxes
        )
        source = int(run.query_image_index[q])
        _show_image(axes[row, 1], run.image_paths[source], run.gallery_views[source], None)
        axes[row, 1].set_title("query's image", fontsize=7)
        scores = run.scores(int(q), int(q) + 1)[0].double().numpy()  # one row: no query x gallery matrix
        for col, g in enumerate(np.argsort(-scores, kind="stable")[:top_k]):
            right = run.gallery_ids[g] == run.query_ids[q]
            _show_image(
                axes[row, col + 2], run.image_paths[g], run.gallery_views[g], "green" if right else "red"
            )
            axes[row, col + 2].set_title(f"#{col + 1}  {scores[g]:.2f}", fontsize=7)
    return _save(fig, out_png, dpi=90)
