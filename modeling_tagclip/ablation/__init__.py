"""Ablation studies (paper Tables 4 and 5, and the initialisation study): variants, statistics, table and plot.

A study is a list of variants (config overrides, and for Table 5 the view of the training images) evaluated
on one or more galleries. ``summarize`` turns per-seed results into mean, sample std and a two-sided 95%
confidence interval from Student's t distribution; ``orderings`` checks the paper's claims on the means;
``markdown_table`` and ``plot_summary`` render the result. The runner (``tagclip ablate``) is
``runner.py``.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeling_tagclip.atomic_io import write_with

from .views import AERIAL, GROUND, VIEW_NAMES

__all__ = [
    "METRICS",
    "STUDIES",
    "Study",
    "Variant",
    "markdown_table",
    "mean_ci",
    "orderings",
    "paired_difference",
    "plot_summary",
    "summarize",
    "t_quantile",
]

METRICS = ("R@1", "R@5", "R@10", "mAP")
ALL = "all"  # a gallery of both views; a view's own gallery is named by its VIEW_NAMES entry
_PLAIN = {"use_view_loss": False, "use_ortho_loss": False}


@dataclass(frozen=True)
class Variant:
    """One row of a study: ``set`` = dotted train-config overrides; ``train_view`` filters the training images.

    ``same_as`` ("study/variant"): this row trains exactly that run's configuration on the same data, so a finished
    run of it (same seed) is reused instead of trained again (the result records ``reused_from``).
    """

    name: str
    label: str
    set: dict[str, Any] = field(default_factory=dict)
    train_view: str = ALL
    pretrained_init: bool = False
    same_as: str | None = None


@dataclass(frozen=True)
class Study:
    """Variants, the test galleries (by view) and the paper's orderings as (better, worse, gallery) triples."""

    name: str
    title: str
    variants: tuple[Variant, ...]
    galleries: tuple[str, ...] = (ALL,)
    claims: tuple[tuple[str, str, str], ...] = ()
    multi_view_ids_only: bool = False

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise ValueError(f"study {self.name!r} has no variant {name!r}; choose from {self.variant_names}")

    @property
    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]


def _model(**kwargs: Any) -> dict[str, Any]:
    """Dotted ``model.*`` overrides."""
    return {f"model.{k}": v for k, v in kwargs.items()}


TABLE4 = Study(
    "table4",
    "Table 4: components (test gallery: both views)",
    (
        Variant(
            "vit",
            "1 ViT (CLIP baseline)",
            _model(**_PLAIN, **{"vision_config.block_type": "vit", "vision_config.use_view_token": False}),
        ),
        Variant(
            "moe",
            "2 vanilla MoE",
            _model(**_PLAIN, **{"vision_config.block_type": "moe", "vision_config.use_view_token": False}),
        ),
        Variant("hrmoe", "3 HR-MoE", _model(**_PLAIN)),
        Variant("hrmoe_view", "4 HR-MoE + L_view", _model(use_view_loss=True, use_ortho_loss=False)),
        Variant("hrmoe_ortho", "5 HR-MoE + L_ortho", _model(use_view_loss=False, use_ortho_loss=True)),
        Variant("full", "6 HR-MoE + L_view + L_ortho (TAG-CLIP)", {}),
        Variant("full_no_tse", "6 without TSE (global features only)", _model(use_tse=False)),
        Variant("full_no_id", "6 without the ID loss", _model(use_id_loss=False)),
    ),
    claims=(
        ("hrmoe", "vit", ALL),
        ("moe", "vit", ALL),
        ("hrmoe", "moe", ALL),
        ("full", "hrmoe_view", ALL),
        ("full", "hrmoe_ortho", ALL),
        ("full", "hrmoe", ALL),
        ("full", "full_no_tse", ALL),
        ("full", "full_no_id", ALL),
    ),
)

