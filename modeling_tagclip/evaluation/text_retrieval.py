"""Text-to-image retrieval evaluation of a TAG-CLIP model (docs/tagclip-reference.md §6), as a library and a CLI.

Queries are all captions of a split, the gallery all its images; ranking uses the TAG-PR Eq. 14 similarity
``(cos(t, v) + cos(t_tse, v_tse)) / 2``. Reports R@1/5/10, mAP, mINP (percent), the same metrics per query
group by the views of the query's true matches (``match_view_breakdown``: all aerial, all ground, or both)
and a linear probe of the view from the global image embedding.

Usage::

    tagclip eval --model outputs/tagclip-synthetic/best --data data/synthetic \
        [--split test] [--batch-size 64] [--workers 2] [--dtype bf16] [--output eval.json] [--grid grid.png]

Metrics are exact and need memory for the embeddings plus one [query chunk, gallery] block of scores: the
query×gallery matrix is never materialised and no row is sorted (``modeling_tagclip.metrics.retrieval``).
Evaluation is deterministic: the model runs in eval mode under a fixed RNG seed (so even ``routing="gumbel"``
gives the same numbers twice), in fp32 unless ``amp`` asks for bf16/fp16 autocast. With
``distributed=True`` inside an initialised process group (e.g. ``accelerate launch``), every rank encodes its
slice of the images and captions, the embeddings are gathered, each rank scores its share of the queries and
the metric sums are all-reduced; every rank must call it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modeling_tagclip.atomic_io import write_results
from modeling_tagclip.evaluation.arguments import parse_retrieval_args
from modeling_tagclip.metrics.retrieval import (
    check_finite,
    chunk_rows,
    retrieval_metrics,
    stream_retrieval_metrics,
    view_probe_accuracy,
)
from modeling_tagclip.retrieval.encode import (
    embedding_scores,
    encode_images,
    encode_texts,
    load_rgb,
    shard_range,
)
from modeling_tagclip.retrieval.loading import load_model as _load_model

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
EVAL_SEED = 0
load_image = load_rgb


@dataclass
class RetrievalRun:
    """Everything one evaluation computed: normalised caption (``text``) and image (``image``) embeddings
    (dicts of ``global`` / ``local`` / ``view_probs``) and the query/gallery metadata."""

    text: dict[str, torch.Tensor]
    image: dict[str, torch.Tensor]
    query_ids: np.ndarray
    gallery_ids: np.ndarray
    gallery_views: np.ndarray
    captions: list[str]
    image_paths: list[str]
    query_image_index: np.ndarray

    def scores(
        self, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """TAG-PR Eq. 14 scores [stop - start, n_gallery] of queries ``start:stop`` (into ``out`` when given)."""
        query = {key: value[start:stop] for key, value in self.text.items()}
        return embedding_scores(query, self.image, out=out)

    def chunk_scorer(self, chunk_size: int) -> Callable[[int, int], torch.Tensor]:
        """``scores(start, stop)`` for at most ``chunk_size`` queries, reusing one result block across calls."""
        text = self.text["global"]
        block = torch.empty(chunk_size, len(self.gallery_ids), dtype=text.dtype, device=text.device)
        return lambda start, stop: self.scores(start, stop, out=block[: stop - start])

    @property
    def similarity(self) -> torch.Tensor:
        """The full [n_queries, n_gallery] TAG-PR Eq. 14 matrix (small runs only; metrics never build it)."""
        return self.scores()

    @property
    def image_embeds(self) -> torch.Tensor:
        """Normalised global image embeddings [n_gallery, D]."""
        return self.image["global"]


def _distributed() -> tuple[int, int] | None:
    """(rank, world_size) of an initialised process group with more than one rank, else None."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        return (torch.distributed.get_rank(), world) if world > 1 else None
    return None


def _gather_rows(part: dict[str, torch.Tensor], n: int, shard: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Concatenate every rank's ``shard_range`` rows of ``n`` (all ranks call it)."""
    world = shard[1]
    sizes = [len(shard_range(n, (rank, world))) for rank in range(world)]
    device = torch.device("cuda") if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for key in sorted(part):
        padded = part[key].new_zeros((max(sizes), *part[key].shape[1:]))
        padded[: len(part[key])] = part[key]
        pieces = [torch.empty_like(padded, device=device) for _ in range(world)]
        torch.distributed.all_gather(pieces, padded.to(device))
        out[key] = torch.cat([piece[:size].cpu() for piece, size in zip(pieces, sizes, strict=True)])
    return out


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


def _check_loader_options(batch_size: Any, text_batch_size: Any, num_workers: Any) -> None:
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("text_batch_size", text_batch_size, 1),
        ("num_workers", num_workers, 0),
    ):
        if name == "text_batch_size" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


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
    num_workers: int = 0,
    distributed: bool = False,
) -> RetrievalRun:
    """Encode gallery images (``num_workers`` decoding processes) and query captions of ``dataset`` (one row
    per image); ``amp`` = "bf16" / "fp16" autocast. ``distributed``: see the module docstring."""
    _check_eval_dataset(dataset)
    _check_loader_options(batch_size, text_batch_size, num_workers)
    shard = _distributed() if distributed else None
    dtype = None if amp in (None, "none", "no", "fp32") else amp
    opts = {"device": device, "dtype": dtype, "progress": progress, "shard": shard}
    captions, query_ids, source = _flatten_queries(dataset)
    paths, views = list(dataset["image_path"]), np.asarray(dataset["view"], dtype=np.int64)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(EVAL_SEED)
            image = encode_images(
                model, processor, paths, batch_size, views=views.tolist(), num_workers=num_workers, **opts
            )
            text = encode_texts(
                model,
                processor,
                captions,
                text_batch_size or 4 * batch_size,
                max_length=max_length,
                num_workers=num_workers,
                **opts,
            )
    finally:
        model.train(was_training)
    if shard is not None:
        image, text = _gather_rows(image, len(paths), shard), _gather_rows(text, len(captions), shard)
    return RetrievalRun(
        text=text,
        image=image,
        query_ids=query_ids,
        gallery_ids=np.asarray(dataset["person_id"], dtype=np.int64),
        gallery_views=views,
        captions=captions,
        image_paths=paths,
        query_image_index=source,
    )


