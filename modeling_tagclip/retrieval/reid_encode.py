"""Re-identification embeddings of crops: one unit ViSA embedding per crop, compared by cosine.

A gallery built by TAG-CLIP can carry a second embedding per crop from a ViSA re-ID model (``tagclip index
--reid-model VISA``, or later ``--add-embeddings reid``). They are the ViSA evaluation's test embedding
(``pooler_output``) L2-normalised, computed with the crop's view (the sidecar's, else TAG-CLIP's router's;
``ground`` when neither is known), so the inner product is the cosine the evaluation ranks by. The set rules
of ``queries`` hold unchanged: the mean of unit query embeddings scores each crop by its mean cosine.

Each backend stores them its own way (``embedded.reid_store``, ``milvus_reid``); ``reid`` picks the backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .gallery_types import GalleryIndexError, model_fingerprint

__all__ = ["DEFAULT_VIEW", "REID", "check_reid_model", "reid_embeddings", "reid_width"]

REID = "reid"  # the name of the embeddings (``--add-embeddings reid``)
DEFAULT_VIEW = "ground"  # a crop or a query image of unknown view


@torch.no_grad()
def reid_embeddings(
    model: Any, images: Sequence[Any], views: Sequence[str | None], batch_size: int = 32
) -> torch.Tensor:
    """Unit ViSA embeddings [n, d] (float32, CPU) of RGB ``images`` seen from ``views`` (aerial / ground /
    None = ``DEFAULT_VIEW``), resized as the ViSA evaluation does (``ReIDTransform``)."""
    from modeling_tagclip.data.reid import ReIDTransform
    from modeling_tagclip.models.visa.views import AERIAL, GROUND

    transform = ReIDTransform(model.config.image_size)
    device = next(model.parameters()).device
    labels = [AERIAL if (view or DEFAULT_VIEW) == "aerial" else GROUND for view in views]
    out = []
    for start in range(0, len(images), batch_size):
        pixels = torch.stack([transform(image) for image in images[start : start + batch_size]])
        view_labels = torch.tensor(labels[start : start + batch_size])
        features = model(pixel_values=pixels.to(device), view_labels=view_labels.to(device)).pooler_output
        out.append(torch.nn.functional.normalize(features.float(), dim=1).cpu())
    width = int(model.config.hidden_size) if not out else out[0].shape[1]
    return torch.cat(out) if out else torch.empty(0, width)


def reid_width(model: Any) -> int:
    """The width of ``model``'s embeddings (from one blank image)."""
    from PIL import Image

    height, width = (int(n) for n in model.config.image_size)
    return int(reid_embeddings(model, [Image.new("RGB", (width, height))], [None]).shape[1])


def check_reid_model(meta: dict[str, Any], model: Any, where: str) -> None:
    """``GalleryIndexError`` unless ``model`` is the ViSA model whose embeddings ``meta`` describes (same width
    and fingerprint), naming the model that built them."""
    built = f"{meta.get('model') or '?'} (fingerprint {meta.get('model_fingerprint')})"
    width = reid_width(model)
    if width != int(meta["dim"]):
        raise GalleryIndexError(
            f"the ViSA model gives {width}-d embeddings, the reid embeddings of {where} are {meta['dim']}-d: "
            f"they were built with {built}"
        )
    current = model_fingerprint(model)
    if current != meta.get("model_fingerprint"):
        raise GalleryIndexError(
            f"the reid embeddings of {where} were built with another ViSA model, {built}, not this one "
            f"(fingerprint {current}); pass that model as --reid-model"
        )