TABLE5 = Study(
    "table5",
    "Table 5: training views (identities with both views; test galleries aerial, ground, mixed)",
    (
        Variant("train_aerial", "aerial images only", train_view=VIEW_NAMES[AERIAL]),
        Variant("train_ground", "ground images only", train_view=VIEW_NAMES[GROUND]),
        Variant("train_both", "aerial & ground images", train_view=ALL),
    ),
    galleries=(*VIEW_NAMES, ALL),
    claims=(
        ("train_both", "train_aerial", VIEW_NAMES[AERIAL]),
        ("train_both", "train_ground", VIEW_NAMES[GROUND]),
        ("train_both", "train_aerial", ALL),
        ("train_both", "train_ground", ALL),
        ("train_ground", "train_aerial", ALL),
    ),
    multi_view_ids_only=True,
)

INIT = Study(
    "init",
    "Initialisation: from scratch vs a CLIP pre-trained here and converted (convert hf-clip)",
    (
        Variant("scratch", "from scratch", {}, same_as="table4/full"),
        Variant(
            "clip",
            "from the converted CLIP (frozen patch embedding, x10 TSE lr)",
            {"freeze_patch_embedding": True},
            pretrained_init=True,
        ),
    ),
    claims=(("clip", "scratch", ALL),),
)

STUDIES = {s.name: s for s in (TABLE4, TABLE5, INIT)}


# ----------------------------------------------------------------------------------------------- statistics
def _t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """Student-t CDF for x >= 0 by Simpson's rule on the density (exact to ~1e-10 for the x used here)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def pdf(t: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))

    h = x / steps
    total = pdf(0.0) + pdf(x) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return 0.5 + total * h / 3


def t_quantile(p: float, df: int) -> float:
    """Quantile ``p`` (0.5 < p < 1) of Student's t with ``df`` degrees of freedom (bisection on the CDF)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean, sample std (ddof 1) and the half-width of the two-sided t confidence interval (NaN for n < 2)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = math.fsum(values) / n
    if n < 2:
        return {"n": 1, "mean": mean, "std": math.nan, "ci95": math.nan}
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci95": half}


