"""Text -> gallery search over synthetic 512-d embeddings: exact chunked torch top-k vs faiss flat and ANN.

For each gallery size: per-query latency at batch 1 and queries/s at batch 64 (methods timed in interleaved
rounds), and recall@k of each ANN setting against the exact top-k. The synthetic gallery is clustered
("identities" around centres in a low-rank subspace plus isotropic noise) and each query is a noisy copy of
one identity's centre, so ANN recall means something; it still depends on this generator (see README).

    python benchmarks/bench_search.py                     # 10k, 100k, 1M
    python benchmarks/bench_search.py --quick             # 2k gallery, seconds
    python benchmarks/bench_search.py --sizes 1000000 --ann ivffs   # the ANN that meets the issue target

`ivffs` = IVF with ~4 sqrt(N) lists, 4-bit PQ FastScan codes (residual), exact re-ranking of k_factor x k
candidates (the `modeling_tagclip.retrieval.gallery_index` "ivf" preset). faiss-cpu's bundled OpenBLAS may detect a
virtualised AVX-512 CPU as "Prescott" (5x slower sgemm for k-means and adds); OPENBLAS_CORETYPE is set from
the CPU flags before faiss is imported unless already set. Batch-1 searches do not use BLAS.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    chunked_topk,
    machine_info,
    median,
    print_table,
    time_call,
    time_interleaved,
    write_json,
)


def openblas_coretype() -> str | None:
    """OPENBLAS_CORETYPE matching this CPU's flags (SkylakeX for AVX-512, Haswell for AVX2), if any."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return "SkylakeX" if "avx512f" in flags else "Haswell" if {"avx2", "fma"} <= flags else None


if openblas_coretype():
    os.environ.setdefault("OPENBLAS_CORETYPE", openblas_coretype())

try:
    import faiss
except ImportError:  # faiss-cpu is optional: `pip install faiss-cpu`
    faiss = None

CPU = torch.device("cpu")
FS_K_FACTOR = 30  # ivffs: re-rank 30 k candidates (300 for k = 10) exactly

# ---------------------------------------------------------------------------------------------------------
# Synthetic embeddings
# ---------------------------------------------------------------------------------------------------------


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def identity_centres(count: int, dim: int, rank: int, generator: torch.Generator) -> torch.Tensor:
    """Unit centres: a random `rank`-d subspace component plus a weaker isotropic one."""
    basis = torch.linalg.qr(torch.randn(dim, rank, generator=generator)).Q
    low_rank = torch.randn(count, rank, generator=generator) @ basis.T
    return normalize(normalize(low_rank) + 0.5 * normalize(torch.randn(count, dim, generator=generator)))


