"""TAG-CLIP for text-based aerial-ground person retrieval, HuggingFace-native.

Importing the package is light (no torch, no transformers), so the ``tagclip`` command line starts fast. The
first use of a public name (``modeling_tagclip.TagClipModel``, ``from modeling_tagclip import ...``) imports
its model family, which registers it with transformers' Auto* factories; ``register_auto_classes()`` registers
both families.
"""

from __future__ import annotations

import importlib

from modeling_tagclip.lazy import lazy_attributes

# public name -> the module that defines it (imported on first use, as transformers' own lazy modules do)
_EXPORTS = {
    "TagClipConfig": ".models.tagclip.configuration_tagclip",
    "TagClipTextConfig": ".models.tagclip.configuration_tagclip",
    "TagClipVisionConfig": ".models.tagclip.configuration_tagclip",
    "TagClipModel": ".models.tagclip.modeling_tagclip",
    "TagClipOutput": ".models.tagclip.modeling_tagclip",
    "TagClipPreTrainedModel": ".models.tagclip.modeling_tagclip",
    "TagClipTextModel": ".models.tagclip.modeling_tagclip",
    "TagClipVisionModel": ".models.tagclip.modeling_tagclip",
    "eq14_similarity": ".models.tagclip.modeling_tagclip",
    "TagClipProcessor": ".models.tagclip.processing_tagclip",
    "build_image_processor": ".models.tagclip.processing_tagclip",
    "build_tokenizer": ".models.tagclip.processing_tagclip",
    "pre_caption": ".models.tagclip.processing_tagclip",
    "visa_complexity": ".models.visa.complexity_visa",
    "ViSAConfig": ".models.visa.configuration_visa",
    "build_visa_image_processor": ".models.visa.image_processing_visa",
    "ViSAForReID": ".models.visa.modeling_visa",
    "ViSAForReIDOutput": ".models.visa.modeling_visa",
    "ViSAModel": ".models.visa.modeling_visa",
    "ViSAModelOutput": ".models.visa.modeling_visa",
}


def register_auto_classes() -> None:
    """Register TAG-CLIP and ViSA with transformers' Auto* factories and for Hub custom code (importing either
    model subpackage does it for that family; later calls do nothing)."""
    importlib.import_module(".models.tagclip", __name__)
    importlib.import_module(".models.visa", __name__)


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = [
    "register_auto_classes",
    "TagClipConfig",
    "TagClipModel",
    "TagClipOutput",
    "TagClipPreTrainedModel",
    "TagClipProcessor",
    "TagClipTextConfig",
    "TagClipTextModel",
    "TagClipVisionConfig",
    "TagClipVisionModel",
    "ViSAConfig",
    "ViSAForReID",
    "ViSAForReIDOutput",
    "ViSAModel",
    "ViSAModelOutput",
    "build_image_processor",
    "build_tokenizer",
    "build_visa_image_processor",
    "eq14_similarity",
    "pre_caption",
    "visa_complexity",
]
