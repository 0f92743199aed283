"""Diversified Text Generation (DTG): caption person crops with a local multimodal LLM into TAG-PEDES JSON.

``scan`` finds the images and their ids, views and attribute labels; ``prompts`` holds the paper's prompts, the
template set and the mixing rule; ``vlm`` the captioning model; ``generate`` the resumable generation driver
(``progress`` its progress files); ``quality`` the Match / Contradictory / Hallucinatory / Vacuous check; ``cli``
the ``tagclip dtg`` command.
"""

from modeling_tagclip.dtg.generate import GenerationStats, generate_captions, to_tagpedes
from modeling_tagclip.dtg.prompts import (
    ATTRIBUTE_BASED,
    PROMPT_BASED,
    QUALITY_CATEGORIES,
    QUALITY_PROMPT,
    TEMPLATE_BASED,
    TEMPLATES,
    clean_caption,
    plan_captions,
)
from modeling_tagclip.dtg.quality import filter_records, format_quality_table, parse_quality, quality_check
from modeling_tagclip.dtg.scan import (
    ImageItem,
    attach_attributes,
    format_attributes,
    load_attributes,
    load_dataset_items,
    parse_id,
    scan_images,
    view_from_path,
)
from modeling_tagclip.dtg.vlm import CaptionGenerator, HFGenerator

__all__ = [
    "ATTRIBUTE_BASED",
    "PROMPT_BASED",
    "QUALITY_CATEGORIES",
    "QUALITY_PROMPT",
    "TEMPLATES",
    "TEMPLATE_BASED",
    "CaptionGenerator",
    "GenerationStats",
    "HFGenerator",
    "ImageItem",
    "attach_attributes",
    "clean_caption",
    "filter_records",
    "format_attributes",
    "format_quality_table",
    "generate_captions",
    "load_attributes",
    "load_dataset_items",
    "parse_id",
    "parse_quality",
    "plan_captions",
    "quality_check",
    "scan_images",
    "to_tagpedes",
    "view_from_path",
]