def make_gallery(
    size: int, dim: int, per_identity: int, seed: int, chunk: int = 131072
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit gallery [size, dim], identity centres): `per_identity` noisy views around each centre."""
    generator = torch.Generator().manual_seed(seed)
    centres = identity_centres(max(1, size // per_identity), dim, rank=64, generator=generator)
    gallery = torch.empty(size, dim)
    for start in range(0, size, chunk):
        rows = torch.arange(start, min(size, start + chunk)) % centres.shape[0]
        noise = torch.randn(rows.numel(), dim, generator=generator) / dim**0.5
        gallery[start : start + rows.numel()] = normalize(centres[rows] + 0.8 * noise)
    return gallery, centres


def make_queries(centres: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """Unit text-side queries: an identity centre plus a larger (cross-modal) noise."""
    generator = torch.Generator().manual_seed(seed + 1)
    rows = torch.randint(0, centres.shape[0], (count,), generator=generator)
    noise = torch.randn(count, centres.shape[1], generator=generator) / centres.shape[1] ** 0.5
    return normalize(centres[rows] + 1.2 * noise)


# ---------------------------------------------------------------------------------------------------------
# Indexes
# ---------------------------------------------------------------------------------------------------------


def ivf_lists(size: int) -> int:
    """IVF lists: about 4 sqrt(N), at most N/40 (k-means points) and 1024 (short training on a small CPU)."""
    return int(max(1, min(1024, 4 * size**0.5, size / 40)))


def fastscan_lists(size: int) -> int:
    """IVF lists of `ivffs`: the power of two nearest 4 sqrt(N), with >= 64 vectors per list (4096 at 1M)."""
    target = max(1.0, min(4 * size**0.5, size / 64))
    return 2 ** max(0, round(torch.tensor(target).log2().item()))


def training_rows(data: Any, count: int) -> Any:
    """A fixed random subset of `count` rows (k-means training set)."""
    return data[torch.randperm(data.shape[0], generator=torch.Generator().manual_seed(0))[:count]]


def build_fastscan(gallery: torch.Tensor, flat: Any, subquantizers: int, k_factor: int) -> Any:
    """IVF + 4-bit PQ FastScan (residual) re-ranked exactly by `flat` (IndexRefine over the same rows)."""
    data, lists = gallery.numpy(), fastscan_lists(gallery.shape[0])
    factory = f"IVF{lists},PQ{subquantizers}x4fsr"
    index = faiss.index_factory(gallery.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    index.train(training_rows(data, 40 * lists))
    index.add(data)
    refined = faiss.IndexRefine(index, flat)
    refined.k_factor = k_factor
    return refined


def build_ann(kind: str, gallery: torch.Tensor, flat: Any, args: argparse.Namespace) -> Any:
    """A faiss ANN index over `gallery`: `ivfflat`, `ivfpq`/`ivffs` (re-ranked exactly by `flat`), `hnsw`."""
    data, dim = gallery.numpy(), gallery.shape[1]
    if kind == "ivffs":
        return build_fastscan(gallery, flat, args.fs_subquantizers, args.k_factor)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
        index.add(data)
        return index
    lists = ivf_lists(gallery.shape[0])
    quantizer = faiss.IndexFlatIP(dim)
    if kind == "ivfflat":
        index = faiss.IndexIVFFlat(quantizer, dim, lists, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexIVFPQ(quantizer, dim, lists, 64, 8, faiss.METRIC_INNER_PRODUCT)
    index.train(training_rows(data, 40 * lists))
    index.add(data)
    if kind == "ivfpq":
        refined = faiss.IndexRefine(index, flat)
        refined.k_factor = 8
        return refined
    return index


def set_search_param(index: Any, kind: str, value: int) -> None:
    """nprobe for IVF indexes, efSearch for HNSW."""
    if kind == "hnsw":
        index.hnsw.efSearch = value
    else:
        faiss.extract_index_ivf(index).nprobe = value


def sweep_values(kind: str, size: int) -> list[int]:
    if kind == "hnsw":
        return [16, 32, 64, 128, 256]
    if kind == "ivffs":
        lists = fastscan_lists(size)
        return [
            v for v in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if lists // 64 <= v <= lists // 2
        ]
    lists = ivf_lists(size)
    return [v for v in (1, 2, 4, 8, 16, 32, 64, 128) if v <= lists]


def recall_at_k(found: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean |found ∩ exact| / k over the queries."""
    hits = (found[:, :, None] == exact[:, None, :]).any(-1).sum(-1)
    return float(hits.float().mean() / exact.shape[1])


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


def cycling(search: Callable[[torch.Tensor], Any], queries: torch.Tensor, batch: int) -> Callable[[], Any]:
    """A no-argument call that searches the next `batch` queries each time (wrapping around)."""
    state = {"start": 0}

    def run():
        start = state["start"]
        state["start"] = (start + batch) % max(1, queries.shape[0] - batch + 1)
        return search(queries[start : start + batch])

    return run


def searchers(gallery: torch.Tensor, k: int, chunk: int, indexes: dict[str, Any]) -> dict[str, Callable]:
    """Name -> search(queries) for the exact torch search and every faiss index."""
    found = {"torch_exact_chunked": lambda q: chunked_topk(q, gallery, k, chunk)}
    for name, index in indexes.items():
        found[name] = lambda q, index=index: index.search(q.numpy(), k)
    return found


def time_methods(
    methods: dict[str, Callable], queries: torch.Tensor, batch: int, repeats: int, clock: str
) -> dict[str, float]:
    """Median seconds per call of each method at `batch` queries, interleaved."""
    fns = {name: cycling(search, queries, batch) for name, search in methods.items()}
    return {name: median(ts) for name, ts in time_interleaved(fns, repeats, 1, CPU, clock).items()}


def single_query_ms(index: Any, queries: torch.Tensor, k: int, clock: str) -> float:
    """Median ms of one batch-1 search per query row (a quick per-setting figure, not interleaved)."""
    fn = cycling(lambda q: index.search(q.numpy(), k), queries, 1)
    return 1000 * median([time_call(fn, CPU, clock) for _ in range(queries.shape[0])])


def tune_ann(kind: str, index: Any, queries: torch.Tensor, exact: torch.Tensor, args: argparse.Namespace):
    """Recall@k (and quick batch-1 ms) per search setting: (sweep rows, the cheapest setting reaching the
    target recall, else the best)."""
    rows = []
    for value in sweep_values(kind, index.ntotal):
        set_search_param(index, kind, value)
        found = torch.from_numpy(index.search(queries.numpy(), args.k)[1])
        ms = single_query_ms(index, queries[: args.sweep_queries], args.k, args.clock)
        rows.append({"param": value, "recall": recall_at_k(found, exact), "ms_per_query_b1": ms})
    target = args.target_recall
    chosen = next((r for r in rows if r["recall"] >= target), max(rows, key=lambda r: r["recall"]))
    set_search_param(index, kind, chosen["param"])
    return rows, chosen


