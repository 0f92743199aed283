"""ViSA, a self-contained Hub custom-code unit: its modules import only each other, transformers and torch.

Building blocks shared with TAG-CLIP (attention, loading policy, grouped-GEMM ops, the view convention) are
generated copies of the TAG-CLIP unit's files (``python utils/fix_copies.py``). Importing this subpackage (any
of its modules) registers ViSA with transformers' Auto* factories and for Hub custom code.
"""

from transformers import AutoConfig, AutoModel, AutoModelForImageClassification

from .configuration_visa import ViSAConfig
from .modeling_visa import ViSAForReID, ViSAModel

AutoConfig.register(ViSAConfig.model_type, ViSAConfig, exist_ok=True)
AutoModel.register(ViSAConfig, ViSAModel, exist_ok=True)
AutoModelForImageClassification.register(ViSAConfig, ViSAForReID, exist_ok=True)
ViSAConfig.register_for_auto_class()
ViSAModel.register_for_auto_class("AutoModel")
ViSAForReID.register_for_auto_class("AutoModelForImageClassification")
