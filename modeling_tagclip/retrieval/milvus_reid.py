"""Reid (ViSA) embeddings of a Milvus gallery: a companion collection ``<collection>_reid``.

A Milvus collection cannot gain a vector field once made, so the reid embeddings of a gallery live in a
second collection keyed by the same ``id`` (``path_id`` of the crop's path): ``vector`` (the unit ViSA
embedding, searched by inner product = cosine, FLAT) and ``valid`` (False for an unreadable image). The ViSA
model's path, fingerprint and width are its ``tagclip.meta`` property.

Adding them (``add_reid_embeddings``) walks the gallery's rows in batches, embeds those the companion lacks
and upserts them by key: an interrupted run re-run goes on where it stopped, a second run adds nothing. A
search (``MilvusReid``) takes the gallery's filters and removals from the gallery collection (the ids it
allows) and ranks those ids in the companion, exactly; hits carry the gallery's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .encode import load_rgb
from .gallery_types import GalleryIndexError, crop_path, model_fingerprint
from .milvus import META_KEY, MilvusGallery
from .reid_encode import check_reid_model, reid_embeddings, reid_width

__all__ = ["MilvusReid", "add_reid_embeddings", "companion"]

ID_BATCH = 1000  # ids per Milvus filter expression (``id in [...]``)


def companion(collection: str) -> str:
    """The name of the collection holding ``collection``'s reid embeddings."""
    return f"{collection}_reid"


def _read_meta(gallery: MilvusGallery) -> dict | None:
    name = companion(gallery.collection)
    if not gallery.client.has_collection(name):
        return None
    properties = gallery.client.describe_collection(name).get("properties", {})
    try:
        return json.loads(properties[META_KEY])
    except (KeyError, TypeError, ValueError) as error:
        raise GalleryIndexError(
            f"Milvus collection {name!r} holds no reid embeddings ({META_KEY})"
        ) from error


def _create(gallery: MilvusGallery, meta: dict) -> None:
    from pymilvus import DataType

    client = gallery.client
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False, description="TAG-CLIP reid")
    schema.add_field("id", DataType.INT64, is_primary=True)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=meta["dim"])
    schema.add_field("valid", DataType.BOOL)
    index = client.prepare_index_params()
    index.add_index("vector", index_type="FLAT", metric_type="IP", params={})
    client.create_collection(
        companion(gallery.collection),
        schema=schema,
        index_params=index,
        consistency_level="Strong",
        properties={META_KEY: json.dumps(meta)},
    )


def add_reid_embeddings(
    uri: str,
    collection: str,
    model: Any,
    model_name: str,
    shard_size: int = 512,
    batch_size: int = 32,
    progress: bool = False,
) -> int:
    """Embed with ViSA ``model`` every crop of ``collection`` its companion lacks (``shard_size`` crops per
    upsert); returns how many. Another ViSA model than the one that made the companion is refused."""
    with MilvusGallery(uri, collection) as gallery:
        where = f"Milvus collection {collection!r}"
        meta = _read_meta(gallery)
        if meta is None:
            meta = {
                "model": model_name,
                "model_fingerprint": model_fingerprint(model),
                "dim": reid_width(model),
            }
            _create(gallery, meta)
        else:
            check_reid_model(meta, model, where)
        name, added = companion(collection), 0
        gallery.client.load_collection(name)
        for rows in gallery.rows("", ("id", "path", "view", "removed"), batch=shard_size):
            have = _present(gallery, name, [row["id"] for row in rows])
            todo = [row for row in rows if row["id"] not in have]
            if todo:
                gallery.client.upsert(name, _embedded(gallery, model, todo, batch_size))
                added += len(todo)
                if progress:
                    print(f"reid embeddings: {added} crops added", flush=True)
        gallery.client.flush(name)
    return added


def _present(gallery: MilvusGallery, name: str, ids: list[int]) -> set[int]:
    found: set[int] = set()
    for start in range(0, len(ids), ID_BATCH):
        part = ids[start : start + ID_BATCH]
        found |= {r["id"] for r in gallery.client.query(name, filter=f"id in {part}", output_fields=["id"])}
    return found