def chance_r1(query_ids: np.ndarray, gallery_ids: np.ndarray) -> float:
    """Expected R@1 (percent) of a random ranking: mean share of relevant gallery items per query."""
    ids, counts = np.unique(gallery_ids, return_counts=True)
    per_id = dict(zip(ids.tolist(), counts.tolist(), strict=True))
    return 100.0 * float(np.mean([per_id.get(q, 0) for q in query_ids.tolist()])) / len(gallery_ids)


def summarize(
    run: RetrievalRun,
    probe: bool = True,
    chunk_size: int | None = None,
    distributed: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics of a run in one streamed pass: ``retrieval_metrics`` keys, ``match_view_breakdown``, the view
    probe, sizes and chance R@1. ``chunk_size`` queries are scored at a time (default: as many as fit the
    ``chunk_rows`` memory budget); ``progress`` logs the scoring progress. ``distributed``: each rank scores its
    share of the queries (all ranks call)."""
    shard = _distributed() if distributed else None
    queries = shard_range(len(run.query_ids), shard)
    for name, embeds in (("caption", run.text), ("image", run.image)):
        for key, value in embeds.items():
            check_finite(value, f"{name} {key} embeddings")
    chunk_size = chunk_rows(len(run.gallery_ids)) if chunk_size is None else chunk_size
    accumulator = stream_retrieval_metrics(
        run.chunk_scorer(max(1, min(chunk_size, len(queries)))),
        run.query_ids,
        run.gallery_ids,
        run.gallery_views,
        chunk_size=chunk_size,
        queries=queries,
        progress=progress,
    )
    if shard is not None:
        accumulator.all_reduce()
    result: dict[str, Any] = accumulator.compute()
    result["match_view_breakdown"] = accumulator.breakdown()
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
    """Evaluate ``model`` on ``dataset`` (one row per image, as ``modeling_tagclip.data.text_retrieval`` loaders
    return) → metrics; ``kwargs`` go to ``run_retrieval``."""
    run = run_retrieval(model, processor, dataset, batch_size=batch_size, **kwargs)
    return summarize(
        run, probe=probe, distributed=kwargs.get("distributed", False), progress=kwargs.get("progress", True)
    )


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", **kwargs: Any):
    """(model, processor) of a TAG-CLIP folder, Hub id or peft adapter folder (``retrieval.loading.load_model``)."""
    return _load_model(path, device, family="tagclip", **kwargs)


def load_eval_dataset(
    data: str | os.PathLike, split: str = "test", image_dir: str | os.PathLike | None = None
):
    """One split of a dataset directory/name; TAG-PEDES-style folders use ``DIR/images`` when it exists."""
    from modeling_tagclip.data.text_retrieval import load_dataset_split

    root = Path(data)
    if image_dir is None and (root / "images").is_dir() and any(root.glob("*_reid.json")):
        image_dir = root / "images"
    return load_dataset_split(data, split, image_dir=image_dir)


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry point; returns the results dict."""
    return run(parse_retrieval_args(argv))


def run(args: argparse.Namespace) -> dict:
    """Evaluate with parsed ``tagclip eval`` arguments; returns the results dict."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dataset = load_eval_dataset(args.data, args.split, args.image_dir)
    if args.distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device == "cuda":
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    model, processor = load_model(args.model, device, trust_remote_code=args.trust_remote_code)
    run = run_retrieval(
        model,
        processor,
        dataset,
        batch_size=args.batch_size,
        device=device,
        amp=args.dtype,
        num_workers=args.workers,
        distributed=args.distributed,
    )
    result = summarize(run, probe=not args.no_probe, distributed=args.distributed, progress=True)
    if _distributed() is not None and torch.distributed.get_rank() != 0:
        return result
    result.update({"model": str(args.model), "data": str(args.data), "split": args.split})
    text = json.dumps(result, indent=2)
    print(text)  # first: an unwritable --output or --grid loses no metric
    print(f"R@1 {result['R@1']:.2f}  mAP {result['mAP']:.2f}  (chance R@1 {result['chance_R@1']:.2f})")
    if args.output:
        write_results(args.output, result)
        print(f"wrote the results to {args.output}")
    if args.grid:
        from modeling_tagclip.plots import retrieval_grid

        retrieval_grid(run, args.grid)
        print(f"wrote the retrieval grid to {args.grid}")
    return result
