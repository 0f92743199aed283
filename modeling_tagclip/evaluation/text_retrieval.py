"""Text-to-image retrieval evaluation of a TAG-CLIP model (docs/tagclip-reference.md §6): library and CLI.

Queries are all captions of a split, the gallery all its images; ranking uses the Eq. 14 similarity
``(cos(t, v) + cos(t_tse, v_tse)) / 2``. Reports R@1/5/10, mAP, mINP (percent), the breakdown by the views of
the relevant gallery images (paper Table 5) and a linear probe of the view from the global image embedding.

Usage::

    python -m modeling_tagclip.evaluation.text_retrieval --model outputs/tagclip-synthetic/best --data data/synthetic \
        [--split test] [--batch_size 64] [--output eval.json] [--grid grid.png]

Evaluation is deterministic: the model runs in eval mode under a fixed RNG seed (so even ``routing="gumbel"``
gives the same numbers twice), in fp32 unless ``--amp`` asks for bf16/fp16 autocast on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from modeling_tagclip.metrics.retrieval import retrieval_metrics, view_breakdown, view_probe_accuracy

__all__ = [
    "RetrievalRun",
    "evaluate_model",
    "load_eval_dataset",
    "load_image",
    "load_model",
    "retrieval_metrics",
    "run_retrieval",
    "summarize",
]

logger = logging.getLogger(__name__)
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EVAL_SEED = 0


@dataclass
class RetrievalRun:
    """Everything one evaluation computed: similarity [n_queries, n_gallery] and the query/gallery metadata."""

    similarity: torch.Tensor
    query_ids: np.ndarray
    gallery_ids: np.ndarray
    gallery_views: np.ndarray
    image_embeds: torch.Tensor
    captions: list[str]
    image_paths: list[str]
    query_image_index: np.ndarray


def load_image(path: str | os.PathLike) -> Image.Image:
    """Open an image as RGB; a missing or unreadable file raises ``ValueError`` naming it."""
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


def _batches(n: int, size: int) -> list[range]:
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def _autocast(device: torch.device, amp: str | None):
    if amp in (None, "none", "no") or device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


def _normalize(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else torch.nn.functional.normalize(x.float(), dim=-1)


def encode_images(
    model, processor, paths: Sequence[str], views: Sequence[int], batch_size: int = 64, **opts: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalised global and TSE image embeddings (on CPU), batched."""
    device, amp, progress = opts.get("device"), opts.get("amp"), opts.get("progress", True)
    globals_, locals_ = [], []
    for idx in _progress(
        _batches(len(paths), batch_size), math.ceil(len(paths) / batch_size), "images", progress
    ):
        inputs = processor(images=[load_image(paths[i]) for i in idx], views=[int(views[i]) for i in idx])
        with _autocast(device, amp):
            out = model.get_image_features(
                pixel_values=inputs["pixel_values"].to(device), view_labels=inputs["view_labels"].to(device)
            )
        globals_.append(_normalize(out.pooler_output).cpu())
        if out.local_embeds is not None:
            locals_.append(_normalize(out.local_embeds).cpu())
    return torch.cat(globals_), torch.cat(locals_) if locals_ else None


