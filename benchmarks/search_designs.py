"""Compare faiss ANN designs for the stored 1536-d TAG-PR Eq. 14 vector directly (no index files): build, then for
each nprobe / efSearch and k_factor, recall@10 vs exact on held-out and on test queries after an exact
re-rank of the k_factor x 10 candidates from the fp16 vectors, and CPU ms per single query (search + re-rank,
mean of 100, one thread). Same generator and queries as ``bench_search.py``; a cheap way to choose the
preset before running ``bench_search.py`` on it.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/search_designs.py 100000 \\
        "ivf:PCA128,IVF1024,PQ128x4fsr" "ivf:IVF1024,PQ384x4fsr"
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# bench_search sets OPENBLAS_CORETYPE before it imports faiss
from benchmarks.bench_search import GAP, TEXT_NOISE, Generator, faiss, queries  # noqa: E402

GRIDS = {"ivf": ("nprobe", (32, 64, 128, 256, 512, 1024, 2048)), "hnsw": ("efSearch", (128, 256, 512, 1024))}
K_FACTORS, STOP_AT, K = (20, 40, 100), 0.96, 10


def combined(embeds: dict[str, torch.Tensor]) -> np.ndarray:
    return (torch.cat([embeds["global"], embeds["local"]], 1) * math.sqrt(0.5)).numpy()


def rerank(store: np.ndarray, query: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Exact top-K of each query among its candidates, scored from the fp16 store."""
    out = np.empty((len(query), K), dtype=np.int64)
    for i in range(len(query)):
        rows = candidates[i][candidates[i] >= 0]
        out[i] = rows[np.argsort(-(store[rows].astype(np.float32) @ query[i]))[:K]]
    return out


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float((found[:, :, None] == exact[:, None, :]).any(-1).mean())


def main(size: int, designs: list[str]) -> None:
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    gen = Generator(0, TEXT_NOISE, GAP)
    ids = gen.identities(size // 2, 1)
    parts = [gen.images(ids[s : s + 25000], 2 + s) for s in range(0, ids.shape[0], 25000)]
    store = np.concatenate([combined(p) for p in parts]).astype(np.float16)
    vectors = store.astype(np.float32)
    held, test = combined(queries(gen, ids, 300, 11)), combined(queries(gen, ids, 300, 23))
    knn = lambda q: faiss.knn(q, vectors, K, metric=faiss.METRIC_INNER_PRODUCT)[1]  # noqa: E731
    exact_held, exact_test = knn(held), knn(test)
    for design in designs:
        kind, factory = design.split(":", 1)
        start = time.perf_counter()
        index = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors[np.sort(np.random.default_rng(0).permutation(size)[:100_000])])
        index.add(vectors)
        print(f"== {factory} build {time.perf_counter() - start:.0f}s (wall)", flush=True)
        name, values = GRIDS[kind]
        ivf = faiss.try_extract_index_ivf(index)
        for value in values:
            if ivf is not None and value > ivf.nlist:
                continue
            faiss.ParameterSpace().set_index_parameter(index, name, value)
            for k_factor in K_FACTORS:
                held_recall = recall(rerank(store, held, index.search(held, K * k_factor)[1]), exact_held)
                clock = time.process_time()
                for i in range(100):
                    rerank(store, test[i : i + 1], index.search(test[i : i + 1], K * k_factor)[1])
                ms = 10 * (time.process_time() - clock)
                test_recall = recall(rerank(store, test, index.search(test, K * k_factor)[1]), exact_test)
                print(
                    f"{name}={value} kf={k_factor} held={held_recall:.3f} test={test_recall:.3f} ms={ms:.2f}"
                )
                if held_recall >= STOP_AT:
                    break


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
