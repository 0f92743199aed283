"""Person queries beyond a description: crops of the person, a track of the gallery, and text fused with them.

Every query is a dict of unit embeddings (``global``, and ``local`` = TSE for TAG-CLIP) that every gallery
backend ranks by TAG-PR Eq. 14, which is linear in each part of the query. So:

- **score fusion** (``fuse``): the query ``w q_text + (1 - w) q_image`` (each part, not renormalised) scores
  every crop ``w s_text + (1 - w) s_image``, exactly, on the embedded index and on Milvus alike;
- **a set of crops** (``set_query``, rule ``mean``): the mean of their embeddings scores every crop by the mean
  of its TAG-PR Eq. 14 scores against them (the set-to-set rule ``max`` ranks by the best single crop instead:
  ``best_of``, one search per crop, hits merged by their highest score).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SET_RULES", "best_of", "fuse", "set_query"]

SET_RULES = ("mean", "max")


def _check(query: dict[str, torch.Tensor], what: str) -> None:
    if "global" not in query or query["global"].ndim != 2 or not len(query["global"]):
        raise ValueError(f"{what} query needs [n, d] 'global' embeddings")
    if not all(bool(torch.isfinite(value).all()) for value in query.values()):
        raise ValueError(f"{what} query embeddings contain NaN or inf values")


def set_query(crops: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One query [1, d] per part from the embeddings of several crops of one person: their mean (``mean``)."""
    _check(crops, "crop set")
    return {
        key: value.float().mean(dim=0, keepdim=True) for key, value in crops.items() if key != "view_probs"
    }


def fuse(text: dict[str, torch.Tensor], image: dict[str, torch.Tensor], text_weight: float = 0.5) -> dict:
    """The query scoring ``text_weight x`` the text's TAG-PR Eq. 14 score ``+ (1 - text_weight) x`` the image's (both
    [1, d] per part; parts the two do not share are dropped, as TAG-PR Eq. 14 then uses the global part alone)."""
    if not 0.0 <= text_weight <= 1.0:
        raise ValueError(f"the text weight must lie in [0, 1], got {text_weight!r}")
    _check(text, "text")
    _check(image, "image")
    if text["global"].shape[1] != image["global"].shape[1]:
        raise ValueError(
            f"text and image embeddings differ in width ({text['global'].shape[1]} vs {image['global'].shape[1]}):"
            " they come from different models"
        )
    shared = [key for key in ("global", "local") if key in text and key in image]
    return {key: text_weight * text[key].float() + (1.0 - text_weight) * image[key].float() for key in shared}


def best_of(hits_per_crop: Sequence[list[dict[str, Any]]], top_k: int) -> list[dict[str, Any]]:
    """The ``max`` set-to-set rule: each gallery crop scored by its best score over the query crops (one hit
    list per query crop, from one search each), ranked, ``top_k`` kept."""
    best: dict[Any, dict[str, Any]] = {}
    for hits in hits_per_crop:
        for hit in hits:
            key = hit.get("index", hit.get("path"))
            if key not in best or hit["score"] > best[key]["score"]:
                best[key] = hit
    ranked = sorted(best.values(), key=lambda h: -h["score"])[:top_k]
    return [{**hit, "rank": rank} for rank, hit in enumerate(ranked, 1)]
