"""Person queries beyond a description: crops of the person, a track of the gallery, and text fused with them.

Every query is a dict of unit embeddings (``global``, and ``local`` = TSE for TAG-CLIP) that every gallery
backend ranks by TAG-PR Eq. 14, which is linear in each part of the query. So:

- **score fusion** (``fuse``): the query ``w q_text + (1 - w) q_image`` (each part, not renormalised) scores
  every crop ``w s_text + (1 - w) s_image``, exactly, on the embedded index and on Milvus alike;
- **a set of crops** (``set_query``, rule ``mean``): the mean of their embeddings scores every crop by the mean
  of its TAG-PR Eq. 14 scores against them (the set-to-set rule ``max`` ranks by the best single crop instead:
  ``best_of``, one search per crop, hits merged by their highest score; exact, as a crop among the best
  ``top_k`` by its best score is among the best ``top_k`` of the query crop that gives it).

The crops of the person come from image files (``encode_images``) or from the gallery itself
(``example_embeddings``: crops by hit id, every crop of a ``CAMERA:TRACK``, read from the stored embeddings);
``person_search`` ranks a gallery for descriptions and/or such a set, on any backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["SET_RULES", "best_of", "example_embeddings", "fuse", "parse_track", "person_search", "set_query"]

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


def parse_track(text: str) -> tuple[str | None, str]:
    """``CAMERA:TRACK`` as (camera, track), split at the last colon; an empty camera (``:7``) is a track of crops
    without a camera."""
    camera, sep, track = str(text).rpartition(":")
    if not sep or not track.strip():
        raise ValueError(f"a track is CAMERA:TRACK (e.g. ground-01:3), got {str(text)[:60]!r}")
    return camera.strip() or None, track.strip()


def example_embeddings(
    gallery: Any, like: Sequence[str] = (), tracks: Sequence[str] = ()
) -> dict[str, torch.Tensor] | None:
    """The stored embeddings [n, d] of the gallery crops with hit ids ``like`` and of every crop of each
    ``CAMERA:TRACK`` in ``tracks``, in that order (None when both are empty); no image is read."""
    parts = [gallery.crop_embeddings(list(like))] if like else []
    parts += [gallery.track_embeddings(*parse_track(track)) for track in tracks]
    return concat_sets(parts)


def concat_sets(parts: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
    """Sets of crop embeddings joined into one (their ``global`` and ``local`` parts; None when there is none)."""
    parts = [part for part in parts if part is not None]
    if not parts:
        return None
    keys = [key for key in ("global", "local") if all(key in part for part in parts)]
    return {key: torch.cat([part[key].float() for part in parts]) for key in keys}


def person_search(
    gallery: Any,
    texts: dict[str, torch.Tensor] | None,
    crops: dict[str, torch.Tensor] | None,
    top_k: int,
    filters: Any = None,
    text_weight: float = 0.5,
    set_rule: str = "mean",
) -> list[list[dict[str, Any]]]:
    """Hits of ``gallery`` for a person: one list per description in ``texts`` (fused with the ``crops`` when
    both are given, ``fuse``), or one list for the crops alone, which score by ``set_rule`` (``mean``:
    ``set_query``; ``max``: ``best_of``)."""
    if set_rule not in SET_RULES:
        raise ValueError(f"the set rule must be one of {', '.join(SET_RULES)}, got {set_rule!r}")
    if crops is None:
        if texts is None:
            raise ValueError("a person query needs a description, crops of the person, a hit id or a track")
        return gallery.search(texts, top_k=top_k, filters=filters)
    _check(crops, "crop set")
    crops = {key: value.float() for key, value in crops.items() if key in ("global", "local")}
    examples = [set_query(crops)] if set_rule == "mean" else [_row(crops, j) for j in range(_rows(crops))]
    described = [None] if texts is None else [_row(texts, i) for i in range(_rows(texts))]
    queries = [e if t is None else fuse(t, e, text_weight) for t in described for e in examples]
    stacked = {key: torch.cat([q[key] for q in queries]) for key in queries[0]}
    hits = gallery.search(stacked, top_k=top_k, filters=filters)
    if set_rule == "mean":
        return hits
    size = len(examples)
    return [best_of(hits[i * size : (i + 1) * size], top_k) for i in range(len(described))]


def _rows(query: dict[str, torch.Tensor]) -> int:
    return int(query["global"].shape[0])


def _row(query: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {key: value[i : i + 1] for key, value in query.items() if key != "view_probs"}
