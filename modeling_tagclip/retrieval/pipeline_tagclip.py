"""``text-to-person-retrieval``: a transformers pipeline that ranks a gallery of person images for a description.

``pipe("a woman in a red coat", gallery=..., top_k=5, filters={"view": "aerial"})`` → ranked hits ``{rank, score,
index, path, view, predicted_view, predicted_view_score, ...}`` (``gallery_types.Hit``: TAG-PR Eq. 14 score; view = the
crop's view, the one filtered on; predicted_view = the image-level router's prediction). ``gallery`` is a
list of PIL images or paths, a folder of images, a saved index directory (``tagclip index``), a Milvus URI
with ``collection=NAME`` (``MilvusGallery``), or a ``GalleryIndex`` / ``MilvusGallery``; it can also be given once
when the pipeline is built. A list of texts gives a list of rankings.

Hub custom-code compatible: ``save_with_pipeline`` writes this file and the gallery code it imports (``gallery_index.py``
and the rest, side by side in one folder) beside the model and records the task in ``config.json`` ``custom_pipelines``, so ``pipeline(model=REPO,
trust_remote_code=True)`` builds it where this package is not installed.
"""

from __future__ import annotations

import ast
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors import SafetensorError
from transformers import AutoModel, Pipeline

from .embedded.gallery_index import GalleryIndex
from .embedded.index_store import output_folder
from .encode import encode_texts
from .store import is_milvus_uri, open_gallery

__all__ = [
    "TASK",
    "TagClipRetrievalPipeline",
    "register_pipeline",
    "save_code",
    "save_vision_tower",
    "save_with_pipeline",
]

TASK = "text-to-person-retrieval"


class TagClipRetrievalPipeline(Pipeline):
    """Rank a gallery of person images (aerial and ground views) for free-text descriptions."""

    _load_processor = True
    _load_tokenizer = False
    _load_image_processor = False
    _load_feature_extractor = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # ProcessorSizeWarning as at load_model; processors saved by older versions have no such method
        warn_on_size = getattr(self.processor, "warn_on_size", None)
        if warn_on_size is not None:
            warn_on_size(self.model.config, getattr(self.model, "name_or_path", "") or "the model")

    def __call__(self, text: str | list[str], gallery: Any = None, **kwargs: Any):
        """Ranked hits for ``text`` (str → list of hits; list of str → list of lists)."""
        return super().__call__(text, gallery=gallery, **kwargs)

    def _sanitize_parameters(
        self,
        gallery=None,
        top_k=None,
        gallery_batch_size=None,
        progress=None,
        filters=None,
        collection=None,
        **kwargs,
    ):
        forward: dict[str, Any] = {}
        if (
            filters is not None
        ):  # e.g. {"view": "aerial", "camera": "7", "after": ..., "before": ..., "tag": ...}
            forward["filters"] = filters
        if gallery is not None:
            forward["gallery"] = self.load_gallery(
                gallery, gallery_batch_size or 32, bool(progress), collection
            )
        if top_k is not None:
            if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
                raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
            forward["top_k"] = top_k
        return {}, forward, {}

    def load_gallery(
        self, gallery: Any, batch_size: int = 32, progress: bool = False, collection: str | None = None
    ) -> Any:
        """A gallery from images, a folder, a saved index directory, a Milvus URI (with ``collection``) or a
        gallery object (``GalleryIndex``, ``MilvusGallery``)."""
        if self.processor is None:
            raise ValueError("TagClipRetrievalPipeline needs the TagClipProcessor (pass processor=...)")
        if hasattr(gallery, "search") and hasattr(gallery, "check_model"):
            gallery.check_model(self.model)
            return gallery
        if isinstance(gallery, (str, os.PathLike)) and is_milvus_uri(str(gallery)):
            store = open_gallery(str(gallery), collection)
            store.check_model(self.model)
            return store
        if isinstance(gallery, (str, os.PathLike)):
            path = Path(gallery)
            if (path / "index.json").is_file():
                index = GalleryIndex.load(path)
                index.check_model(self.model)
                return index
            if path.is_dir():
                return GalleryIndex.from_folder(self.model, self.processor, path, batch_size, progress)
            if not path.is_file():
                raise FileNotFoundError(
                    f"gallery {path} is neither an image, a folder nor an index directory"
                )
            gallery = [path]
        if isinstance(gallery, Image.Image):
            gallery = [gallery]
        return GalleryIndex.from_images(self.model, self.processor, list(gallery), batch_size, progress)

    def preprocess(self, text: str) -> dict[str, torch.Tensor]:
        if not isinstance(text, str):
            raise TypeError(f"queries must be str, got {type(text).__name__}")
        return {"text": text}

    def _forward(
        self, model_inputs: dict, gallery: GalleryIndex | None = None, top_k: int = 5, filters: Any = None
    ) -> dict:
        if gallery is None:
            raise ValueError(
                "no gallery: pass gallery=<images | folder | index directory> to the pipeline call"
            )
        query = encode_texts(self.model, self.processor, model_inputs["text"])
        if not hasattr(gallery, "topk"):  # another GalleryStore (Milvus) ranks and returns the hits itself
            return {"hits": gallery.search(query, top_k, filters=filters)[0]}
        scores, indices = gallery.topk(query, top_k, filters=filters)
        return {"scores": scores, "indices": indices, "gallery": gallery}

    def postprocess(self, model_outputs: dict) -> list[dict[str, Any]]:
        if "hits" in model_outputs:
            return model_outputs["hits"]
        return model_outputs["gallery"].hits(model_outputs["scores"][0], model_outputs["indices"][0])

    def encode_text(self, text: str | list[str]) -> dict[str, torch.Tensor]:
        """Normalised query embeddings (``global``, ``local``) without searching."""
        return encode_texts(self.model, self.processor, text)


