"""Plain faiss baselines at the project's width: IVF-Flat and HNSW32 over the same 1536-d vectors and queries as
``bench_search.py`` (its generator, seed and held-out / test queries), with no re-rank.

For each size and design: build (IVF-Flat with the ``ivf`` preset's list count, ``ann.ivf_lists``; HNSW with
32 links), choose the smallest nprobe / efSearch whose recall@10 on the *held-out* queries reaches the target
(0.95), then report recall@10 on the *test* queries against the exact top-10 (inner product of
``sqrt(1/2) [global, local]`` over the fp16-rounded vectors: the TAG-PR Eq. 14 score), and the median CPU ms of
batch-1 queries on one thread. Memory: the bytes of the written faiss index, and in a fresh process the
resident memory that reading the index and answering the timed queries adds (RSS, and its anonymous and
file-backed parts from /proc/self/status), as ``bench_serving.py`` measures the project's index.

    python benchmarks/bench_baselines.py --quick                       # 4k crops, seconds
    python benchmarks/bench_baselines.py --sizes 10000 30000 100000    # benchmarks/results/baselines_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# bench_search sets OPENBLAS_CORETYPE before it imports faiss
from benchmarks.bench_search import GAP, TEXT_NOISE, batch1_ms, faiss, make_gallery, queries  # noqa: E402
from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    add_allow_dirty,
    check_publishable,
    machine_info,
    print_table,
    reset_peak_rss,
    write_json,
)
from modeling_tagclip.flags import fraction, integer, positive_int  # noqa: E402
from modeling_tagclip.retrieval.embedded.ann import ivf_lists  # noqa: E402

K = 10
NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
EF_SEARCH = (16, 32, 64, 128, 256, 512, 1024, 2048)
MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def designs(size: int) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (faiss factory, search parameter, its grid) at ``size`` rows."""
    nlist = ivf_lists(size)
    return {
        "faiss IVF-Flat": (f"IVF{nlist},Flat", "nprobe", tuple(p for p in NPROBES if p <= nlist)),
        "faiss HNSW32": ("HNSW32", "efSearch", EF_SEARCH),
    }


def combined(embeds: dict[str, torch.Tensor]) -> np.ndarray:
    """float32 ``sqrt(1/2) [global, local]``: its inner product is the TAG-PR Eq. 14 score."""
    return (torch.cat([embeds["global"].float(), embeds["local"].float()], 1) * 0.5**0.5).numpy()


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float((found[:, :, None] == exact[:, None, :]).any(-1).mean())


