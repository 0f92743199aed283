"""Diversified Text Generation (DTG): caption re-ID person crops with a local multimodal LLM into TAG-PEDES JSON.

    tagclip dtg --images DIR --model LOCAL_VLM_DIR --output train_reid.json
    tagclip dtg --dataset reid.json [--image-dir DIR] --model LOCAL_VLM_DIR --output train_reid.json
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

Resume: each finished image is appended to ``OUTPUT.partial.jsonl`` (first line: the settings); a rerun skips the
images there and refuses to mix settings (seed, model, sampling, templates, attributes) unless
``--force-resume``. ``--limit N`` captions only the first N images. The final TAG-PEDES list (``id``,
``file_path``, ``captions``, ``cam_id`` when known) goes to OUTPUT in the source order.

Empty generations (after ``clean_caption``) are retried once (``generator.retry`` if it has one: sampling for
``HFGenerator``); a caption still empty is dropped and counted, an image left without captions is left out.

Quality check (``--quality-check``): the VLM labels each caption Match / Contradictory / Hallucinatory / Vacuous
(``QUALITY_PROMPT``; an answer naming none of them counts as Vacuous and as ``unparsed``); proportions are printed
as the paper's Fig. 3a and written with the labels to ``OUTPUT.quality.json`` (resumable via
``OUTPUT.quality.partial.jsonl``). ``--filter`` drops non-Match captions without regenerating: an image keeps its
Match captions (1 or 2), an image with none is dropped; OUTPUT holds the filtered list and
``OUTPUT.unfiltered.json`` the full one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from modeling_tagclip.flags import (
    finite_float,
    fraction,
    integer,
    nonnegative_int,
    positive_int,
)

__all__ = ["add_arguments", "parse_dtg_args"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip dtg`` (its help is this module's docstring)."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="folder of person crops (scanned recursively)")
    src.add_argument("--dataset", help="TAG-PEDES-style JSON list with id, file_path[, cam_id, attributes]")
    p.add_argument(
        "--image-dir",
        help="image root: file_path is relative to it (--dataset default: images/ next to it, or its folder; "
        "--images default: the --images folder, give a common root to caption train/ and test/ separately)",
    )
    p.add_argument("--model", required=True, help="local image-text-to-text model folder")
    p.add_argument(
        "--output",
        dest="out",
        required=True,
        metavar="FILE",
        help="output TAG-PEDES JSON, e.g. train_reid.json",
    )
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
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights dtype of the VLM (auto: the checkpoint's)",
    )
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
    p.add_argument("--quiet", dest="no_progress", action="store_true", help="no progress bar")


def parse_dtg_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``tagclip dtg ARGV`` as ``run`` receives it."""
    from modeling_tagclip.cli import parse

    return parse("dtg", argv)