def register_pipeline() -> None:
    """Register ``text-to-person-retrieval`` in transformers' PIPELINE_REGISTRY (idempotent)."""
    from transformers.pipelines import PIPELINE_REGISTRY

    if PIPELINE_REGISTRY.supported_tasks.get(TASK, {}).get("impl") is not TagClipRetrievalPipeline:
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=TagClipRetrievalPipeline, pt_model=AutoModel)


def save_with_pipeline(model, processor, save_directory: str | os.PathLike, **kwargs: Any) -> Path:
    """``save_pretrained`` of model and processor, plus the retrieval pipeline code and ``custom_pipelines``.

    Crash- and disk-full-safe: everything is written and fsynced in a staging folder beside ``save_directory``,
    then moved in file by file (renames: no space needed). On any error the staging folder is removed and
    ``save_directory`` is left as it was; a full disk is an OSError (ENOSPC) saying so.
    """
    register_pipeline()
    target = output_folder(save_directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        _write_with_pipeline(model, processor, staging, **kwargs)
        _fsync_tree(staging)
        _move_into(staging, target)
    except (OSError, SafetensorError) as error:
        if getattr(error, "errno", None) == errno.ENOSPC or "os error 28" in str(error):
            raise OSError(
                errno.ENOSPC,
                f"no space left on the device while saving to {target}; nothing was changed there "
                "(free some space and save again)",
            ) from error
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_with_pipeline(model, processor, folder: Path, **kwargs: Any) -> None:
    module = TagClipRetrievalPipeline.__module__.split(".")[-1]
    impl = {
        "impl": f"{module}.{TagClipRetrievalPipeline.__name__}",
        "pt": ["AutoModel"],
        "type": "multimodal",
    }
    previous = getattr(model.config, "custom_pipelines", None)
    model.config.custom_pipelines = {**(previous or {}), TASK: impl}
    try:
        model.save_pretrained(folder, **kwargs)
    finally:  # the in-memory model keeps resolving the task through the registry, not remote code
        if previous is None:  # never leave `custom_pipelines: null` for a later save (pipeline() fails on it)
            del model.config.custom_pipelines
        else:
            model.config.custom_pipelines = previous
    processor.save_pretrained(folder)
    save_code(folder)


def save_code(folder: Path) -> list[Path]:
    """Write this module and every module it imports relatively (at any depth) into ``folder``, side by side:
    transformers loads a saved folder's code as one flat package, so ``from ..gallery_types import`` and
    ``from .embedded.gallery_index import`` are written as ``from .gallery_types import`` and
    ``from .gallery_index import``. Returns the files written."""
    todo, written = [Path(__file__).resolve()], {}
    while todo:
        path = todo.pop()
        if path.name not in written:
            text, needed = _flat_imports(path)
            written[path.name] = folder / path.name
            written[path.name].write_text(text)
            todo += needed
    return list(written.values())


def _flat_imports(path: Path) -> tuple[str, list[Path]]:
    """``path``'s text with each relative import naming its module alone, and the module files it imports."""
    lines = path.read_text().splitlines(keepends=True)
    needed = []
    for node in ast.walk(ast.parse("".join(lines))):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        base = path.parents[node.level - 1].joinpath(*(node.module or "").split("."))
        package = base.is_dir()  # `from .embedded import index_store`: the names are modules
        needed += [base / f"{a.name}.py" for a in node.names] if package else [base.with_suffix(".py")]
        flat = "from . import" if package else f"from .{base.name} import"
        lines[node.lineno - 1] = re.sub(r"from\s+\.[\w.]*\s+import", flat, lines[node.lineno - 1], count=1)
    return "".join(lines), [module for module in needed if module.is_file()]


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _move_into(staging: Path, target: Path) -> None:
    """Rename every staged file into ``target`` (other files there stay; stale weight shards are removed)."""
    target.mkdir(exist_ok=True)
    staged = {path.relative_to(staging) for path in staging.rglob("*") if path.is_file()}
    for old in target.glob("model*.safetensors*"):
        if old.relative_to(target) not in staged:
            old.unlink()
    for relative in sorted(staged):
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / relative, target / relative)


def save_vision_tower(model, processor, save_directory: str | os.PathLike) -> Path:
    """Save the image tower alone with the image processor, for ``pipeline("image-feature-extraction")``."""
    save_directory = Path(save_directory)
    model.vision_model.save_pretrained(save_directory)
    processor.image_processor.save_pretrained(save_directory)
    return save_directory


register_pipeline()  # importing this module makes the task known, so any TAG-CLIP folder loads in-process