def bench_size(size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """All methods at one gallery size: build, recall, latency (batch 1), throughput (batch 64)."""
    gallery, centres = make_gallery(size, args.dim, args.per_identity, args.seed)
    queries = make_queries(centres, args.num_queries, args.seed)
    exact = chunked_topk(queries, gallery, args.k, args.chunk_size)[1]
    indexes, info = {}, {"torch_exact_chunked": {"build_s": 0.0, "recall": 1.0}}
    if faiss is not None:
        start = time.perf_counter()
        flat = faiss.IndexFlatIP(args.dim)
        flat.add(gallery.numpy())
        indexes["faiss_flat"] = flat
        info["faiss_flat"] = {"build_s": time.perf_counter() - start}
        for kind in args.ann:
            if kind == "hnsw" and size > args.hnsw_max:
                continue
            print(f"[search] gallery {size}: building {kind}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            index = build_ann(kind, gallery, flat, args)
            build = time.perf_counter() - start
            sweep, chosen = tune_ann(kind, index, queries, exact, args)
            indexes[f"faiss_{kind}"] = index
            info[f"faiss_{kind}"] = {"build_s": build, "recall": chosen["recall"], "param": chosen["param"],
                                     "sweep": sweep}  # fmt: skip
        info["faiss_flat"]["recall"] = recall_at_k(
            torch.from_numpy(flat.search(queries.numpy(), args.k)[1]), exact
        )
    print(f"[search] gallery {size}: timing {len(indexes) + 1} methods", file=sys.stderr, flush=True)
    methods = searchers(gallery, args.k, args.chunk_size, indexes)
    latency = time_methods(methods, queries, 1, args.repeats_single, args.clock)
    batched = time_methods(methods, queries, args.batch, args.repeats_batch, args.clock)
    return [
        dict(
            gallery=size,
            method=name,
            ms_per_query_b1=1000 * latency[name],
            queries_per_s_b64=args.batch / batched[name],
            **info[name],
        )  # fmt: skip
        for name in methods
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2k gallery, few queries")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="default 10000 100000 1000000")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--ann", nargs="+", choices=["ivfflat", "ivfpq", "ivffs", "hnsw"], default=None)
    parser.add_argument("--fs-subquantizers", type=int, default=None, help="ivffs PQ sub-vectors (dim / 2)")
    parser.add_argument("--k-factor", type=int, default=FS_K_FACTOR, help="ivffs: re-rank k_factor x k")
    parser.add_argument(
        "--hnsw-max", type=int, default=100_000, help="skip HNSW above this size (build time)"
    )
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--num-queries", type=int, default=None, help="recall queries (default 500)")
    parser.add_argument("--per-identity", type=int, default=8, help="gallery images per synthetic identity")
    parser.add_argument("--sweep-queries", type=int, default=50, help="batch-1 queries timed per ANN setting")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=65536)
    parser.add_argument("--repeats-single", type=int, default=None, help="batch-1 rounds (default 20)")
    parser.add_argument("--repeats-batch", type=int, default=None, help="batch-64 rounds (default 5)")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="cpu = process CPU time (use with --threads 1 on a shared CPU machine)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch and faiss CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ([2000] if args.quick else [10_000, 100_000, 1_000_000])
    args.ann = args.ann or (
        ["ivfflat", "ivffs", "hnsw"] if args.quick else ["ivfflat", "ivfpq", "ivffs", "hnsw"]
    )
    args.fs_subquantizers = args.fs_subquantizers or args.dim // 2
    args.num_queries = args.num_queries or (128 if args.quick else 500)
    args.repeats_single = args.repeats_single or (3 if args.quick else 20)
    args.repeats_batch = args.repeats_batch or (2 if args.quick else 5)
    args.output = args.output or RESULTS_DIR / ("search_quick.json" if args.quick else "search.json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        if faiss is not None:
            faiss.omp_set_num_threads(args.threads)
    rows = [row for size in args.sizes for row in bench_size(size, args)]
    print_table(
        rows, ["gallery", "method", "ms_per_query_b1", "queries_per_s_b64", "recall", "param", "build_s"]
    )
    payload = dict(
        benchmark="search", machine=machine_info(CPU), faiss=getattr(faiss, "__version__", None),
        clock=args.clock, k=args.k, dim=args.dim, num_queries=args.num_queries,
        per_identity=args.per_identity, openblas_coretype=os.environ.get("OPENBLAS_CORETYPE"),
        command=shlex.join(["python", "benchmarks/bench_search.py", *(sys.argv[1:] if argv is None else argv)]),
        batch=args.batch, chunk_size=args.chunk_size, target_recall=args.target_recall, rows=rows,
    )  # fmt: skip
    if faiss is None:
        payload["note"] = "faiss not installed (pip install faiss-cpu): exact torch search only"
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