def memory_mib() -> dict[str, float]:
    """``MEMORY_FIELDS`` of /proc/self/status, MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in MEMORY_FIELDS:
            fields[name] = int(value.split()[0]) / 1024
    return fields


def child(index_file: str, queries_file: str, param: str, value: int) -> dict[str, float]:
    """A fresh process: read the index, answer the queries at batch 1; the memory that added, MiB."""
    faiss.omp_set_num_threads(1)
    query = np.load(queries_file)
    if not reset_peak_rss():
        raise SystemExit("error: cannot reset the peak RSS (/proc/self/clear_refs); needs Linux")
    start = memory_mib()
    index = faiss.read_index(index_file)
    faiss.ParameterSpace().set_index_parameter(index, param, value)
    for i in range(len(query)):
        index.search(query[i : i + 1], K)
    end = memory_mib()
    return {
        "added_rss_mib": round(end["VmRSS"] - start["VmRSS"], 1),
        "added_anon_mib": round(end["RssAnon"] - start["RssAnon"], 1),
        "added_file_mib": round(end["RssFile"] - start["RssFile"], 1),
        "added_peak_mib": round(end["VmHWM"] - start["VmRSS"], 1),
    }


def served_memory(index_file: Path, query: np.ndarray, param: str, value: int) -> dict[str, float]:
    """``child`` in a fresh interpreter (a clear error when it fails)."""
    queries_file = index_file.with_suffix(".queries.npy")
    np.save(queries_file, query)
    command = [sys.executable, __file__, "--child", str(index_file), str(queries_file), param, str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: the serving process for {index_file.name} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build(factory: str, vectors: np.ndarray, threads: int) -> tuple[Any, float]:
    """The trained and filled index (on ``threads`` threads), and its wall seconds."""
    faiss.omp_set_num_threads(threads)
    start = time.perf_counter()
    index = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    faiss.omp_set_num_threads(1)
    return index, round(time.perf_counter() - start, 1)


def choose(index: Any, param: str, grid: tuple[int, ...], held: np.ndarray, exact: np.ndarray, target: float):
    """(value, held-out recall): the smallest ``param`` in ``grid`` reaching ``target``, else the last."""
    for value in grid:
        faiss.ParameterSpace().set_index_parameter(index, param, value)
        reached = recall(index.search(held, K)[1], exact)
        if reached >= target:
            break
    return value, reached


def bench_design(name: str, size: int, data: dict[str, np.ndarray], args, folder: Path) -> dict[str, Any]:
    """One design at one size: build, choose its parameter on held-out queries, time and measure it."""
    factory, param, grid = designs(size)[name]
    index, build_s = build(factory, data["vectors"], args.build_threads)
    value, held_recall = choose(index, param, grid, data["held"], data["exact_held"], args.target)
    test_recall = recall(index.search(data["test"], K)[1], data["exact_test"])
    timed = data["test"][: args.timed]
    ms = batch1_ms(lambda q: index.search(q["global"], K), {"global": timed}, "cpu")
    index_file = folder / f"{size}_{factory.replace(',', '_')}.faiss"
    faiss.write_index(index, str(index_file))
    return {
        "size": size,
        "index": name,
        "factory": factory,
        "param": param,
        "value": value,
        "recall_held_out": round(held_recall, 4),
        "recall": round(test_recall, 4),
        "reached_target": held_recall >= args.target,
        "ms_per_query_b1": ms,
        "build_s_wall": build_s,
        "index_mib": round(index_file.stat().st_size / 2**20, 1),
        **served_memory(index_file, timed, param, value),
    }


def size_data(size: int, args: argparse.Namespace) -> dict[str, np.ndarray]:
    """The gallery vectors (fp16-rounded, as the project stores them), the queries and their exact top-k."""
    gen, ids, gallery = make_gallery(size, args)
    vectors = combined(gallery)
    held = combined(queries(gen, ids, args.queries, 11))
    test = combined(queries(gen, ids, args.queries, 23))
    knn = lambda q: faiss.knn(q, vectors, K, metric=faiss.METRIC_INNER_PRODUCT)[1]  # noqa: E731
    return {"vectors": vectors, "held": held, "test": test, "exact_held": knn(held), "exact_test": knn(test)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[10_000, 30_000, 100_000])
    parser.add_argument("--designs", nargs="+", default=list(designs(1)), choices=list(designs(1)))
    parser.add_argument("--queries", type=positive_int, default=300, help="held-out and test queries (each)")
    parser.add_argument("--timed", type=positive_int, default=100, help="test queries timed one by one")
    parser.add_argument("--target", type=fraction, default=0.95, help="held-out recall@10 to reach")
    parser.add_argument("--build-threads", type=positive_int, default=1, help="faiss threads while building")
    parser.add_argument("--seed", type=integer, default=0)
    parser.add_argument("--quick", action="store_true", help="4096 crops, 100 queries, 20 timed")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(RESULTS_DIR / "baselines_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    args.text_noise, args.gap = TEXT_NOISE, GAP  # bench_search.py's default generator
    if args.quick:
        args.sizes, args.queries, args.timed = [4096], 100, 20
    if faiss is None and not args.child:
        parser.error("needs faiss: pip install faiss-cpu")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        index_file, queries_file, param, value = args.child
        print(json.dumps(child(index_file, queries_file, param, int(value))))
        return {}
    check_publishable(args.output)  # before the measurement, not after it
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            data = size_data(size, args)
            for name in args.designs:
                rows.append(bench_design(name, size, data, args, Path(tmp)))
                print_table(
                    rows,
                    ["size", "index", "param", "value", "recall_held_out", "recall", "ms_per_query_b1"]
                    + ["build_s_wall", "index_mib", "added_rss_mib", "added_anon_mib"],
                )
    payload = {
        "command": "python benchmarks/bench_baselines.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(torch.device("cpu")),
        "threads": 1,
        "clock": "cpu",
        "k": K,
        "target": args.target,
        "generator": {"script": "bench_search.py", "seed": args.seed, "text_noise": TEXT_NOISE, "gap": GAP},
        "rows": rows,
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
