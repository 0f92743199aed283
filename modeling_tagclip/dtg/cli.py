"""``tagclip dtg``: caption person crops with a local multimodal LLM (how it works: ``dtg/arguments.py``, the
command's ``--help``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.atomic_io import write_json
from modeling_tagclip.dtg.arguments import add_arguments, parse_dtg_args
from modeling_tagclip.dtg.generate import GenerationStats, generate_captions, to_tagpedes
from modeling_tagclip.dtg.progress import PROGRESS_VERSION, settings_digest, suffixed
from modeling_tagclip.dtg.prompts import TEMPLATES
from modeling_tagclip.dtg.quality import filter_records, format_quality_table, quality_check
from modeling_tagclip.dtg.scan import (
    ImageItem,
    attach_attributes,
    load_attributes,
    load_dataset_items,
    read_json_file,
    scan_images,
)
from modeling_tagclip.dtg.vlm import HFGenerator

__all__ = ["add_arguments", "caption", "main", "run"]

logger = logging.getLogger(__name__)


def _load_templates(path: str | None) -> list[str]:
    if path is None:
        return list(TEMPLATES)
    data = read_json_file(path)
    if not isinstance(data, list) or not data or not all(isinstance(t, str) and t.strip() for t in data):
        raise ValueError(f"{path}: expected a non-empty JSON list of template strings")
    return data


def _items_from_args(a: argparse.Namespace) -> tuple[list[ImageItem], Path]:
    if a.images:
        items, skipped = scan_images(a.images, a.id_from, a.cam_id, a.image_dir)
        if skipped:
            logger.warning("%d images without a parsable id skipped, e.g. %s", len(skipped), skipped[:3])
        return items, Path(a.image_dir or a.images)
    items, image_dir = load_dataset_items(a.dataset, a.image_dir)
    if a.cam_id is not None:
        for item in items:
            item.cam_id = item.cam_id if item.cam_id is not None else a.cam_id
    return items, image_dir


def _settings(a: argparse.Namespace, templates: list[str], items: list[ImageItem]) -> dict[str, Any]:
    return {
        "version": PROGRESS_VERSION,
        "model": str(Path(a.model).resolve()),
        "seed": a.seed,
        "max_new_tokens": a.max_new_tokens,
        "sampling": [a.do_sample, a.temperature, a.top_p] if a.do_sample else "greedy",
        "templates": settings_digest(templates),
        "attributes": settings_digest({it.file_path: it.attributes for it in items if it.attributes}),
    }


def _generator(a: argparse.Namespace) -> HFGenerator:
    return HFGenerator(
        a.model,
        batch_size=a.batch_size,
        max_new_tokens=a.max_new_tokens,
        do_sample=a.do_sample,
        temperature=a.temperature,
        top_p=a.top_p,
        seed=a.seed,
        device=a.device,
        dtype=a.dtype,
        trust_remote_code=a.trust_remote_code,
    )


def _report(stats: GenerationStats, out: Path) -> str:
    lines = [
        f"DTG: {stats.images} images ({stats.resumed} resumed), {stats.captions} captions -> {out}",
        f"strategies: {dict(sorted(stats.by_strategy.items()))}",
        f"empty generations retried: {stats.retried}; still empty, dropped: {stats.empty_dropped}; "
        f"images without captions: {stats.images_dropped}; unreadable images: {len(stats.unreadable)}",
    ]
    return "\n".join(lines)


def _run_quality(a, records, image_dir, generator: HFGenerator, out: Path) -> list[dict[str, Any]]:
    judge = _generator(argparse.Namespace(**{**vars(a), "model": a.qc_model})) if a.qc_model else generator
    judge = judge.with_options(max_new_tokens=8, do_sample=False)
    settings = {"version": PROGRESS_VERSION, "qc_model": str(Path(a.qc_model or a.model).resolve())}
    summary, labels = quality_check(
        records,
        image_dir,
        judge,
        out,
        batch_size=a.batch_size,
        settings=settings,
        force_resume=a.force_resume,
        progress=not a.no_progress,
    )
    print(format_quality_table(summary))
    write_json(suffixed(out, ".quality.json"), {"summary": summary, "labels": labels})
    if not a.filter:
        return records
    write_json(suffixed(out, ".unfiltered.json"), to_tagpedes(records))
    kept, counts = filter_records(records, labels)
    print(
        f"filter: kept {sum(len(r['captions']) for r in kept)} Match captions of {len(kept)} images; {counts}"
    )
    return kept


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """``tagclip dtg ARGV`` from Python; returns the TAG-PEDES entries written to ``--output``."""
    return caption(parse_dtg_args(argv))


def run(args: argparse.Namespace) -> int:
    """``tagclip dtg`` with its parsed flags; the exit status."""
    caption(args)
    return 0


def caption(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Caption the images the flags name; the TAG-PEDES entries written to ``--output``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    templates = _load_templates(a.templates)
    items, image_dir = _items_from_args(a)
    if a.attributes:
        found = attach_attributes(items, load_attributes(a.attributes))
        logger.info("attribute labels found for %d of %d images", found, len(items))
    out = Path(a.out)
    generator = _generator(a)
    records, stats = generate_captions(
        items,
        image_dir,
        generator,
        out,
        templates=templates,
        seed=a.seed,
        batch_size=a.batch_size,
        limit=a.limit,
        settings=_settings(a, templates, items),
        force_resume=a.force_resume,
        progress=not a.no_progress,
    )
    if a.quality_check or a.filter:
        records = _run_quality(a, records, image_dir, generator, out)
    entries = to_tagpedes(records)
    write_json(out, entries)
    print(_report(stats, out))
    return entries
