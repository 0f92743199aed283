"""The gallery interface every backend implements: the embedded faiss + SQLite index and Milvus.

A gallery holds, per crop, the TAG-PR Eq. 14 embeddings of one model (``global``, ``local`` = TSE, optional
``view_probs``), the crop's path and its metadata (``gallery_types.METADATA_FIELDS``). Searches rank by TAG-PR Eq. 14
among the crops a ``SearchFilter`` allows (filters are applied by the backend before ranking, never by
over-fetching and dropping) and return the same ``Hit`` dicts from every backend. A query is embeddings: of
texts (``encode_texts``), of images (``encode_images``: query by example), of crops already in the gallery
(``crop_embeddings`` by hit id, ``track_embeddings``: no image is read) or vectors computed elsewhere.

``open_gallery(location)`` picks the backend from the location: a Milvus URI (``http(s)://``,
``tcp://``, ``unix:``, or a Milvus Lite file ``*.db``) with a ``collection``, otherwise an index folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .gallery_types import Hit, SearchFilter

__all__ = ["GalleryStore", "is_milvus_uri", "open_gallery"]

MILVUS_SCHEMES = ("http://", "https://", "tcp://", "grpc://", "unix:")


@runtime_checkable
class GalleryStore(Protocol):
    """What a gallery backend offers (``GalleryIndex`` for the embedded index, ``MilvusGallery``)."""

    meta: dict[str, Any]

    def __len__(self) -> int:
        """Number of rows ever added (removed rows included; they are never returned)."""
        ...

    @property
    def fingerprint(self) -> str | None:
        """``model_fingerprint`` of the model whose embeddings the gallery holds (None when unknown)."""
        ...

    def check_model(self, model: Any) -> None:
        """Raise ``GalleryIndexError`` unless ``model`` is the model that built the gallery."""
        ...

    def add(
        self,
        embeds: dict[str, torch.Tensor],
        paths: Sequence[str],
        records: Sequence[dict[str, Any] | None] | None = None,
    ) -> int:
        """Append encoded crops (paths relative to the image root; ``records``: ``METADATA_FIELDS``), all or
        nothing for the embedded index, batch by batch for Milvus; crops already present are skipped by Milvus
        and refused by the embedded index. Returns the number of rows added."""
        ...

    def remove(self, paths: Sequence[str] = (), ids: Sequence[int] = ()) -> int:
        """Remove crops by path or row id from every later search; returns how many were removed."""
        ...

    def search(
        self, query: dict[str, torch.Tensor], top_k: int = 10, filters: SearchFilter | dict | None = None
    ) -> list[list[Hit]]:
        """Ranked hits (TAG-PR Eq. 14) for every query row among the crops ``filters`` allow."""
        ...

    def crop_embeddings(self, ids: Sequence[str]) -> dict[str, torch.Tensor]:
        """The stored ``global`` and ``local`` embeddings [len(ids), d] of the crops with these hit ids (a hit's
        ``id``), in that order; ``GalleryIndexError`` for an id no searchable crop has."""
        ...

    def track_embeddings(self, camera: str | None, track: str) -> dict[str, torch.Tensor]:
        """The stored embeddings of every searchable crop of ``track`` on ``camera`` (None: no camera), in path
        order; ``GalleryIndexError`` when there is no such track."""
        ...

    def count(self) -> int:
        """Number of crops a search can return (removed and skipped rows left out)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the gallery is: backend, location, model and its fingerprint, image root, rows, searchable."""
        ...

    def close(self) -> None:
        """Release the gallery's files or connection."""
        ...


def is_milvus_uri(location: str | None) -> bool:
    """True for a Milvus server URI or a Milvus Lite file (``*.db``)."""
    text = str(location or "")
    return text.startswith(MILVUS_SCHEMES) or text.endswith(".db")


def open_gallery(location: str, collection: str | None = None, **kwargs: Any) -> GalleryStore:
    """Open a gallery: a Milvus URI with ``collection``, or an embedded index folder (``GalleryIndex.load``)."""
    if is_milvus_uri(location):
        if not collection:
            raise ValueError(f"{location} is a Milvus URI: name the collection to search (collection=...)")
        from .milvus import MilvusGallery

        return MilvusGallery(location, collection, **kwargs)
    from .embedded.gallery_index import GalleryIndex

    return GalleryIndex.load(location, **kwargs)
