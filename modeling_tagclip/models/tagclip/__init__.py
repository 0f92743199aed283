"""TAG-CLIP, a self-contained Hub custom-code unit: its modules import only each other, transformers and torch.

Importing this subpackage (any of its modules) registers TAG-CLIP with transformers' Auto* factories and for
Hub custom code, so every ``save_pretrained`` writes the modeling files and ``auto_map``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForZeroShotImageClassification, AutoProcessor

from .configuration_tagclip import TagClipConfig, TagClipTextConfig, TagClipVisionConfig
from .modeling_tagclip import TagClipModel, TagClipTextModel, TagClipVisionModel
from .processing_tagclip import TagClipProcessor

for _config, _model in (
    (TagClipConfig, TagClipModel),
    (TagClipVisionConfig, TagClipVisionModel),
    (TagClipTextConfig, TagClipTextModel),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    _config.register_for_auto_class()
    _model.register_for_auto_class("AutoModel")
AutoModelForZeroShotImageClassification.register(TagClipConfig, TagClipModel, exist_ok=True)
AutoProcessor.register(TagClipConfig, TagClipProcessor, exist_ok=True)
TagClipProcessor.register_for_auto_class("AutoProcessor")
