"""Text-retrieval evaluation cost: the previous evaluator (full query x gallery matrix + a stable argsort of
every row, twice: metrics and view breakdown) vs the streamed exact one (``summarize`` in
``modeling_tagclip.evaluation.text_retrieval``), at the real embedding width (global 512 + TSE 1024).

Embeddings are synthetic (3 images per identity, 2 captions per image, identity centre + noise: R@1 near
70% at 10k, so rankings are neither trivial nor random); both evaluators get the same tensors and must give the same numbers (the
largest difference is reported). Peak memory *beyond the embeddings* of the new evaluator is measured in a
fresh process per size (RSS high-water mark after a ``clear_refs`` reset, after the embeddings exist).

    python benchmarks/bench_eval.py --quick                               # 2k gallery, seconds
    python benchmarks/bench_eval.py                         # 10k x 20k old vs new; 100k x {2k, 8k} peak memory
    python benchmarks/bench_eval.py --memory-sizes 100000x200000          # the full target size (long on CPU)
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    add_allow_dirty,
    machine_info,
    peak_memory_mib,
    print_table,
    write_json,
)
from modeling_tagclip.evaluation.text_retrieval import RetrievalRun, summarize  # noqa: E402
from modeling_tagclip.flags import positive_int  # noqa: E402
from modeling_tagclip.metrics.retrieval import chunk_rows  # noqa: E402

GLOBAL_DIM, LOCAL_DIM = 512, 1024
IMAGES_PER_ID, CAPTIONS_PER_IMAGE = 3, 2
IMAGE_NOISE, TEXT_NOISE = 3.0, 3.2  # per-dimension noise / centre: matched text-image cosine ~0.09


def make_run(n_gallery: int, n_captions: int, seed: int = 0, chunk: int = 20_000) -> RetrievalRun:
    """Normalised embeddings and metadata of a synthetic split (built in chunks to bound memory)."""
    g = torch.Generator().manual_seed(seed)
    n_ids = -(-n_gallery // IMAGES_PER_ID)
    centres = torch.randn(n_ids, GLOBAL_DIM + LOCAL_DIM, generator=g)
    gallery_ids = torch.arange(n_gallery) // IMAGES_PER_ID
    source = torch.randint(0, n_gallery, (n_captions,), generator=g)
    if n_captions == CAPTIONS_PER_IMAGE * n_gallery:
        source = torch.arange(n_gallery).repeat_interleave(CAPTIONS_PER_IMAGE)

    def embed(ids: torch.Tensor, noise: float) -> dict[str, torch.Tensor]:
        parts = []
        for start in range(0, len(ids), chunk):
            x = centres[ids[start : start + chunk]]
            parts.append(x + noise * torch.randn(x.shape, generator=g))
        x = torch.cat(parts)
        return {
            "global": torch.nn.functional.normalize(x[:, :GLOBAL_DIM], dim=1),
            "local": torch.nn.functional.normalize(x[:, GLOBAL_DIM:], dim=1),
        }

    image, text = embed(gallery_ids, IMAGE_NOISE), embed(gallery_ids[source], TEXT_NOISE)
    views = torch.randint(0, 2, (n_gallery,), generator=g).numpy()
    return RetrievalRun(
        text=text,
        image=image,
        query_ids=gallery_ids[source].numpy(),
        gallery_ids=gallery_ids.numpy(),
        gallery_views=views,
        captions=[],
        image_paths=[],
        query_image_index=source.numpy(),
    )


# ------------------------------------------------------------------------- the evaluator before the change
# (commit 8c00ff9: modeling_tagclip/metrics/retrieval.py, kept here as the baseline and the reference)


def _old_chunk(sim: np.ndarray, q_ids: np.ndarray, g_ids: np.ndarray, ks) -> dict:
    order = np.argsort(-sim, axis=1, kind="stable")
    matches = g_ids[order] == q_ids[:, None]
    n_gallery = matches.shape[1]
    num_rel = matches.sum(axis=1)
    first_hit = matches.argmax(axis=1)
    last_hit = n_gallery - 1 - matches[:, ::-1].argmax(axis=1)
    precision = matches.cumsum(axis=1) / np.arange(1, n_gallery + 1, dtype=np.float64)
    scores = {f"R@{k}": first_hit < k for k in ks}
    scores["mAP"] = (precision * matches).sum(axis=1) / num_rel
    scores["mINP"] = num_rel / (last_hit + 1.0)
    return scores


def _old_metrics(sim: np.ndarray, q_ids: np.ndarray, g_ids: np.ndarray, ks=(1, 5, 10), chunk=512) -> dict:
    sums: dict[str, float] = {}
    for start in range(0, len(q_ids), chunk):
        part = _old_chunk(sim[start : start + chunk], q_ids[start : start + chunk], g_ids, ks)
        for key, values in part.items():
            sums[key] = sums.get(key, 0.0) + float(values.sum())
    return {key: 100.0 * total / len(q_ids) for key, total in sums.items()}


def old_evaluate(run: RetrievalRun) -> dict[str, Any]:
    """Full TAG-PR Eq. 14 matrix, metrics, then the view breakdown re-sorting every group's rows."""
    sim = run.similarity.numpy()
    result = _old_metrics(sim, run.query_ids, run.gallery_ids)
    aerial = set(np.unique(run.gallery_ids[run.gallery_views == 0]).tolist())
    ground = set(np.unique(run.gallery_ids[run.gallery_views == 1]).tolist())
    groups = np.asarray(
        [2 if (q in aerial and q in ground) else 0 if q in aerial else 1 for q in run.query_ids]
    )
    result["match_view_breakdown"] = {}
    for index, name in enumerate(("aerial-only", "ground-only", "aerial-and-ground")):
        mask = groups == index
        if mask.any():
            metrics = _old_metrics(sim[mask], run.query_ids[mask], run.gallery_ids)
            result["match_view_breakdown"][name] = {**metrics, "num_queries": int(mask.sum())}
    return result


