"""Diversified Text Generation (DTG): caption person crops with a local multimodal LLM into TAG-PEDES JSON.

``scan`` finds the images and their ids, views and attribute labels; ``prompts`` holds the paper's prompts, the
template set and the mixing rule; ``vlm`` the captioning model; ``generate`` the resumable generation driver
(``progress`` its progress files); ``quality`` the Match / Contradictory / Hallucinatory / Vacuous check; ``cli``
the ``tagclip dtg`` command.
"""

from modeling_tagclip.lazy import lazy_attributes

# public name -> its module, imported on first use (``tagclip dtg --help`` imports none of them)
_EXPORTS = {
    "GenerationStats": ".generate",
    "generate_captions": ".generate",
    "to_tagpedes": ".generate",
    "ATTRIBUTE_BASED": ".prompts",
    "PROMPT_BASED": ".prompts",
    "QUALITY_CATEGORIES": ".prompts",
    "QUALITY_PROMPT": ".prompts",
    "TEMPLATE_BASED": ".prompts",
    "TEMPLATES": ".prompts",
    "clean_caption": ".prompts",
    "plan_captions": ".prompts",
    "filter_records": ".quality",
    "format_quality_table": ".quality",
    "parse_quality": ".quality",
    "quality_check": ".quality",
    "ImageItem": ".scan",
    "attach_attributes": ".scan",
    "format_attributes": ".scan",
    "load_attributes": ".scan",
    "load_dataset_items": ".scan",
    "parse_id": ".scan",
    "scan_images": ".scan",
    "view_from_path": ".scan",
    "CaptionGenerator": ".vlm",
    "HFGenerator": ".vlm",
}
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

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
