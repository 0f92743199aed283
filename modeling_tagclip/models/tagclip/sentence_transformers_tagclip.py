"""sentence-transformers loading of a saved TAG-CLIP folder: ``SentenceTransformer(folder, trust_remote_code=True)``.

Every ``TagClipModel.save_pretrained`` folder holds this file, a ``modules.json`` naming
``TagClipSentenceEncoder`` (one input module for texts and images) and ``config_sentence_transformers.json``
(dot-product similarity). ``encode`` returns, for a caption or a person image, the combined TAG-PR Eq. 14 vector
``sqrt(1/2) [global, TSE]`` of the L2-normalised global and TSE embeddings (the global embedding alone for a
model without TSE), so ``model.similarity(text_vectors, image_vectors)`` is the TAG-PR Eq. 14 score
``1/2 [cos(v_cls, t_eos) + cos(v_tse, t_tse)]`` and a vector store with the inner product ranks by TAG-PR Eq. 14.

Standard library, torch, PIL and transformers only (sentence-transformers when it loads this file).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from PIL import Image

try:  # sentence-transformers >= 6 / 5.x; absent: the folder still loads with transformers alone
    from sentence_transformers.base.modules import InputModule
except ImportError:
    try:
        from sentence_transformers.models import InputModule
    except ImportError:
        InputModule = None

CLASS_NAME = "TagClipSentenceEncoder"


def combined_vector(global_embeds: torch.Tensor, local_embeds: torch.Tensor | None) -> torch.Tensor:
    """TAG-PR Eq. 14 as one inner product: ``sqrt(1/2) [g/|g|, l/|l|]`` (``g/|g|`` without TSE)."""
    vector = torch.nn.functional.normalize(global_embeds.float(), dim=-1)
    if local_embeds is None:
        return vector
    local = torch.nn.functional.normalize(local_embeds.float(), dim=-1)
    return torch.cat([vector, local], dim=-1) * math.sqrt(0.5)


def write_sentence_transformers_files(folder: str | Path) -> None:
    """Put this module, ``modules.json`` and ``config_sentence_transformers.json`` into a saved model folder."""
    folder = Path(folder)
    module = Path(__file__).stem
    if Path(__file__).resolve() != (folder / f"{module}.py").resolve():
        shutil.copyfile(__file__, folder / f"{module}.py")
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{module}.{CLASS_NAME}"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    config = {
        "model_type": "SentenceTransformer",
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "dot",
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config, indent=2) + "\n")


if InputModule is not None:

    class TagClipSentenceEncoder(InputModule):
        """TAG-CLIP as one sentence-transformers input module: texts and images to combined TAG-PR Eq. 14 vectors."""

        save_in_root = True
        config_keys: list[str] = []

        def __init__(self, model: Any, processor: Any):
            super().__init__()
            self.model, self.processor = model.eval(), processor

        @property
        def modalities(self) -> list[str]:
            return ["text", "image"]

        def preprocess(self, inputs: list[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
            """Token ids of captions, or pixel values of person images (one modality per batch)."""
            if all(isinstance(item, str) for item in inputs):
                texts = [prompt + text for text in inputs] if prompt else list(inputs)
                return {"input_ids": self.processor(text=texts)["input_ids"]}
            if all(isinstance(item, Image.Image) for item in inputs):
                images = [image.convert("RGB") for image in inputs]
                return {"pixel_values": self.processor(images=images)["pixel_values"]}
            raise ValueError("TAG-CLIP encodes a batch of texts or a batch of PIL images, not a mix")

        def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            device = next(self.model.parameters()).device
            if "input_ids" in features:
                out = self.model.get_text_features(input_ids=features["input_ids"].to(device))
            else:
                out = self.model.get_image_features(pixel_values=features["pixel_values"].to(device))
            features["sentence_embedding"] = combined_vector(out.pooler_output, out.local_embeds)
            return features

        def get_sentence_embedding_dimension(self) -> int:
            config = self.model.config
            return config.projection_dim + (config.tse_embed_dim if config.use_tse else 0)

        @classmethod
        def load(
            cls,
            model_name_or_path: str,
            trust_remote_code: bool = False,
            revision: str | None = None,
            model_kwargs: dict | None = None,
            **kwargs: Any,
        ) -> TagClipSentenceEncoder:
            from transformers import AutoModel, AutoProcessor

            hub = {"trust_remote_code": trust_remote_code, "revision": revision}
            for key in ("token", "cache_folder", "local_files_only"):
                if kwargs.get(key) is not None:
                    hub["cache_dir" if key == "cache_folder" else key] = kwargs[key]
            model = AutoModel.from_pretrained(model_name_or_path, **hub, **(model_kwargs or {}))
            return cls(model, AutoProcessor.from_pretrained(model_name_or_path, **hub))

        def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
            self.model.save_pretrained(output_path)
            self.processor.save_pretrained(output_path)
            write_sentence_transformers_files(output_path)
