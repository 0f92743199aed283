"""A gallery searched by its re-ID (ViSA) embeddings, on either backend, and adding them to a gallery.

``reid_gallery(gallery)`` wraps a gallery as one whose ``search``, ``crop_embeddings`` and ``track_embeddings``
use the reid embeddings (``reid_encode``) with the gallery's own filters and hits, so ``queries.person_search``
ranks it like any gallery; ``add_reid(...)`` embeds the crops a gallery holds that have no reid embedding yet.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_reid", "reid_gallery"]


def reid_gallery(gallery: Any) -> Any:
    """``gallery`` searched by its reid embeddings (``GalleryIndexError`` when it has none, or when they do not
    cover every crop)."""
    from .embedded.gallery_index import GalleryIndex

    if isinstance(gallery, GalleryIndex):
        from .embedded.reid_store import EmbeddedReid

        return EmbeddedReid(gallery)
    from .milvus_reid import MilvusReid

    return MilvusReid(gallery)


def add_reid(model: Any, model_name: str, location: str, collection: str | None = None, **kwargs: Any) -> int:
    """Embed with ViSA ``model`` every crop of the gallery at ``location`` (an index folder, or a Milvus URI
    with ``collection``) that has no reid embedding yet (resuming an interrupted run); returns how many."""
    if collection is None:
        from .embedded.reid_store import add_reid_embeddings

        return add_reid_embeddings(location, model, model_name, **kwargs)
    from .milvus_reid import add_reid_embeddings as add_milvus

    return add_milvus(location, collection, model, model_name, **kwargs)
