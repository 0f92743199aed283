"""DTG's generation driver: two captions per image by the mixing rule, one retry of empty answers, resumable."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeling_tagclip.dtg.progress import load_progress, run_in_chunks, suffixed
from modeling_tagclip.dtg.prompts import TEMPLATES, clean_caption, plan_captions
from modeling_tagclip.dtg.scan import ImageItem, open_image
from modeling_tagclip.dtg.vlm import CaptionGenerator


@dataclass
class GenerationStats:
    """Counts of a generation run (including resumed records)."""

    images: int = 0
    resumed: int = 0
    captions: int = 0
    retried: int = 0
    empty_dropped: int = 0
    images_dropped: int = 0
    unreadable: list[str] = field(default_factory=list)
    by_strategy: Counter = field(default_factory=Counter)


def _ask(generator: CaptionGenerator, images: list, prompts: list, retry: bool = False) -> list[str]:
    call = getattr(generator, "retry", generator) if retry else generator
    answers = list(call(images, prompts))
    if len(answers) != len(prompts):
        raise RuntimeError(f"generator returned {len(answers)} answers for {len(prompts)} prompts")
    return [clean_caption(a) for a in answers]


def _answer_with_retry(generator: CaptionGenerator, images: list, prompts: list) -> tuple[list[str], int]:
    """Cleaned answers; empty ones are asked once more. Returns (answers, number retried)."""
    answers = _ask(generator, images, prompts)
    empty = [i for i, a in enumerate(answers) if not a]
    if empty:
        again = _ask(generator, [images[i] for i in empty], [prompts[i] for i in empty], retry=True)
        for i, answer in zip(empty, again, strict=True):
            answers[i] = answer
    return answers, len(empty)


def _caption_chunk(
    items: Sequence[ImageItem],
    image_dir: Path,
    generator: CaptionGenerator,
    templates: Sequence[str],
    seed: int,
) -> tuple[list[dict[str, Any]], list[str], int]:
    """Records for a chunk of images, the unreadable paths and the retry count."""
    loaded = [(it, open_image(image_dir / it.file_path)) for it in items]
    unreadable = [it.file_path for it, im in loaded if im is None]
    jobs = [
        (it, im, s, p) for it, im in loaded if im is not None for s, p in plan_captions(it, templates, seed)
    ]
    if not jobs:
        return [], unreadable, 0
    answers, retried = _answer_with_retry(generator, [j[1] for j in jobs], [j[3] for j in jobs])
    records: dict[str, dict[str, Any]] = {}
    for (item, _, strategy, _), answer in zip(jobs, answers, strict=True):
        rec = records.setdefault(item.file_path, _new_record(item))
        rec["strategies"].append(strategy)
        rec["captions"].append(answer)
    for rec in records.values():
        rec["empty"] = sum(not c for c in rec["captions"])
        rec["strategies"] = [s for s, c in zip(rec["strategies"], rec["captions"], strict=True) if c]
        rec["captions"] = [c for c in rec["captions"] if c]
    return list(records.values()), unreadable, retried


def _new_record(item: ImageItem) -> dict[str, Any]:
    rec: dict[str, Any] = {"file_path": item.file_path, "id": item.id}
    if item.cam_id is not None:
        rec["cam_id"] = item.cam_id
    rec.update(captions=[], strategies=[])
    return rec


def _tally(stats: GenerationStats, records: Iterable[dict[str, Any]]) -> None:
    for rec in records:
        stats.images += 1
        stats.captions += len(rec["captions"])
        stats.empty_dropped += rec.get("empty", 0)
        stats.images_dropped += not rec["captions"]
        stats.by_strategy.update(rec.get("strategies", []))


def generate_captions(
    items: Sequence[ImageItem],
    image_dir: str | Path,
    generator: CaptionGenerator,
    out: str | Path,
    *,
    templates: Sequence[str] = TEMPLATES,
    seed: int = 0,
    batch_size: int = 8,
    limit: int | None = None,
    settings: dict[str, Any] | None = None,
    force_resume: bool = False,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], GenerationStats]:
    """Caption ``items`` (resumably via ``OUT.partial.jsonl``) and return all records in item order.

    Records carry ``file_path``, ``id``, ``cam_id`` (when known), ``captions``, ``strategies`` and ``empty``.
    ``batch_size`` is the number of prompts per generator call (two per image). Does not write OUT itself.
    """
    items = list(items)[:limit] if limit is not None else list(items)
    partial = suffixed(Path(out), ".partial.jsonl")
    done = {r["file_path"]: r for r in load_progress(partial, settings, force_resume)}
    todo = [it for it in items if it.file_path not in done]
    stats = GenerationStats(resumed=sum(it.file_path in done for it in items))

    def work(chunk: Sequence[ImageItem]) -> list[dict[str, Any]]:
        records, unreadable, retried = _caption_chunk(chunk, Path(image_dir), generator, templates, seed)
        stats.unreadable += unreadable
        stats.retried += retried
        return records

    bar = (len(items), "DTG captions", "img", progress)
    new = run_in_chunks(partial, settings, todo, max(1, batch_size // 2), work, bar)
    done.update((r["file_path"], r) for r in new)
    ordered = [done[it.file_path] for it in items if it.file_path in done]
    _tally(stats, ordered)
    return ordered, stats


def to_tagpedes(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """TAG-PEDES entries (``id``, ``file_path``, ``captions``, ``cam_id`` when known); caption-less dropped."""
    keys = ("id", "file_path", "captions", "cam_id")
    return [{k: r[k] for k in keys if k in r} for r in records if r["captions"]]