def _embedded(gallery: MilvusGallery, model: Any, rows: list[dict], batch_size: int) -> list[dict]:
    """Companion rows of gallery ``rows``: removed crops and unreadable images get a zero, invalid vector."""
    images, views, where = [], [], []
    for i, row in enumerate(rows):
        image = None
        if not row["removed"] and gallery.image_root is not None:
            file = crop_path(gallery.image_root, row["path"], f"Milvus row {row['id']}")
            try:
                image = load_rgb(file) if Path(file).is_file() else None
            except ValueError:
                image = None
        if image is not None:
            images.append(image)
            views.append(row.get("view") or None)
            where.append(i)
    found = reid_embeddings(model, images, views, batch_size)
    vectors = torch.zeros(len(rows), found.shape[1] if where else reid_width(model))
    if where:
        vectors[torch.tensor(where)] = found
    valid = set(where)
    return [
        {"id": row["id"], "vector": vectors[i].tolist(), "valid": i in valid} for i, row in enumerate(rows)
    ]


class MilvusReid:
    """A ``MilvusGallery`` searched by its companion's reid embeddings (cosine), with its filters and hits."""

    def __init__(self, gallery: MilvusGallery):
        self.gallery, self.name = gallery, companion(gallery.collection)
        self.where, self.root = f"Milvus collection {gallery.collection!r}", gallery.image_root
        meta = _read_meta(gallery)
        hint = (
            f"`tagclip index --add-embeddings reid --reid-model VISA --milvus-uri {gallery.uri} "
            f"--collection {gallery.collection}`"
        )
        if meta is None:
            raise GalleryIndexError(f"{self.where} has no reid embeddings; add them with {hint}")
        self.meta = meta
        gallery.client.load_collection(self.name)
        rows = gallery.client.query(self.name, filter="", output_fields=["count(*)"])
        covered, total = int(rows[0]["count(*)"]), len(gallery)
        if covered < total:
            raise GalleryIndexError(
                f"the reid embeddings of {self.where} cover {covered} of its {total} crops; embed the rest with {hint}"
            )

    def check_model(self, model: Any) -> None:
        """``GalleryIndexError`` unless ``model`` is the ViSA model that made the reid embeddings."""
        check_reid_model(self.meta, model, self.where)

    def search(
        self, query: dict[str, torch.Tensor], top_k: int = 10, filters: Any = None
    ) -> list[list[dict]]:
        """Hits by cosine of unit query embeddings ``global`` [n, d] among the crops ``filters`` allow."""
        vectors = query["global"].float()
        if vectors.shape[1] != int(self.meta["dim"]):
            raise GalleryIndexError(
                f"query embeddings have {vectors.shape[1]} dims, the reid embeddings of {self.where} {self.meta['dim']}"
            )
        allowed = self.gallery.allowed_ids(filters)
        best: list[list[tuple[int, float]]] = [[] for _ in range(len(vectors))]
        for start in range(0, len(allowed), ID_BATCH):  # exact: each part's top k, merged
            part = allowed[start : start + ID_BATCH]
            found = self.gallery.client.search(
                self.name,
                data=vectors.numpy().tolist(),
                filter=f"valid == true and id in {part}",
                limit=top_k,
                anns_field="vector",
                search_params={"metric_type": "IP", "params": {}},
            )
            for q, hits in enumerate(found):
                best[q] += [(int(hit["id"]), float(hit["distance"])) for hit in hits]
        ranked = [sorted(pairs, key=lambda p: -p[1])[:top_k] for pairs in best]
        return [self.gallery.hits_of(pairs) if pairs else [] for pairs in ranked]

    def crop_embeddings(self, ids: list[str]) -> dict[str, torch.Tensor]:
        """The reid embeddings of the crops with these hit ids, in that order."""
        return self._vectors(self.gallery.id_keys(ids), ", ".join(ids))

    def track_embeddings(self, camera: str | None, track: str) -> dict[str, torch.Tensor]:
        """The reid embeddings of every crop of a track (those with one), in path order."""
        keys = self.gallery.track_keys(camera, track)
        rows = self._rows(keys)
        return self._vectors([k for k in keys if rows[k]["valid"]], f"track {camera or ''}:{track}")

    def _rows(self, keys: list[int]) -> dict[int, dict]:
        found: dict[int, dict] = {}
        for start in range(0, len(keys), ID_BATCH):
            part = keys[start : start + ID_BATCH]
            rows = self.gallery.client.query(
                self.name, filter=f"id in {part}", output_fields=["vector", "valid"]
            )
            found |= {row["id"]: row for row in rows}
        return found

    def _vectors(self, keys: list[int], what: str) -> dict[str, torch.Tensor]:
        rows = self._rows(keys)
        if not keys or not all(key in rows and rows[key]["valid"] for key in keys):
            raise GalleryIndexError(
                f"{what} in {self.where} has no reid embedding (its image was unreadable)"
            )
        return {"global": torch.tensor([list(rows[key]["vector"]) for key in keys], dtype=torch.float32)}
