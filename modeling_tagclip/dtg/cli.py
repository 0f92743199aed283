"""Diversified Text Generation (DTG): caption re-ID person crops with a local multimodal LLM into TAG-PEDES JSON.

    tagclip dtg --images DIR --model LOCAL_VLM_DIR --out train_reid.json
    tagclip dtg --dataset reid.json [--image-dir DIR] --model LOCAL_VLM_DIR --out train_reid.json
        [--attributes attrs.json] [--quality-check] [--filter] [--limit N] [--do-sample --seed S]

Strategies (paper, "Text Generation"; prompts verbatim in ``PROMPT_BASED``, ``TEMPLATE_BASED``,
``ATTRIBUTE_BASED``): prompt-based, template-based (``{template}`` = one template sampled from
``TEMPLATES`` or ``--templates``) and attribute-based (the image's attribute labels and a
template). Mixing rule, two captions per image: attribute-based plus one of prompt/template picked at random when
the image has labels, else prompt-based plus template-based. All choices use ``random.Random(f"{seed}|{file_path}")``
so they depend only on the seed and the image, not on order, batch size or resumption.

Image ids (``--images``): ``--id-from auto`` takes the integer at the start of the file name (after optional
letters: ``0002_c1s1_000451_03.jpg`` -> 2, ``P0101T...jpg`` -> 101), else at the start of the parent folder
name (``0007/img.jpg`` -> 7); images with neither are skipped and counted. ``--dataset`` entries keep their
``id``. ``file_path`` is relative to ``--image-dir`` (for ``--images`` default the folder itself; give the
common root, e.g. ``--images root/train --image-dir root``, so that train and test files share one image dir).
View (``cam_id``, 0 aerial / 1 ground): from ``--dataset`` entries, else ``--cam-id``, else a path
folder named aerial/uav/drone (0) or ground/cctv (1); otherwise omitted and the loaders treat it as ground.

Attributes (``--attributes FILE``): JSON mapping an image key to a dict or list of labels, the key being the
relative ``file_path``, the file name, the file stem or the person id (looked up in that order); ``--dataset``
entries may also carry an ``attributes`` field. Dict values: strings/numbers give ``key: value``, true/1 gives
the key alone (``backpack``), false/0/null/empty are left out.

Resume: each finished image is appended to ``OUT.partial.jsonl`` (first line: the settings); a rerun skips the
images there and refuses to mix settings (seed, model, sampling, templates, attributes) unless
``--force-resume``. ``--limit N`` captions only the first N images. The final TAG-PEDES list (``id``,
``file_path``, ``captions``, ``cam_id`` when known) goes to OUT in the source order.

Empty generations (after ``clean_caption``) are retried once (``generator.retry`` if it has one: sampling for
``HFGenerator``); a caption still empty is dropped and counted, an image left without captions is left out.

Quality check (``--quality-check``): the VLM labels each caption Match / Contradictory / Hallucinatory / Vacuous
(``QUALITY_PROMPT``; an answer naming none of them counts as Vacuous and as ``unparsed``); proportions are printed
as the paper's Fig. 3a and written with the labels to ``OUT.quality.json`` (resumable via
``OUT.quality.partial.jsonl``). ``--filter`` drops non-Match captions without regenerating: an image keeps its
Match captions (1 or 2), an image with none is dropped; OUT holds the filtered list and
``OUT.unfiltered.json`` the full one.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.atomic_io import write_json
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
from modeling_tagclip.flags import (
    accept_both_spellings,
    finite_float,
    fraction,
    integer,
    nonnegative_int,
    positive_int,
)

logger = logging.getLogger(__name__)


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tagclip dtg",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="folder of person crops (scanned recursively)")
    src.add_argument("--dataset", help="TAG-PEDES-style JSON list with id, file_path[, cam_id, attributes]")
    p.add_argument(
        "--image-dir",
        help="image root: file_path is relative to it (--dataset default: images/ next to it, or its folder; "
        "--images default: the --images folder, give a common root to caption train/ and test/ separately)",
    )
    p.add_argument("--model", required=True, help="local image-text-to-text model folder")
    p.add_argument("--out", required=True, help="output TAG-PEDES JSON, e.g. train_reid.json")
    p.add_argument("--attributes", help="JSON: image key -> attribute labels (dict or list)")
    p.add_argument("--templates", help="JSON list of templates replacing the shipped set")
    p.add_argument(
        "--id-from", choices=["auto", "file", "folder"], default="auto", help="person-id rule for --images"
    )
    p.add_argument(
        "--cam-id",
        type=nonnegative_int,
        choices=[0, 1],
        help="view for images without one (0 aerial, 1 ground)",
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompts per generate call")
    p.add_argument("--seed", type=integer, default=0, help="random seed of sampling")
    p.add_argument("--max-new-tokens", type=positive_int, default=160, help="longest caption, in tokens")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=finite_float, default=1.0, help="sampling temperature (--do-sample)")
    p.add_argument("--top-p", type=fraction, default=1.0, help="nucleus sampling mass (--do-sample)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights dtype of the VLM (auto: the checkpoint's)")  # fmt: skip
    p.add_argument(
        "--trust-remote-code", action="store_true", help="allow a VLM whose folder ships its own code"
    )
    p.add_argument("--limit", type=positive_int, help="caption only the first N images")
    p.add_argument("--quality-check", action="store_true", help="label captions Match/Contradictory/...")
    p.add_argument("--qc-model", help="model folder for the quality check (default: --model)")
    p.add_argument("--filter", action="store_true", help="keep only Match captions (implies --quality-check)")
    p.add_argument(
        "--force-resume", action="store_true", help="resume a progress file written with other settings"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return accept_both_spellings(p).parse_args(argv)


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
    """CLI entry point; returns the TAG-PEDES entries written to ``--out``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    a = _parse_args(argv)
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
