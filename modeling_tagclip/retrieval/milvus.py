"""The gallery on Milvus: one collection per gallery, reached through ``pymilvus.MilvusClient`` only.

The same code serves a Milvus Lite file (``gallery.db``, embedded, one process at a time), Milvus Standalone
(``http://host:19530``) and a Milvus cluster: only the URI changes. Per crop the collection holds

- ``id`` (INT64 primary key): ``path_id(path)``, the first 63 bits of the SHA-256 of the path relative to the
  image root. Ids are therefore the same whichever process or rank inserts a crop, inserts are upserts by that
  key (a retried batch replaces itself, never duplicates) and a resumed build skips the ids already present;
  a hash collision between two different paths is detected and refused, never overwritten;
- ``vector``: the combined ``sqrt(1/2) [global, TSE]`` vector (``combined_vectors(..)``) whose inner
  product is the TAG-PR Eq. 14 score, so the IP metric ranks by TAG-PR Eq. 14 exactly (the global vector alone for a model
  without TSE);
- ``path``, ``view`` (the sidecar's view, else the router's; the partition key), ``router_view`` and
  ``view_score`` (the router's prediction and its probability, shown in hits), ``camera``, ``timestamp`` (UTC seconds), ``tags`` and
  ``removed`` (``remove`` flags a crop; it stays in the collection so that ``--add`` does not index it again,
  as in the embedded index). The filter fields carry scalar indexes.

Filters become one Milvus filter expression (string literals escaped by ``quote``) evaluated by the engine
before ranking; nothing is fetched and dropped. The model fingerprint, image root and index settings live in
the collection's properties; a search with another model is refused (``GalleryIndexError``).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .encode import combined_vectors, encode_texts
from .gallery_types import (
    CROP_COLUMNS,
    FOOTAGE_COLUMNS,
    VIEW_NAMES,
    GalleryIndexError,
    Hit,
    SearchFilter,
    check_finite,
    crop_id,
    crop_path,
    decode_metadata,
    gallery_root,
    list_images,
    metadata_row,
    model_fingerprint,
    parse_crop_id,
    parse_time,
    path_id,
    read_sidecar,
    safe_relative,
    sidecar_for,
)
from .ingest import Ranks, encode_crops, warn_unreadable

__all__ = [
    "INDEX_TYPES",
    "MilvusGallery",
    "check_collection_name",
    "check_uri",
    "filter_expression",
    "is_lite",
    "path_id",
    "quote",
    "session",
]

META_KEY = "tagclip.meta"
INSERT_BATCH = 1024  # rows per upsert: 1024 x 1536-d fp32 = 6 MB, well under gRPC's 64 MB message limit
MAX_TAGS, MAX_TEXT, MAX_PATH = 256, 1024, 4096
OUTPUT_FIELDS = ["path", "view", "router_view", "view_score", "camera", "timestamp", "tags", *FOOTAGE_COLUMNS]
SCALAR_INDEXES = ("path", "camera", "timestamp", "tags", "removed", "track")  # INVERTED, on the filter fields
LITE_NO_INDEX = {"tags"}  # Milvus Lite has no scalar index on ARRAY fields (its filter scans them)
LITE_WAIT_S = 600.0  # how long a rank waits for another process to release a Milvus Lite file
_LITE_USERS: dict[str, int] = {}  # open clients of each Milvus Lite file in this process
# Milvus Lite's in-process gRPC server keeps gRPC's default ping policy (no pings without calls, at most one
# per 5 min), while pymilvus pings every 10 s even when idle: the server answers the third idle ping with
# GOAWAY "too many pings", and a client idle for about 30 s is dead. A Lite client therefore pings no more
# often than the server permits; a server URI keeps pymilvus' keepalive.
LITE_GRPC_OPTIONS = {"grpc.keepalive_time_ms": 300_000, "grpc.keepalive_permit_without_calls": False}
# Vector index types: (Milvus name, build parameters). Milvus Lite builds FLAT, HNSW, IVF_FLAT and IVF_SQ8;
# IVF_PQ and DISKANN are passed through for a Milvus server. Search parameters: ``search_params``.
INDEX_TYPES = {
    "flat": ("FLAT", {}),
    "hnsw": ("HNSW", {"M": 32, "efConstruction": 200}),
    "ivf_flat": ("IVF_FLAT", {"nlist": 1024}),
    "ivf_sq8": ("IVF_SQ8", {"nlist": 1024}),
    "ivf_pq": ("IVF_PQ", {"nlist": 1024, "m": 192, "nbits": 8}),
    "diskann": ("DISKANN", {}),
}
SEARCH_PARAMS = {
    "hnsw": {"ef": 128},
    "ivf_flat": {"nprobe": 64},
    "ivf_sq8": {"nprobe": 64},
    "ivf_pq": {"nprobe": 64},
    "diskann": {"search_list": 100},
    "flat": {},
}


def _pymilvus():
    try:
        import pymilvus
    except ImportError as error:
        raise ImportError('the Milvus gallery needs pymilvus: pip install "tag-clip[milvus]"') from error
    return pymilvus


def quote(text: str) -> str:
    """``text`` as a Milvus filter string literal: double-quoted, ``\\`` and ``"`` escaped; control characters
    (which Milvus string literals cannot spell) are refused."""
    text = str(text)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValueError(f"filter value {text!r} contains a control character")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _number(value: float) -> str:
    return repr(float(value))


def filter_expression(search_filter: SearchFilter | dict | None) -> str:
    """The Milvus filter expression of a ``SearchFilter``: never a removed crop; view, camera(s), time window
    ``[after, before)``, tag, track(s)."""
    terms = ["removed == false"]
    spec = SearchFilter.of(search_filter)
    if spec is None:
        return terms[0]
    if spec.view is not None:
        terms.append(f"view == {quote(spec.view)}")
    for field, ids in (("camera", spec.cameras()), ("track", spec.tracks())):
        if ids is not None:
            terms.append(f"{field} in [{', '.join(quote(i) for i in ids)}]")
    if spec.after is not None:
        terms.append(f"timestamp >= {_number(parse_time(spec.after))}")
    if spec.before is not None:
        terms.append(f"timestamp < {_number(parse_time(spec.before))}")
    if spec.tag is not None:
        terms.append(f"array_contains(tags, {quote(spec.tag)})")
    return " and ".join(terms)


def is_lite(uri: str) -> bool:
    """A Milvus Lite file (``*.db``) rather than a server URI."""
    return str(uri).endswith(".db") and "://" not in str(uri)


COLLECTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")
# the schemes of store.MILVUS_SCHEMES (store imports this module: no import back)
SERVER_SCHEMES = ("http://", "https://", "tcp://", "grpc://", "unix:")


def check_collection_name(name: Any) -> str:
    """``name`` if Milvus accepts it as a collection name, else a ``GalleryIndexError`` that states the rule."""
    if isinstance(name, str) and COLLECTION_NAME.fullmatch(name):
        return name
    shown = (
        f"{name[:40]!r}... ({len(name)} characters)"
        if isinstance(name, str) and len(name) > 40
        else repr(name)
    )
    raise GalleryIndexError(
        f"collection name {shown} is not a valid Milvus name: letters, digits and underscores, starting with a "
        "letter or an underscore, at most 255 characters"
    )


def check_uri(uri: str) -> str:
    """``uri`` if it names a Milvus server (``http(s)://``, ``tcp://``, ``grpc://``, ``unix:``) or a Milvus Lite
    ``*.db``, else a ``GalleryIndexError``: ``foo.txt`` is not taken for an index folder."""
    text = str(uri)
    if text.startswith(SERVER_SCHEMES) or is_lite(text):
        return text
    raise GalleryIndexError(
        f"{text!r} is not a Milvus URI: give a server (http://HOST:19530, https://..., tcp://..., grpc://..., "
        "unix:PATH) or a Milvus Lite database ending in .db (an index folder goes to --index / --output)"
    )


def milvus_errors() -> tuple[type[BaseException], ...]:
    """pymilvus' exception type, once pymilvus is in use (else nothing to catch)."""
    import sys

    pymilvus = sys.modules.get("pymilvus")
    return (pymilvus.exceptions.MilvusException,) if pymilvus is not None else ()


def describe_milvus_error(error: BaseException, uri: str) -> str:
    """One line for a failed Milvus call: its message (not the exception's repr), with what to do on a full disk."""
    message = " ".join(str(getattr(error, "message", "") or error).split())
    full = "no space left" in message.lower() or "errno 28" in message.lower()
    advice = "; the disk is full: free some space and run the command again (rows already added are kept)"
    return f"Milvus at {uri}: {message}{advice if full else ''}"


def _check_lite_path(uri: str, create: bool) -> None:
    """A Milvus Lite database is a folder ``*.db``: refuse a file there, and a missing one unless creating."""
    path = Path(uri)
    if path.exists() and not path.is_dir():
        raise GalleryIndexError(
            f"{uri} is not a Milvus Lite database: it is a file (Milvus Lite keeps a gallery in a folder *.db)"
        )
    if not create and not path.exists():
        raise GalleryIndexError(
            f"no Milvus Lite database at {uri}; build one with `tagclip index --milvus-uri {uri} --collection NAME ...`"
        )


class MilvusGallery:
    """A gallery in a Milvus collection (``GalleryStore``): ``MilvusGallery(uri, collection)`` opens an
    existing one; ``MilvusGallery.create(...)`` makes one. ``token``: a server's credentials (default: the
    ``MILVUS_TOKEN`` environment variable); ``image_root``: where the crops live now, if moved."""

    def __init__(
        self,
        uri: str,
        collection: str,
        *,
        token: str | None = None,
        image_root: str | os.PathLike | None = None,
        search_params: dict[str, float] | None = None,
        wait_s: float = 0.0,
    ):
        self.uri, self.collection = check_uri(uri), check_collection_name(collection)
        self.token = token if token is not None else os.environ.get("MILVUS_TOKEN", "")
        self.client = _connect(self.uri, self.token, wait_s)
        try:
            if not self.client.has_collection(collection):
                raise GalleryIndexError(
                    f"no collection {collection!r} at {self.uri}; build it with `tagclip index --milvus-uri "
                    f"{self.uri} --collection {collection} ...`"
                )
            self.meta = _read_meta(self.client, collection, self.uri)
            self.fields = _field_names(self.client, collection)
            self.client.load_collection(collection)
        except BaseException:
            self.close()
            raise
        root = image_root if image_root is not None else self.meta.get("image_root", "")
        where = f"Milvus collection {collection!r} at {self.uri}"
        self.image_root = gallery_root(root, where) if root else None
        self.search_params = {
            **SEARCH_PARAMS.get(self.meta["index_type"], {}),
            **self.meta.get("search_params", {}),
            **(search_params or {}),
        }

    @classmethod
    def create(
        cls,
        uri: str,
        collection: str,
        *,
        dim: int,
        fingerprint: str | None,
        image_root: str | os.PathLike,
        model: str = "",
        embed_dims: dict[str, int] | None = None,
        index_type: str = "flat",
        index_params: dict[str, float] | None = None,
        token: str | None = None,
        wait_s: float = 0.0,
    ) -> MilvusGallery:
        """Create ``collection`` (``dim``-d combined vectors, ``index_type`` in ``INDEX_TYPES``); an existing
        collection is opened instead if it was made for the same model, image root and index type."""
        check_uri(uri), check_collection_name(collection)
        if index_type not in INDEX_TYPES:
            raise GalleryIndexError(f"index type must be one of {sorted(INDEX_TYPES)}, got {index_type!r}")
        meta = {
            "model": model,
            "model_fingerprint": fingerprint,
            "image_root": str(image_root),
            "dim": int(dim),
            "embed_dims": embed_dims or {},
            "index_type": index_type,
            "index_params": {**INDEX_TYPES[index_type][1], **(index_params or {})},
        }
        token = token if token is not None else os.environ.get("MILVUS_TOKEN", "")
        client = _connect(str(uri), token, wait_s, create=True)
        try:
            if client.has_collection(collection):
                _check_same(_read_meta(client, collection, uri), meta, uri, collection)
            else:
                _create(client, collection, {**meta, "lite": is_lite(str(uri))})
        finally:
            _disconnect(client, str(uri))
        return cls(uri, collection, token=token, wait_s=wait_s)

    def close(self) -> None:
        """Close the connection (for a Milvus Lite file: stop its in-process server, releasing the file)."""
        if getattr(self, "client", None) is not None:
            _disconnect(self.client, self.uri)
            self.client = None

    def __enter__(self) -> MilvusGallery:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # -- GalleryStore ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        rows = self.client.query(self.collection, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    @property
    def fingerprint(self) -> str | None:
        return self.meta.get("model_fingerprint")

    def count(self) -> int:
        """Crops a search can return (not removed)."""
        rows = self.client.query(self.collection, filter="removed == false", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def describe(self) -> dict[str, Any]:
        """Backend, location, model, fingerprint, image root, rows and searchable crops."""
        return {
            "backend": "milvus",
            "location": f"{self.uri} collection {self.collection}",
            "model": self.meta.get("model"),
            "model_fingerprint": self.fingerprint,
            "image_root": str(self.image_root) if self.image_root else None,
            "rows": len(self),
            "searchable": self.count(),
        }

    def check_model(self, model: Any) -> None:
        """Raise ``GalleryIndexError`` unless ``model`` is the model that built the collection."""
        current = model_fingerprint(model)
        if self.fingerprint is not None and self.fingerprint != current:
            raise GalleryIndexError(
                f"Milvus collection {self.collection!r} was built with a different model (fingerprint "
                f"{self.fingerprint}, model {self.meta.get('model') or '?'}) than the one querying it "
                f"(fingerprint {current}); rebuild it with this model into a new collection"
            )

    def add(
        self,
        embeds: dict[str, torch.Tensor],
        paths: Sequence[str],
        records: Sequence[dict[str, Any] | None] | None = None,
        *,
        removed: Collection[int] = (),
    ) -> int:
        """Upsert encoded crops (paths relative to the image root; ``records``: camera, timestamp, tags, view)
        in batches of ``INSERT_BATCH``, skipping crops already present; each batch is one upsert (atomic as
        far as the engine makes it), so an interrupted add re-run completes it. Rows ``removed`` (positions,
        e.g. unreadable images) go in flagged removed: never returned, never indexed again. Returns the rows
        added."""
        rels = [safe_relative(Path(p).as_posix(), f"Milvus collection {self.collection!r}") for p in paths]
        records = list(records) if records is not None else [None] * len(rels)
        self._check_rows(embeds, rels, records)
        vectors = combined_vectors(embeds)
        probs, added = embeds.get("view_probs"), 0
        for start in range(0, len(rels), INSERT_BATCH):
            stop = min(start + INSERT_BATCH, len(rels))
            present = self._present(rels[start:stop])
            rows = [
                self._fit(
                    _row(
                        rels[i], vectors[i], records[i], probs[i] if probs is not None else None, i in removed
                    )
                )
                for i in range(start, stop)
                if rels[i] not in present
            ]
            if rows:
                self.client.upsert(self.collection, rows)
                added += len(rows)
        return added

    def flush(self) -> None:
        """Seal the rows inserted so far into segments and build their vector index (Milvus does it in the
        background; Milvus Lite searches unsealed rows by brute force in Python until then)."""
        self.client.flush(self.collection)

    def present(self, paths: Sequence[str]) -> set[str]:
        """The paths (relative to the image root) of ``paths`` the collection already holds."""
        found: set[str] = set()
        for start in range(0, len(paths), INSERT_BATCH):
            found |= self._present(list(paths[start : start + INSERT_BATCH]))
        return found

    def remove(self, paths: Sequence[str] = (), ids: Sequence[int] = ()) -> int:
        """Flag crops (paths relative to the image root or absolute under it, or ids) as removed: never
        returned again, kept so that ``--add`` does not index them again. Returns how many were newly removed."""
        rels = [self._relative(p) for p in paths]
        keys = {path_id(rel): rel for rel in rels} | {int(i): None for i in ids}
        rows = self._get(list(keys), ["*"])
        found = {row["id"]: row for row in rows if keys[row["id"]] in (None, row["path"])}
        missing = [keys[k] if keys[k] is not None else k for k in keys if k not in found]
        if missing:
            raise GalleryIndexError(f"not in Milvus collection {self.collection!r}: {missing[:5]}")
        fresh = [{**row, "removed": True} for row in found.values() if not row["removed"]]
        for start in range(0, len(fresh), INSERT_BATCH):
            self.client.upsert(self.collection, fresh[start : start + INSERT_BATCH])
        return len(fresh)

    def search(
        self, query: dict[str, torch.Tensor], top_k: int = 10, filters: SearchFilter | dict | None = None
    ) -> list[list[Hit]]:
        """Ranked hits (TAG-PR Eq. 14 by the IP of combined vectors) for every query row among the crops ``filters``
        allow (one Milvus filter expression, see ``filter_expression``)."""
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        expression = filter_expression(filters)
        check_finite(query, list(range(query["global"].shape[0])), "query")
        spec = SearchFilter.of(filters)
        if (
            spec is not None and spec.track is not None and "track" not in self.fields
        ):  # made before tracks existed: none match
            return [[] for _ in range(query["global"].shape[0])]
        vectors = combined_vectors(query)
        if vectors.shape[1] != self.meta["dim"]:
            raise GalleryIndexError(
                f"query vectors have {vectors.shape[1]} dims, Milvus collection {self.collection!r} "
                f"{self.meta['dim']}: the collection was built with another model"
            )
        found = self.client.search(
            self.collection,
            data=vectors.numpy().tolist(),
            filter=expression,
            limit=top_k,
            output_fields=[f for f in OUTPUT_FIELDS if f in self.fields],
            anns_field="vector",
            search_params={"metric_type": "IP", "params": self.search_params},
        )
        return [[self._hit(rank, hit) for rank, hit in enumerate(hits, start=1)] for hits in found]

    def crop_embeddings(self, ids: Sequence[str]) -> dict[str, torch.Tensor]:
        """The stored TAG-PR Eq. 14 embeddings (``global``, ``local``; float32 [len(ids), d]) of the crops with these hit
        ids, in that order, taken apart from the stored combined vectors (no image is read);
        ``GalleryIndexError`` naming an id that no searchable crop has."""
        keys = [parse_crop_id(i) for i in ids]
        rows = {row["id"]: row for row in self._get(sorted(set(keys)), ["vector", "removed"])}
        for hit_id, key in zip(ids, keys, strict=True):
            if key not in rows or rows[key]["removed"]:
                raise GalleryIndexError(
                    f"no crop with hit id {hit_id} in Milvus collection {self.collection!r}"
                )
        return self._parts([rows[key]["vector"] for key in keys])

    def track_embeddings(self, camera: str | None, track: str) -> dict[str, torch.Tensor]:
        """The stored TAG-PR Eq. 14 embeddings of every searchable crop of ``track`` on ``camera`` (None: crops without
        a camera), in path order; ``GalleryIndexError`` when there is no such track."""
        rows = []
        if "track" in self.fields:
            where = f"camera == {quote(camera)}" if camera is not None else "camera is null"
            expression = f"removed == false and track == {quote(str(track))} and {where}"
            rows = self.client.query(self.collection, filter=expression, output_fields=["path", "vector"])
        if not rows:
            raise GalleryIndexError(
                f"no track {camera or ''}:{track} in Milvus collection {self.collection!r}"
            )
        return self._parts([row["vector"] for row in sorted(rows, key=lambda row: row["path"])])

    def rows(
        self, filter: str = "", fields: Sequence[str] = ("id",), batch: int = 1000
    ) -> Iterator[list[dict]]:
        """Every row matching the Milvus ``filter`` expression, ``fields`` of each, ``batch`` rows at a time."""
        found = self.client.query_iterator(
            self.collection, batch_size=batch, filter=filter, output_fields=list(fields)
        )
        try:
            while rows := found.next():
                yield rows
        finally:
            found.close()

    def allowed_ids(self, filters: SearchFilter | dict | None = None) -> list[int]:
        """The ids of the crops a search with ``filters`` may return (not removed, matching them)."""
        spec = SearchFilter.of(filters)
        if spec is not None and spec.track is not None and "track" not in self.fields:
            return []
        expression = filter_expression(filters)
        return [row["id"] for rows in self.rows(expression) for row in rows]

    def id_keys(self, ids: Sequence[str]) -> list[int]:
        """The keys (``path_id``) of the searchable crops with these hit ids, in that order;
        ``GalleryIndexError`` naming an id no searchable crop has."""
        keys = [parse_crop_id(i) for i in ids]
        rows = {row["id"]: row for row in self._get(sorted(set(keys)), ["removed"])}
        for hit_id, key in zip(ids, keys, strict=True):
            if key not in rows or rows[key]["removed"]:
                raise GalleryIndexError(
                    f"no crop with hit id {hit_id} in Milvus collection {self.collection!r}"
                )
        return keys

    def track_keys(self, camera: str | None, track: str) -> list[int]:
        """The keys of every searchable crop of ``track`` on ``camera``, in path order; ``GalleryIndexError``
        when there is no such track."""
        rows = []
        if "track" in self.fields:
            where = f"camera == {quote(camera)}" if camera is not None else "camera is null"
            expression = f"removed == false and track == {quote(str(track))} and {where}"
            rows = self.client.query(self.collection, filter=expression, output_fields=["path"])
        if not rows:
            raise GalleryIndexError(
                f"no track {camera or ''}:{track} in Milvus collection {self.collection!r}"
            )
        return [row["id"] for row in sorted(rows, key=lambda row: row["path"])]

    def hits_of(self, scored: Sequence[tuple[int, float]]) -> list[Hit]:
        """Ranked hits of (key, score) pairs, in that order, with the crops' metadata."""
        fields = [f for f in OUTPUT_FIELDS if f in self.fields]
        rows = {row["id"]: row for row in self._get([key for key, _ in scored], fields)}
        found = [{"id": key, "distance": score, "entity": rows[key]} for key, score in scored]
        return [self._hit(rank, hit) for rank, hit in enumerate(found, start=1)]

    def _parts(self, vectors: list) -> dict[str, torch.Tensor]:
        """``global`` and ``local`` of combined vectors ``sqrt(1/2) [global, local]`` (``combined_vectors``)."""
        stacked = torch.tensor([list(v) for v in vectors], dtype=torch.float32)
        dims = self.meta.get("embed_dims") or {}
        if "global" not in dims:
            raise GalleryIndexError(
                f"Milvus collection {self.collection!r} does not record its embedding widths (embed_dims): its "
                "crops cannot be a query; search it by description or by image files"
            )
        if "local" not in dims:
            return {"global": stacked}
        width = int(dims["global"])
        return {"global": stacked[:, :width] * 2**0.5, "local": stacked[:, width:] * 2**0.5}

    # -- helpers -----------------------------------------------------------------------------------------

    def _hit(self, rank: int, hit: dict[str, Any]) -> Hit:
        entity = hit["entity"]
        rel, where = entity["path"], f"Milvus collection {self.collection!r} row {hit['id']}"
        path = (
            safe_relative(rel, where)
            if self.image_root is None
            else str(crop_path(self.image_root, rel, where))
        )
        fields = decode_metadata(entity, where)
        head = {"rank": rank, "score": float(hit["distance"]), "id": crop_id(rel), "index": int(hit["id"])}
        head["path"] = path
        predicted = {
            "predicted_view": entity.get("router_view"),
            "predicted_view_score": entity.get("view_score"),
        }
        return {**head, "view": fields.pop("view"), **predicted, **fields}

    def _get(self, ids: list[int], fields: list[str]) -> list[dict[str, Any]]:
        out = []
        for start in range(0, len(ids), INSERT_BATCH):
            part = ids[start : start + INSERT_BATCH]
            out += self.client.query(self.collection, filter=f"id in {part}", output_fields=fields)
        return out

    def _present(self, rels: list[str]) -> set[str]:
        """Paths of ``rels`` already in the collection; a different path under the same id is refused."""
        wanted = {path_id(rel): rel for rel in rels}
        found = set()
        for row in self._get(list(wanted), ["path"]):
            if row["path"] != wanted[row["id"]]:
                raise GalleryIndexError(
                    f"id collision in Milvus collection {self.collection!r}: {wanted[row['id']]!r} and "
                    f"{row['path']!r} hash to id {row['id']}; rename one of the files"
                )
            found.add(row["path"])
        return found

    def _relative(self, path: str) -> str:
        if not Path(path).is_absolute():
            return Path(path).as_posix()
        root = Path(self.meta.get("image_root", "")).resolve()
        try:
            return Path(path).resolve().relative_to(root).as_posix()
        except ValueError as error:
            raise GalleryIndexError(f"{path} is not under the collection's image root {root}") from error

    def _fit(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` without the footage fields a collection made before them lacks (refused when set)."""
        lacking = [f for f in FOOTAGE_COLUMNS if f not in self.fields]
        given = [f for f in lacking if row[f] is not None]
        if given:
            raise GalleryIndexError(
                f"Milvus collection {self.collection!r} was made before the {', '.join(given)} field(s) "
                f"existed ({row['path']} has them); index the footage into a new collection"
            )
        return {k: v for k, v in row.items() if k not in lacking}

    def _check_rows(self, embeds: dict[str, torch.Tensor], rels: list[str], records: list) -> None:
        if "global" not in embeds:
            raise ValueError(f"embeds needs a 'global' tensor, got keys {sorted(embeds)}")
        sizes = {key: int(value.shape[0]) for key, value in embeds.items()}
        if any(size != len(rels) for size in sizes.values()) or len(records) != len(rels):
            raise ValueError(f"{len(rels)} paths, {len(records)} records and embeds of {sizes} rows")
        if len(set(rels)) != len(rels):
            raise ValueError("the same path is given more than once")
        check_finite(embeds, rels)
        dim = combined_vectors({k: v[:1] for k, v in embeds.items()}).shape[1]
        if dim != self.meta["dim"]:
            raise GalleryIndexError(
                f"embeddings give {dim}-d vectors, Milvus collection {self.collection!r} holds {self.meta['dim']}-d"
            )


def _row(
    rel: str, vector: torch.Tensor, record: dict | None, probs: torch.Tensor | None, removed: bool = False
) -> dict[str, Any]:
    """One collection row: the validated sidecar metadata (``metadata_row``) and the predicted view."""
    predicted = VIEW_NAMES[int(probs.argmax())] if probs is not None else None
    row = dict(zip(CROP_COLUMNS, metadata_row(rel, record, predicted), strict=True))
    path, camera, track, source = row["path"], row["camera"], row["track"], row["source"]
    tags, box = (json.loads(row[k]) if row[k] else None for k in ("tags", "box"))
    if len(path.encode()) > MAX_PATH or (source is not None and len(source.encode()) > MAX_PATH):
        raise GalleryIndexError(f"metadata of {rel}: a path or source is longer than {MAX_PATH} bytes")
    if any(text is not None and len(text.encode()) > MAX_TEXT for text in (camera, track)):
        raise GalleryIndexError(f"metadata of {rel}: camera or track is longer than {MAX_TEXT} bytes")
    if tags is not None and (len(tags) > MAX_TAGS or any(len(t.encode()) > MAX_TEXT for t in tags)):
        raise GalleryIndexError(f"metadata of {rel}: at most {MAX_TAGS} tags of {MAX_TEXT} bytes each")
    score = float(probs.max()) if probs is not None else None
    return {
        **row,
        "id": path_id(path),
        "vector": vector.tolist(),
        "view": row["view"] or "",
        "router_view": predicted,
        "view_score": score,
        "tags": tags,
        "box": box,
        "removed": removed,
    }


def _field_names(client: Any, collection: str) -> set[str]:
    return {field["name"] for field in client.describe_collection(collection).get("fields", [])}


def _create(client: Any, collection: str, meta: dict) -> None:
    """Create the collection: schema, vector and scalar indexes, ``meta`` in its properties."""
    data_type = _pymilvus().DataType
    schema = client.create_schema(
        auto_id=False, enable_dynamic_field=False, description="TAG-CLIP gallery (tag-clip)"
    )
    schema.add_field("id", data_type.INT64, is_primary=True)
    schema.add_field("vector", data_type.FLOAT_VECTOR, dim=meta["dim"])
    schema.add_field("path", data_type.VARCHAR, max_length=MAX_PATH)
    schema.add_field("view", data_type.VARCHAR, max_length=16, is_partition_key=True)
    schema.add_field("router_view", data_type.VARCHAR, max_length=16, nullable=True)
    schema.add_field("view_score", data_type.FLOAT, nullable=True)
    schema.add_field("camera", data_type.VARCHAR, max_length=MAX_TEXT, nullable=True)
    schema.add_field("timestamp", data_type.DOUBLE, nullable=True)
    schema.add_field(
        "tags",
        data_type.ARRAY,
        element_type=data_type.VARCHAR,
        max_capacity=MAX_TAGS,
        max_length=MAX_TEXT,
        nullable=True,
    )
    schema.add_field("removed", data_type.BOOL)
    schema.add_field("track", data_type.VARCHAR, max_length=MAX_TEXT, nullable=True)
    schema.add_field("source", data_type.VARCHAR, max_length=MAX_PATH, nullable=True)
    schema.add_field("frame", data_type.INT64, nullable=True)
    schema.add_field("box", data_type.ARRAY, element_type=data_type.INT64, max_capacity=4, nullable=True)
    schema.add_field("t_start", data_type.DOUBLE, nullable=True)
    schema.add_field("t_end", data_type.DOUBLE, nullable=True)
    index = client.prepare_index_params()
    name, _ = INDEX_TYPES[meta["index_type"]]
    index.add_index("vector", index_type=name, metric_type="IP", params=meta["index_params"])
    for field in SCALAR_INDEXES:
        if not (meta.get("lite") and field in LITE_NO_INDEX):
            index.add_index(field, index_type="INVERTED")
    client.create_collection(
        collection,
        schema=schema,
        index_params=index,
        consistency_level="Strong",
        properties={META_KEY: json.dumps(meta, sort_keys=True)},
    )


def _read_meta(client: Any, collection: str, uri: str) -> dict:
    properties = client.describe_collection(collection).get("properties", {})
    try:
        meta = json.loads(properties[META_KEY])
        int(meta["dim"]), meta["index_type"]  # noqa: B018 - both required
    except (KeyError, TypeError, ValueError) as error:
        raise GalleryIndexError(
            f"Milvus collection {collection!r} at {uri} is not a TAG-CLIP gallery (no {META_KEY} property)"
        ) from error
    return meta


def _check_same(old: dict, new: dict, uri: str, collection: str) -> None:
    for key, what in (
        ("model_fingerprint", "model"),
        ("image_root", "image root"),
        ("dim", "vector width"),
        ("index_type", "index type"),
        ("index_params", "index parameters"),
    ):
        if old.get(key) != new.get(key):
            raise GalleryIndexError(
                f"Milvus collection {collection!r} at {uri} was built with a different {what} "
                f"({old.get(key)!r}, now {new.get(key)!r}); use a new collection name"
            )


def _connect(uri: str, token: str, wait_s: float, create: bool = False) -> Any:
    """A ``MilvusClient``; for a Milvus Lite file held by another process, retry for up to ``wait_s`` s. Only
    ``create`` makes a Milvus Lite database (and its folder): opening a missing one creates nothing."""
    pymilvus = _pymilvus()
    if is_lite(uri):
        _check_lite_path(uri, create)
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            options = {"grpc_options": LITE_GRPC_OPTIONS} if is_lite(uri) else {}
            client = pymilvus.MilvusClient(uri=uri, token=token, **options)
            if is_lite(uri):
                _LITE_USERS[os.path.abspath(uri)] = _LITE_USERS.get(os.path.abspath(uri), 0) + 1
            return client
        except pymilvus.exceptions.MilvusException as error:
            if not is_lite(uri) or time.monotonic() >= deadline:
                raise GalleryIndexError(_open_failure(uri, error)) from error
            time.sleep(0.2)


def _open_failure(uri: str, error: BaseException) -> str:
    """Why a Milvus connection failed: another process holding a Milvus Lite database, or Milvus's message."""
    if is_lite(uri) and _lite_locked(uri):
        return (
            f"another process is using the Milvus Lite database {uri} (Milvus Lite opens it in one process at a "
            "time): run the command again when that process has finished; nothing was changed"
        )
    return f"cannot open Milvus at {uri}: {' '.join(str(getattr(error, 'message', '') or error).split())}"


def _lite_locked(uri: str) -> bool:
    """Whether a process holds Milvus Lite's ``flock`` on ``uri/LOCK`` (tested without creating anything)."""
    import fcntl

    try:
        fd = os.open(Path(uri) / "LOCK", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _disconnect(client: Any, uri: str) -> None:
    client.close()
    if not is_lite(uri):
        return
    key = os.path.abspath(uri)
    _LITE_USERS[key] -= 1
    if _LITE_USERS[key] == 0:  # pymilvus keeps the in-process Lite server (and its file lock) until exit
        del _LITE_USERS[key]  # otherwise; it serves every client of this process, so the last one stops it
        try:
            from milvus_lite.server_manager import server_manager_instance
        except ImportError:  # pragma: no cover - a Lite URI opened, so milvus-lite is installed
            return
        server_manager_instance.release_server(key)


@contextmanager
def session(uri: str, collection: str, shared: bool, **kwargs: Any) -> Iterator[MilvusGallery]:
    """An open gallery for one unit of work; ``shared`` (several processes writing one Milvus Lite file):
    wait for the file, release it afterwards."""
    gallery = MilvusGallery(uri, collection, wait_s=LITE_WAIT_S if shared else 0.0, **kwargs)
    try:
        yield gallery
    finally:
        gallery.close()


# ---------------------------------------------------------------------------------------------------------
# Building: every rank encodes its shards and upserts its own rows
# ---------------------------------------------------------------------------------------------------------


def index_into_milvus(
    model: Any,
    processor: Any,
    images: str | os.PathLike,
    uri: str,
    collection: str,
    *,
    add: bool = False,
    index_type: str = "flat",
    index_params: dict[str, float] | None = None,
    metadata: str | os.PathLike | dict | None = None,
    shard_size: int = 512,
    batch_size: int = 32,
    progress: bool = False,
    model_name: str = "",
    **encode_kwargs: Any,
) -> int:
    """Encode every image under ``images`` not yet in ``collection`` and upsert it, shard by shard; returns
    the rows this process added. Under ``torchrun`` / ``accelerate launch`` rank r takes shards j with
    j mod world == r and writes its own rows (no merge step); several ranks writing one Milvus Lite file
    take turns on it per shard. Killed and re-run, it encodes only the crops not yet present. Without
    ``add`` the collection is created (or, made earlier for the same model, image root and index settings,
    resumed) with ``images`` as its image root; with ``add`` ``images`` is that root or a folder inside it."""
    folder = Path(images).resolve()
    sidecar = read_sidecar(metadata) if isinstance(metadata, (str, os.PathLike)) else dict(metadata or {})
    files = list_images(folder)
    ranks = Ranks()
    if ranks.rank == 0:
        _prepare(model, processor, folder, uri, collection, add, index_type, index_params, model_name)
    ranks.barrier()
    added = 0
    with _Writer(uri, collection, shared=is_lite(uri) and ranks.world > 1) as writer:
        root = Path(writer.use(lambda gallery: gallery.meta["image_root"]))
        if not folder.is_relative_to(root):
            raise GalleryIndexError(f"images must be under the collection's image root {root}, got {folder}")
        rels = [f.relative_to(root).as_posix() for f in files]
        records = sidecar_for(sidecar, folder, root, rels)
        for start in range(ranks.rank * shard_size, len(files), ranks.world * shard_size):
            part = rels[start : start + shard_size]
            present = writer.use(lambda gallery, part=part: gallery.present(part))
            todo = [i for i, rel in enumerate(part) if rel not in present]
            if todo:
                crops = [files[start + i] for i in todo]
                embeds, bad = encode_crops(model, processor, crops, batch_size, progress, **encode_kwargs)
                paths, meta = [part[i] for i in todo], [records.get(part[i]) for i in todo]
                warn_unreadable(paths, bad)
                added += writer.use(
                    lambda gallery, e=embeds, p=paths, m=meta, b=bad: gallery.add(e, p, m, removed=b)
                )
        writer.use(lambda gallery: gallery.flush())
    ranks.barrier()
    return added


def _prepare(model, processor, folder, uri, collection, add, index_type, index_params, model_name) -> None:
    """Rank 0: create the collection (or check the one to resume or grow) before any rank writes to it."""
    if add:
        with session(uri, collection, False) as gallery:
            gallery.check_model(model)
        return
    probe = encode_texts(model, processor, "a person")
    dims = {key: int(value.shape[1]) for key, value in probe.items()}
    dim = int(combined_vectors(probe).shape[1])
    MilvusGallery.create(
        uri,
        collection,
        dim=dim,
        fingerprint=model_fingerprint(model),
        image_root=folder,
        model=model_name,
        embed_dims=dims,
        index_type=index_type,
        index_params=index_params,
    ).close()


class _Writer:
    """One rank's access to the collection: held open, or, for ranks sharing a Milvus Lite file (one process
    at a time), opened for each unit of work and released after it."""

    def __init__(self, uri: str, collection: str, shared: bool):
        self.uri, self.collection, self.shared = uri, collection, shared
        self.gallery = None if shared else MilvusGallery(uri, collection)

    def use(self, work: Any) -> Any:
        if self.gallery is not None:
            return work(self.gallery)
        with session(self.uri, self.collection, True) as gallery:
            return work(gallery)

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *_: Any) -> None:
        if self.gallery is not None:
            self.gallery.close()
