"""DTG's quality check (paper Fig. 3a): the VLM labels each caption Match / Contradictory / Hallucinatory /
Vacuous; ``filter_records`` keeps the Match captions."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.dtg.progress import load_progress, run_in_chunks, suffixed
from modeling_tagclip.dtg.prompts import QUALITY_CATEGORIES, QUALITY_PROMPT
from modeling_tagclip.dtg.scan import open_image
from modeling_tagclip.dtg.vlm import CaptionGenerator

_ANSWER = re.compile(r"\b(match(?:es|ed|ing)?|contradict\w*|hallucinat\w*|vacuous\w*)\b", re.I)
_NEGATED = re.compile(r"(?:\bnot|n't|\bno)\s+$", re.I)


def parse_quality(answer: str) -> str | None:
    """The first category named in a VLM answer ("match" after a negation is skipped), or None."""
    for found in _ANSWER.finditer(answer or ""):
        word = found.group(1).lower()
        if word.startswith("match") and _NEGATED.search(answer[: found.start()]):
            continue
        return next(c for c in QUALITY_CATEGORIES if word.startswith(c.lower()[:6]))
    return None


def _strategy(record: dict[str, Any], index: int) -> str | None:
    strategies = record.get("strategies") or []
    return strategies[index] if index < len(strategies) else None


def _quality_jobs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"file_path": r["file_path"], "index": i, "caption": c, "strategy": _strategy(r, i)}
        for r in records
        for i, c in enumerate(r["captions"])
    ]


def _judge_chunk(jobs: Sequence[dict[str, Any]], image_dir: Path, generator: CaptionGenerator) -> list[dict]:
    images = {j["file_path"]: open_image(image_dir / j["file_path"]) for j in jobs}
    usable = [j for j in jobs if images[j["file_path"]] is not None]
    prompts = [QUALITY_PROMPT.replace("{caption}", j["caption"]) for j in usable]
    answers = list(generator([images[j["file_path"]] for j in usable], prompts)) if usable else []
    if len(answers) != len(usable):
        raise RuntimeError(f"generator returned {len(answers)} answers for {len(usable)} prompts")
    labelled = []
    for job, raw in zip(usable, answers, strict=True):
        label = parse_quality(raw)
        labelled.append({**job, "label": label or "Vacuous", "parsed": label is not None, "raw": raw.strip()})
    return labelled


def summarize_quality(labels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and proportions per category (overall and per strategy), plus the unparsed count."""
    counts = Counter(lab["label"] for lab in labels)
    total = len(labels)
    by_strategy: dict[str, dict[str, int]] = {}
    for lab in labels:
        by_strategy.setdefault(str(lab.get("strategy")), Counter())[lab["label"]] += 1
    return {
        "total": total,
        "counts": {c: counts.get(c, 0) for c in QUALITY_CATEGORIES},
        "proportions": {c: (counts.get(c, 0) / total if total else 0.0) for c in QUALITY_CATEGORIES},
        "unparsed": sum(not lab["parsed"] for lab in labels),
        "by_strategy": {
            s: {c: n.get(c, 0) for c in QUALITY_CATEGORIES} for s, n in sorted(by_strategy.items())
        },
    }


def quality_check(
    records: Sequence[dict[str, Any]],
    image_dir: str | Path,
    generator: CaptionGenerator,
    out: str | Path,
    *,
    batch_size: int = 8,
    settings: dict[str, Any] | None = None,
    force_resume: bool = False,
    progress: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Label every caption (resumable via ``OUT.quality.partial.jsonl``); returns (summary, labels)."""
    partial = suffixed(Path(out), ".quality.partial.jsonl")
    done = {(r["file_path"], r["index"]): r for r in load_progress(partial, settings, force_resume)}
    jobs = _quality_jobs(records)
    todo = [j for j in jobs if done.get((j["file_path"], j["index"]), {}).get("caption") != j["caption"]]
    bar = (len(jobs), "DTG quality", "cap", progress)
    labelled = run_in_chunks(
        partial, settings, todo, batch_size, lambda c: _judge_chunk(c, Path(image_dir), generator), bar
    )
    done.update(((lab["file_path"], lab["index"]), lab) for lab in labelled)
    labels = [done[k] for k in ((j["file_path"], j["index"]) for j in jobs) if k in done]
    return summarize_quality(labels), labels


def format_quality_table(summary: dict[str, Any]) -> str:
    """The Fig. 3a-style table: category, count, share."""
    lines = [f"Quality check ({summary['total']} captions)", f"{'category':<15}{'count':>8}{'share':>9}"]
    for cat in QUALITY_CATEGORIES:
        lines.append(f"{cat:<15}{summary['counts'][cat]:>8}{100 * summary['proportions'][cat]:>8.1f}%")
    lines.append(f"unparsed answers (counted as Vacuous): {summary['unparsed']}")
    return "\n".join(lines)


def filter_records(
    records: Sequence[dict[str, Any]], labels: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Keep only Match captions; images left without any are dropped. Returns (records, counts)."""
    label_of = {(lab["file_path"], lab["index"]): lab["label"] for lab in labels}
    kept, dropped_captions = [], 0
    for rec in records:
        keep = [i for i in range(len(rec["captions"])) if label_of.get((rec["file_path"], i)) == "Match"]
        dropped_captions += len(rec["captions"]) - len(keep)
        if keep:
            captions = [rec["captions"][i] for i in keep]
            kept.append({**rec, "captions": captions, "strategies": [_strategy(rec, i) for i in keep]})
    counts = {
        "captions_dropped": dropped_captions,
        "images_dropped": sum(bool(r["captions"]) for r in records) - len(kept),
    }
    return kept, counts