def summarize(study: Study, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per variant and gallery: ``mean_ci`` of every metric over the seeds in ``results``.

    Each result is ``{"variant": name, "seed": s, "galleries": {gallery: {metric: value}}}``.
    """
    out: dict[str, Any] = {}
    for variant in study.variants:
        runs = [r for r in results if r["variant"] == variant.name]
        if not runs:
            continue
        per_gallery = {}
        for gallery in study.galleries:
            per_gallery[gallery] = {
                m: mean_ci([float(r["galleries"][gallery][m]) for r in runs]) for m in METRICS
            }
        per_seed = {
            g: {m: {str(r["seed"]): float(r["galleries"][g][m]) for r in runs} for m in METRICS}
            for g in study.galleries
        }
        out[variant.name] = {
            "label": variant.label,
            "seeds": sorted(r["seed"] for r in runs),
            "galleries": per_gallery,
            "per_seed": per_seed,
        }
    return out


def paired_difference(summary: dict[str, Any], better: str, worse: str, gallery: str, metric: str):
    """``mean_ci`` of the per-seed differences better - worse over the seeds both ran (a seed fixes the
    validation split, the initialisation and the data order of every variant alike), or None without seeds."""
    per_seed = [
        summary[name].get("per_seed", {}).get(gallery, {}).get(metric, {}) for name in (better, worse)
    ]
    common = sorted(set(per_seed[0]) & set(per_seed[1]))
    if not common:
        return None
    return mean_ci([per_seed[0][seed] - per_seed[1][seed] for seed in common])


def orderings(study: Study, summary: dict[str, Any], metric: str = "R@1") -> list[dict[str, Any]]:
    """The expected orderings checked on the means; ``separated`` when the two 95% CIs do not overlap;
    ``paired``: the 95% CI of the per-seed difference, ``paired_excludes_zero`` when it lies above or below 0."""
    checks = []
    for better, worse, gallery in study.claims:
        if better not in summary or worse not in summary:
            continue
        a, b = summary[better]["galleries"][gallery][metric], summary[worse]["galleries"][gallery][metric]
        separated = (
            a["mean"] - a["ci95"] > b["mean"] + b["ci95"] or b["mean"] - b["ci95"] > a["mean"] + a["ci95"]
        )
        paired = paired_difference(summary, better, worse, gallery, metric)
        excludes = paired is not None and paired["n"] > 1 and abs(paired["mean"]) > paired["ci95"]
        checks.append(
            {
                "better": better,
                "worse": worse,
                "gallery": gallery,
                "metric": metric,
                "difference": a["mean"] - b["mean"],
                "holds": a["mean"] > b["mean"],
                "separated": bool(separated),
                "paired": paired,
                "paired_excludes_zero": bool(excludes),
            }
        )
    return checks


# ----------------------------------------------------------------------------------------------- rendering
def _cell(stats: dict[str, float]) -> str:
    if math.isnan(stats["ci95"]):
        return f"{stats['mean']:.2f}"
    return f"{stats['mean']:.2f} ± {stats['ci95']:.2f}"


def markdown_table(study: Study, summary: dict[str, Any], wall_time_s: float | None = None) -> str:
    """Markdown: one row per variant and gallery, ``mean ± 95% CI half-width``, then the orderings."""
    lines = [
        f"### {study.title}",
        "",
        "Cells: mean ± 95% CI half-width (Student t) over seeds; std in JSON.",
        "",
    ]
    lines += ["| variant | test gallery | seeds | " + " | ".join(METRICS) + " |"]
    lines += ["|---|---|---|" + "---|" * len(METRICS)]
    for row in summary.values():
        for gallery, stats in row["galleries"].items():
            cells = " | ".join(_cell(stats[m]) for m in METRICS)
            lines.append(f"| {row['label']} | {gallery} | {len(row['seeds'])} | {cells} |")
    checks = orderings(study, summary)
    if checks:
        lines += [
            "",
            "Expected orderings (the paper's claims; init: pre-training helps), on R@1 means "
            "('separated' = the 95% CIs do not overlap; 'paired' = the mean ± 95% CI of the per-seed "
            "difference, same seed = same split, initialisation and data order):",
            "",
        ]
        for c in checks:
            verdict = "holds" if c["holds"] else "does NOT hold"
            sep = ", separated" if c["separated"] else ", CIs overlap"
            paired = c.get("paired")
            if paired is not None and paired["n"] > 1:
                zero = "excludes 0" if c["paired_excludes_zero"] else "includes 0"
                sep += (
                    f"; paired {paired['mean']:+.2f} ± {paired['ci95']:.2f} over {paired['n']} seeds, {zero}"
                )
            lines.append(
                f"- {c['better']} > {c['worse']} ({c['gallery']} gallery): {verdict} "
                f"(Δ {c['difference']:+.2f}{sep})"
            )
    if wall_time_s is not None:
        lines += [
            "",
            f"Total training+evaluation wall time of the finished runs: {wall_time_s / 60:.1f} min.",
        ]
    return "\n".join(lines) + "\n"


def plot_summary(study: Study, summary: dict[str, Any], png: str | os.PathLike, metric: str = "R@1") -> Path:
    """Bar chart of ``metric`` per variant (one bar per gallery) with 95% CI error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    width = 0.8 / len(study.galleries)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(names) * len(study.galleries) ** 0.5), 3.6))
    for j, gallery in enumerate(study.galleries):
        stats = [summary[n]["galleries"][gallery][metric] for n in names]
        xs = [i + (j - (len(study.galleries) - 1) / 2) * width for i in range(len(names))]
        errs = [0.0 if math.isnan(s["ci95"]) else s["ci95"] for s in stats]
        ax.bar(xs, [s["mean"] for s in stats], width, yerr=errs, capsize=3, label=f"{gallery} gallery")
    seeds = [len(summary[n]["seeds"]) for n in names]
    ax.set_xticks(
        range(len(names)),
        [f"{n}\n(n={k})" for n, k in zip(names, seeds, strict=True)],
        rotation=30,
        ha="right",
        fontsize=7,
    )
    ax.set_ylabel(f"test {metric} (%)")
    title = textwrap.fill(study.title, 70)
    ax.set_title(f"{title}\nmean ± 95% CI (Student t over seeds)", fontsize=8)
    if len(study.galleries) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(png)
    try:
        write_with(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)
    return path