def encode_texts(
    model, processor, captions: Sequence[str], batch_size: int = 256, **opts: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalised global and TSE text embeddings (on CPU), batched."""
    device, amp, progress = opts.get("device"), opts.get("amp"), opts.get("progress", True)
    text_kwargs = {"max_length": opts["max_length"]} if opts.get("max_length") else {}
    globals_, locals_ = [], []
    total = math.ceil(len(captions) / batch_size)
    for idx in _progress(_batches(len(captions), batch_size), total, "captions", progress):
        inputs = processor(text=[captions[i] for i in idx], **text_kwargs)
        with _autocast(device, amp):
            out = model.get_text_features(input_ids=inputs["input_ids"].to(device))
        globals_.append(_normalize(out.pooler_output).cpu())
        if out.local_embeds is not None:
            locals_.append(_normalize(out.local_embeds).cpu())
    return torch.cat(globals_), torch.cat(locals_) if locals_ else None


def eq14(text: tuple[torch.Tensor, torch.Tensor | None], image: tuple[torch.Tensor, torch.Tensor | None]):
    """Eq. 14 similarity [n_text, n_image] from (global, local) normalised embeddings."""
    similarity = text[0] @ image[0].t()
    if text[1] is not None and image[1] is not None:
        similarity = 0.5 * (similarity + text[1] @ image[1].t())
    return similarity


def _flatten_queries(dataset) -> tuple[list[str], np.ndarray, np.ndarray]:
    captions, ids, source = [], [], []
    for index, (pid, caps) in enumerate(zip(dataset["person_id"], dataset["captions"], strict=True)):
        for caption in caps:
            captions.append(caption)
            ids.append(pid)
            source.append(index)
    return captions, np.asarray(ids, dtype=np.int64), np.asarray(source, dtype=np.int64)


def _check_eval_dataset(dataset) -> None:
    required = {"image_path", "person_id", "captions", "view"}
    missing = required - set(dataset.column_names)
    if missing:
        raise ValueError(f"evaluation dataset lacks columns {sorted(missing)} (have {dataset.column_names})")
    if len(dataset) == 0:
        raise ValueError("evaluation dataset is empty")
    empty = [i for i, caps in enumerate(dataset["captions"]) if not caps or not all(c.strip() for c in caps)]
    if empty:
        raise ValueError(f"{len(empty)} images have empty captions, e.g. {dataset[empty[0]]['image_path']}")


def run_retrieval(
    model,
    processor,
    dataset,
    batch_size: int = 64,
    text_batch_size: int | None = None,
    device: str | torch.device | None = None,
    amp: str | None = None,
    progress: bool = True,
    max_length: int | None = None,
) -> RetrievalRun:
    """Encode gallery images and query captions of ``dataset`` (one row per image) and rank with Eq. 14."""
    _check_eval_dataset(dataset)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    opts = {"device": device, "amp": amp, "progress": progress, "max_length": max_length}
    captions, query_ids, source = _flatten_queries(dataset)
    paths, views = list(dataset["image_path"]), np.asarray(dataset["view"], dtype=np.int64)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(EVAL_SEED)
            image = encode_images(model, processor, paths, views, batch_size, **opts)
            text = encode_texts(model, processor, captions, text_batch_size or 4 * batch_size, **opts)
    finally:
        model.train(was_training)
    return RetrievalRun(
        similarity=eq14(text, image),
        query_ids=query_ids,
        gallery_ids=np.asarray(dataset["person_id"], dtype=np.int64),
        gallery_views=views,
        image_embeds=image[0],
        captions=captions,
        image_paths=paths,
        query_image_index=source,
    )


def chance_r1(query_ids: np.ndarray, gallery_ids: np.ndarray) -> float:
    """Expected R@1 (percent) of a random ranking: mean share of relevant gallery items per query."""
    ids, counts = np.unique(gallery_ids, return_counts=True)
    per_id = dict(zip(ids.tolist(), counts.tolist(), strict=True))
    return 100.0 * float(np.mean([per_id.get(q, 0) for q in query_ids.tolist()])) / len(gallery_ids)


def summarize(run: RetrievalRun, probe: bool = True) -> dict[str, Any]:
    """Metrics of a run: ``retrieval_metrics`` keys, view breakdown, view probe, sizes and chance R@1."""
    result: dict[str, Any] = retrieval_metrics(run.similarity, run.query_ids, run.gallery_ids)
    result["view_breakdown"] = view_breakdown(
        run.similarity, run.query_ids, run.gallery_ids, run.gallery_views
    )
    if probe:
        folds = min(5, int(np.bincount(run.gallery_views, minlength=2).min()))
        if folds >= 2:
            result["view_probe"] = view_probe_accuracy(run.image_embeds, run.gallery_views, folds=folds)
    result["num_queries"] = len(run.query_ids)
    result["num_gallery"] = len(run.gallery_ids)
    result["num_identities"] = len(np.unique(run.gallery_ids))
    result["chance_R@1"] = chance_r1(run.query_ids, run.gallery_ids)
    return result


def evaluate_model(
    model, processor, dataset, batch_size: int = 64, probe: bool = True, **kwargs: Any
) -> dict:
    """Evaluate ``model`` on ``dataset`` (one row per image, as ``modeling_tagclip.data.text_retrieval`` loaders return) → metrics."""
    return summarize(run_retrieval(model, processor, dataset, batch_size=batch_size, **kwargs), probe=probe)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(model, processor) from a saved folder; a peft adapter folder is loaded onto its base and merged."""
    from transformers import AutoModel, AutoProcessor

    import modeling_tagclip  # noqa: F401  (registers the Auto classes)

    path = Path(path)
    if (path / "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel

        base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
        model = PeftModel.from_pretrained(AutoModel.from_pretrained(base_path), path).merge_and_unload()
        processor_path = path if (path / "processor_config.json").is_file() else base_path
    else:
        model, processor_path = AutoModel.from_pretrained(path), path
    processor = AutoProcessor.from_pretrained(processor_path)
    return model.to(device).eval(), processor


def load_eval_dataset(
    data: str | os.PathLike, split: str = "test", image_dir: str | os.PathLike | None = None
):
    """One split of a dataset directory/name; TAG-PEDES-style folders use ``DIR/images`` when it exists."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    root = Path(data)
    if image_dir is None and (root / "images").is_dir() and any(root.glob("*_reid.json")):
        image_dir = root / "images"
    return load_dataset_split(data, split, image_dir=image_dir)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Text-to-image retrieval evaluation of a TAG-CLIP model.")
    p.add_argument(
        "--model", required=True, help="saved model folder (save_pretrained) or peft adapter folder"
    )
    p.add_argument("--data", required=True, help="dataset directory or name (see modeling_tagclip.data.text_retrieval)")
    p.add_argument("--split", default="test")
    p.add_argument("--image_dir", default=None, help="image root (default: DIR/images for TAG-PEDES folders)")
    p.add_argument("--batch_size", type=int, default=64, help="image batch size (captions: 4x)")
    p.add_argument("--output", default=None, help="JSON file for the results (default: print only)")
    p.add_argument("--grid", default=None, help="PNG file for a grid of example queries and their top-5")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none", help="autocast on GPU")
    p.add_argument("--no_probe", action="store_true", help="skip the linear view probe")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry point; returns the results dict."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dataset = load_eval_dataset(args.data, args.split, args.image_dir)
    model, processor = load_model(args.model, device)
    run = run_retrieval(model, processor, dataset, batch_size=args.batch_size, device=device, amp=args.amp)
    result = summarize(run, probe=not args.no_probe)
    result.update({"model": str(args.model), "data": str(args.data), "split": args.split})
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")
    if args.grid:
        from modeling_tagclip.plots import retrieval_grid

        retrieval_grid(run, args.grid)
    print(text)
    print(f"R@1 {result['R@1']:.2f}  mAP {result['mAP']:.2f}  (chance R@1 {result['chance_R@1']:.2f})")
    return result


if __name__ == "__main__":
    main()
