"""One entry for building or growing a gallery from a folder of crops, whichever backend holds it:
``index_gallery(model, processor, IndexRequest(images=..., out=...))`` for the embedded index, or
``IndexRequest(images=..., milvus_uri=..., collection=...)`` for Milvus.

Both backends ingest with the same pieces (``ingest``: ranks of a ``torchrun`` / ``accelerate launch`` run,
DataLoader decoding, batch encoding, unreadable crops kept as removed rows) and the same sidecar reading
(``gallery_types.read_sidecar``); each keeps its own write path as its hook: the embedded index's resumable,
checksummed sharded build (``index_build.build_index``) and Milvus' upsert by shard (``milvus_store``).
Another producer of crops (video ingest) writes its crops and sidecar and calls ``index_gallery`` too. With
``reid_model`` (a ViSA model), the crops also get their reid embeddings (``reid.add_reid``) once indexed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .embedded.ann import ANN_ON
from .embedded.index_store import read_manifest

__all__ = ["IndexRequest", "index_gallery"]

EMBEDDED_ONLY = ("overwrite", "ann", "ann_params", "store_dtype", "calibration_texts")


@dataclass(frozen=True)
class IndexRequest:
    """What to index and where: ``images`` (a folder of crops; with ``add``, the gallery's image root or a folder
    inside it) into an index folder ``out`` or a Milvus ``milvus_uri`` + ``collection``. ``metadata``: a CSV/JSON
    sidecar path or ``{path: record}`` (``gallery_types.METADATA_FIELDS``)."""

    images: str | os.PathLike
    out: str | os.PathLike | None = None
    milvus_uri: str | None = None
    collection: str | None = None
    add: bool = False
    metadata: str | os.PathLike | dict | None = None
    batch_size: int | None = None  # None: 256 on a GPU, 32 on CPU
    shard_size: int = 512
    dtype: str | None = None  # autocast dtype of the model (bf16, fp16)
    num_workers: int = 0
    device: str | None = None
    progress: bool = True
    model_name: str | None = None
    overwrite: bool = False  # the embedded index only, as the three below
    ann: str | None = None
    ann_params: dict[str, float] | None = None
    store_dtype: str | None = None
    ann_on: str = ANN_ON
    calibration_texts: Sequence[str] | None = (
        None  # captions a new ANN calibrates on (None: the default ones)
    )
    index_type: str = "flat"  # Milvus only, as index_params
    index_params: dict[str, float] | None = None
    reid_model: Any = None  # a ViSA model: reid embeddings too (``reid.add_reid``)
    reid_model_name: str = ""

    def __post_init__(self) -> None:
        if (self.out is None) == (self.milvus_uri is None):
            raise ValueError("an index request names one gallery: an index folder (out) or a Milvus URI")
        if self.milvus_uri is not None:
            if not self.collection:
                raise ValueError(f"{self.milvus_uri} is a Milvus URI: name the collection to index into")
            given = [name for name in EMBEDDED_ONLY if getattr(self, name)]
            if given:
                raise ValueError(f"{', '.join(given)} are for the embedded index, not a Milvus collection")


def index_gallery(model: Any, processor: Any, request: IndexRequest) -> int:
    """Encode the crops of ``request.images`` not yet in the gallery and add them (resuming an interrupted run),
    then, with ``request.reid_model``, embed every crop without a reid embedding (rank 0); returns the rows
    added (by this process, under several ranks writing to Milvus)."""
    added = _index_tagclip(model, processor, request)
    if request.reid_model is not None and int(os.environ.get("RANK", "0")) == 0:
        from .reid import add_reid

        location = request.milvus_uri or str(request.out)
        add_reid(
            request.reid_model,
            request.reid_model_name,
            location,
            request.collection,
            shard_size=request.shard_size,
            batch_size=request.batch_size or 32,
        )
    return added


def _index_tagclip(model: Any, processor: Any, request: IndexRequest) -> int:
    common = {
        "metadata": request.metadata,
        "shard_size": request.shard_size,
        "progress": request.progress,
        "dtype": request.dtype,
        "num_workers": request.num_workers,
        "device": request.device,
        "add": request.add,
    }
    if request.milvus_uri is not None:
        from .milvus import index_into_milvus

        milvus = {"index_type": request.index_type, "index_params": request.index_params}
        return index_into_milvus(
            model,
            processor,
            request.images,
            request.milvus_uri,
            request.collection,
            **common,
            **milvus,
            batch_size=request.batch_size or 32,
            model_name=request.model_name or "",
        )
    from .embedded.index_build import build_index

    manifest = read_manifest(Path(request.out)) if request.add and Path(request.out).is_dir() else None
    before = manifest["num_rows"] if manifest else 0
    embedded = {
        "overwrite": request.overwrite,
        "ann": request.ann,
        "ann_params": request.ann_params,
        "ann_on": request.ann_on,
        "calibration_texts": request.calibration_texts,
        "store_dtype": request.store_dtype,
        "model_name": request.model_name,
    }
    index = build_index(
        model, processor, request.images, request.out, batch_size=request.batch_size, **common, **embedded
    )
    return len(index) - before