def new_evaluate(run: RetrievalRun, progress: bool = False) -> dict[str, Any]:
    return summarize(run, probe=False, progress=progress)


def max_difference(old: dict, new: dict) -> float:
    """Largest |old - new| over the metrics and the breakdown (percentage points)."""
    diffs = [abs(old[k] - new[k]) for k in ("R@1", "R@5", "R@10", "mAP", "mINP")]
    for name, row in old["match_view_breakdown"].items():
        diffs += [abs(v - new["match_view_breakdown"][name][k]) for k, v in row.items()]
    return max(diffs)


# ------------------------------------------------------------------------- measurements


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, wall seconds, process CPU seconds) of one call; with --threads 1 the CPU time is the compute
    the call got, whatever else ran on the machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def compare(n_gallery: int, n_captions: int) -> dict[str, Any]:
    """Wall and CPU time of old and new on the same run, and their largest disagreement."""
    run = make_run(n_gallery, n_captions)
    new, new_s, new_cpu_s = timed(lambda: new_evaluate(run))
    old, old_s, old_cpu_s = timed(lambda: old_evaluate(run))
    return {
        "measure": "time",
        "gallery": n_gallery,
        "captions": n_captions,
        "old_s": old_s,
        "new_s": new_s,
        "old_cpu_s": old_cpu_s,
        "new_cpu_s": new_cpu_s,
        "speedup": old_s / new_s,
        "speedup_cpu": old_cpu_s / new_cpu_s,
        "max_abs_diff": max_difference(old, new),
        "R@1": new["R@1"],
    }


def memory_child(n_gallery: int, n_captions: int) -> dict[str, Any]:
    """(In a fresh process) the new evaluator's peak RSS beyond the embeddings, and its wall and CPU time."""
    run = make_run(n_gallery, n_captions)
    embeddings_mib = (
        sum(t.numel() * t.element_size() for d in (run.text, run.image) for t in d.values()) / 2**20
    )
    results = []
    (peak, method), new_s, new_cpu_s = timed(
        lambda: peak_memory_mib(lambda: results.append(new_evaluate(run, progress=True)), torch.device("cpu"))
    )
    return {
        "measure": "peak memory",
        "gallery": n_gallery,
        "captions": n_captions,
        "embeddings_mib": embeddings_mib,
        "peak_beyond_embeddings_mib": peak,
        "method": method,
        "new_s": new_s,
        "new_cpu_s": new_cpu_s,
        "chunk_rows": chunk_rows(n_gallery),
        "R@1": results[0]["R@1"],
    }


def memory(n_gallery: int, n_captions: int, threads: int) -> dict[str, Any]:
    script = Path(__file__).resolve()
    args = [sys.executable, str(script), "--child", f"{n_gallery}x{n_captions}", "--threads", str(threads)]
    out = subprocess.run(args, stdout=subprocess.PIPE, text=True, check=True)  # progress goes to stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(text: str) -> tuple[int, int]:
    gallery, captions = text.lower().split("x")
    return int(gallery), int(captions)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2k gallery x 4k captions only")
    parser.add_argument("--compare-sizes", nargs="*", type=_size, default=None, help="GxC, e.g. 10000x20000")
    parser.add_argument("--memory-sizes", nargs="*", type=_size, default=None, help="GxC, e.g. 100000x20000")
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--child", type=_size, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=None)
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
        print(json.dumps(memory_child(*args.child)))
        return {}
    compare_sizes = (
        args.compare_sizes
        if args.compare_sizes is not None
        else ([(2000, 4000)] if args.quick else [(10_000, 20_000)])
    )
    memory_sizes = (
        args.memory_sizes
        if args.memory_sizes is not None
        else ([(2000, 4000)] if args.quick else [(100_000, 2_000), (100_000, 8_000)])
    )
    rows = [compare(*size) for size in compare_sizes] + [memory(*size, args.threads) for size in memory_sizes]
    print_table(
        rows,
        [
            "measure",
            "gallery",
            "captions",
            "old_s",
            "new_s",
            "old_cpu_s",
            "new_cpu_s",
            "speedup_cpu",
            "max_abs_diff",
            "embeddings_mib",
            "peak_beyond_embeddings_mib",
        ],
    )
    payload = {"machine": machine_info(torch.device("cpu")), "command": " ".join(sys.argv), "rows": rows}
    output = args.output or RESULTS_DIR / ("eval_cpu_quick.json" if args.quick else "eval_cpu.json")
    write_json(output, payload)
    return payload


if __name__ == "__main__":
    main()
