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
    "TagClipConfig": ".tagclip.configuration_tagclip",
    "TagClipTextConfig": ".tagclip.configuration_tagclip",
    "TagClipVisionConfig": ".tagclip.configuration_tagclip",
    "TagClipModel": ".tagclip.modeling_tagclip",
    "TagClipOutput": ".tagclip.modeling_tagclip",
    "TagClipPreTrainedModel": ".tagclip.modeling_tagclip",
    "TagClipTextModel": ".tagclip.modeling_tagclip",
    "TagClipVisionModel": ".tagclip.modeling_tagclip",
    "eq14_similarity": ".tagclip.modeling_tagclip",
    "TagClipProcessor": ".tagclip.processing_tagclip",
    "build_image_processor": ".tagclip.processing_tagclip",
    "build_tokenizer": ".tagclip.processing_tagclip",
    "pre_caption": ".tagclip.processing_tagclip",
    "visa_complexity": ".visa.complexity_visa",
    "ViSAConfig": ".visa.configuration_visa",
    "build_visa_image_processor": ".visa.image_processing_visa",
    "ViSAForReID": ".visa.modeling_visa",
    "ViSAForReIDOutput": ".visa.modeling_visa",
    "ViSAModel": ".visa.modeling_visa",
    "ViSAModelOutput": ".visa.modeling_visa",
}


def register_auto_classes() -> None:
    """Register TAG-CLIP and ViSA with transformers' Auto* factories and for Hub custom code (importing either
    model subpackage does it for that family; later calls do nothing)."""
    importlib.import_module(".tagclip", __name__)
    importlib.import_module(".visa", __name__)


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
