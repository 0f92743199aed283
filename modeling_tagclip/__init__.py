"""TAG-CLIP for text-based aerial-ground person retrieval, HuggingFace-native.

Importing the package registers the classes with transformers' Auto* factories.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForImageClassification,
    AutoModelForZeroShotImageClassification,
    AutoProcessor,
)

from .tagclip.configuration_tagclip import TagClipConfig, TagClipTextConfig, TagClipVisionConfig
from .tagclip.modeling_tagclip import (
    TagClipModel,
    TagClipOutput,
    TagClipPreTrainedModel,
    TagClipTextModel,
    TagClipVisionModel,
    eq14_similarity,
)
from .tagclip.processing_tagclip import TagClipProcessor, build_image_processor, build_tokenizer, pre_caption
from .visa.complexity_visa import visa_complexity
from .visa.configuration_visa import ViSAConfig
from .visa.image_processing_visa import build_visa_image_processor
from .visa.modeling_visa import ViSAForReID, ViSAForReIDOutput, ViSAModel, ViSAModelOutput

AutoConfig.register(TagClipConfig.model_type, TagClipConfig, exist_ok=True)
AutoConfig.register(TagClipVisionConfig.model_type, TagClipVisionConfig, exist_ok=True)
AutoConfig.register(TagClipTextConfig.model_type, TagClipTextConfig, exist_ok=True)
AutoModel.register(TagClipConfig, TagClipModel, exist_ok=True)
AutoModel.register(TagClipVisionConfig, TagClipVisionModel, exist_ok=True)
AutoModel.register(TagClipTextConfig, TagClipTextModel, exist_ok=True)
AutoModelForZeroShotImageClassification.register(TagClipConfig, TagClipModel, exist_ok=True)
AutoProcessor.register(TagClipConfig, TagClipProcessor, exist_ok=True)
AutoConfig.register(ViSAConfig.model_type, ViSAConfig, exist_ok=True)
AutoModel.register(ViSAConfig, ViSAModel, exist_ok=True)
AutoModelForImageClassification.register(ViSAConfig, ViSAForReID, exist_ok=True)

# Hub custom code: every `save_pretrained` writes the modeling files and `auto_map`, so a saved folder loads
# with `trust_remote_code=True` where this package is not installed.
for _config_class in (TagClipConfig, TagClipVisionConfig, TagClipTextConfig):
    _config_class.register_for_auto_class()
for _model_class in (TagClipModel, TagClipVisionModel, TagClipTextModel):
    _model_class.register_for_auto_class("AutoModel")
TagClipProcessor.register_for_auto_class("AutoProcessor")
ViSAConfig.register_for_auto_class()
ViSAModel.register_for_auto_class("AutoModel")
ViSAForReID.register_for_auto_class("AutoModelForImageClassification")

__all__ = [
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
