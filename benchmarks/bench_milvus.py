"""The gallery on Milvus Lite beside the embedded index: insert throughput, query latency, recall@10 vs exact.

One gallery from ``bench_search.py``'s generator (1536-d: global 512 + TSE 1024, 2 images per identity, the
harder text-image gap) goes through the real code of both backends: ``MilvusGallery.add`` / ``search`` into a
Milvus Lite file per index type (FLAT, HNSW, IVF_SQ8 by default, their default parameters from
``milvus_store``), and ``index_embeddings`` with the embedded ``ivf`` preset in the same run. Recall@k is
measured against the exact TAG-PR Eq. 14 top-k on the test queries; latency is the median of batch-1 queries on the
chosen clock (``cpu``: process CPU time, which includes Milvus Lite's in-process server threads).

    python benchmarks/bench_milvus.py --quick                 # 4k crops, a minute
    python benchmarks/bench_milvus.py --size 100000 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_search import GAP, TEXT_NOISE, batch1_ms, make_gallery, queries, recall  # noqa: E402
from benchmarks.common import RESULTS_DIR, add_allow_dirty, machine_info, print_table, write_json  # noqa: E402
from modeling_tagclip.retrieval.embedded import gallery_index as gi  # noqa: E402
from modeling_tagclip.retrieval.embedded.index_build import index_embeddings  # noqa: E402
from modeling_tagclip.retrieval.milvus import INDEX_TYPES, SEARCH_PARAMS, MilvusGallery  # noqa: E402


def _clock(clock: str) -> float:
    return time.process_time() if clock == "cpu" else time.perf_counter()


def _rows(hits: list[list[dict]], k: int) -> torch.Tensor:
    """Gallery rows of ranked hits (paths are ``{row:08d}.jpg``), -1 where fewer than k."""
    out = torch.full((len(hits), k), -1, dtype=torch.long)
    for q, ranked in enumerate(hits):
        for r, hit in enumerate(ranked[:k]):
            out[q, r] = int(Path(hit["path"]).stem)
    return out


def bench_milvus(
    kind: str, gallery: dict, paths: list[str], test: dict, exact: torch.Tensor, args, folder: Path
):
    """Insert the gallery into a new Lite collection of ``kind``; insert rate, first-query (index build) time,
    recall@k and batch-1 latency (after ``flush``: sealed segments with their vector index)."""
    store = MilvusGallery.create(
        str(folder / f"{kind}.db"), "bench", dim=1536, fingerprint=None, image_root="", index_type=kind
    )
    try:
        start = _clock(args.clock)
        step = args.insert_chunk
        for s in range(0, len(paths), step):
            store.add({key: value[s : s + step] for key, value in gallery.items()}, paths[s : s + step])
        insert_s = _clock(args.clock) - start
        start = _clock(args.clock)
        store.flush()
        flush_s = _clock(args.clock) - start
        start = _clock(args.clock)
        store.search({key: value[:1] for key, value in test.items()}, args.k)
        first_s = _clock(args.clock) - start
        found = _rows(store.search(test, args.k), args.k)
        ms = batch1_ms(
            lambda q: store.search(q, args.k), {k: v[: args.timed] for k, v in test.items()}, args.clock
        )
    finally:
        store.close()
    return {
        "backend": "milvus-lite",
        "index": kind,
        "params": {**INDEX_TYPES[kind][1], **SEARCH_PARAMS[kind]},
        "insert_rows_per_s": round(len(paths) / insert_s, 1),
        "flush_s": round(flush_s, 2),
        "first_query_s": round(first_s, 2),
        "recall": round(recall(found, exact), 4),
        "ms_per_query_b1": ms,
    }


def bench_embedded(
    gallery: dict, paths: list[str], test: dict, exact: torch.Tensor, args, folder: Path
) -> dict:
    """The embedded index with the ``ivf`` preset (its defaults): build rate, recall@k, batch-1 latency."""
    start = _clock(args.clock)
    index = index_embeddings(folder / "ivf", gallery, paths, folder, ann="ivf")
    build_s = _clock(args.clock) - start
    found = index.topk(test, args.k)[1]
    ms = batch1_ms(lambda q: index.topk(q, args.k), {k: v[: args.timed] for k, v in test.items()}, args.clock)
    return {
        "backend": "embedded",
        "index": "ivf",
        "params": {"factory": index.meta["ann"]["factory"], **index.ann_params},
        "insert_rows_per_s": round(len(paths) / build_s, 1),
        "flush_s": None,
        "first_query_s": None,
        "recall": round(recall(found, exact), 4),
        "ms_per_query_b1": ms,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=100_000, help="gallery crops")
    parser.add_argument(
        "--index-types",
        nargs="+",
        default=["flat", "hnsw", "ivf_sq8"],
        choices=["flat", "hnsw", "ivf_flat", "ivf_sq8"],
    )
    parser.add_argument("--queries", type=int, default=200, help="test queries (recall)")
    parser.add_argument("--timed", type=int, default=100, help="test queries timed one by one")
    parser.add_argument("--insert-chunk", type=int, default=8192, help="rows per MilvusGallery.add call")
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4096 crops, 50 queries")
    parser.add_argument("--output", default=str(RESULTS_DIR / "milvus_lite_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    args.text_noise, args.gap = TEXT_NOISE, GAP  # bench_search.py's default (harder) generator
    if args.quick:
        args.size, args.queries, args.timed = 4096, 50, 20
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if gi.faiss is not None:
        gi.faiss.omp_set_num_threads(args.threads)
    gen, ids, gallery = make_gallery(args.size, args)
    test = queries(gen, ids, args.queries, 23)
    paths = [f"{i:08d}.jpg" for i in range(args.size)]
    exact = gi.chunked_topk(test, gallery, args.k)[1]  # exact TAG-PR Eq. 14 over the stored (fp16) vectors
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append({"size": args.size, **bench_embedded(gallery, paths, test, exact, args, Path(tmp))})
        print_table(rows, ["size", "backend", "index", "insert_rows_per_s", "recall", "ms_per_query_b1"])
        for kind in args.index_types:
            rows.append(
                {"size": args.size, **bench_milvus(kind, gallery, paths, test, exact, args, Path(tmp))}
            )
            print_table(
                rows,
                [
                    "size",
                    "backend",
                    "index",
                    "insert_rows_per_s",
                    "flush_s",
                    "first_query_s",
                    "recall",
                    "ms_per_query_b1",
                ],
            )
    payload = {
        "command": "python benchmarks/bench_milvus.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(torch.device("cpu")),
        "threads": args.threads,
        "clock": args.clock,
        "dims": {"global": 512, "local": 1024, "stored": 1536},
        "generator": {"script": "bench_search.py", "text_noise": args.text_noise, "gap": args.gap},
        "rows": rows,
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
