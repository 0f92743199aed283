"""Cost of growing a gallery index: adding k crops to an N-crop index reads and hashes only what changed.

For each N, an index of N synthetic rows (global 512 + TSE 1024, fp32, one segment) is written with
``index_build.index_embeddings``; then k new rows are added twice: through ``index_embeddings`` (what
``tagclip index --add`` commits: new segment, crop rows, manifest; the returned index reads nothing more) and
through a server's cached ``GalleryIndex`` (``GalleryIndex.add``: the commit, then only the new segment is
read). CPU time of this process with one torch thread; the bytes read by the checksummed reader are counted.

    python benchmarks/bench_add.py --sizes 10000 100000 --k 10 100

``--ann-size N --adds A --add-fraction F`` times what users do after growing an ANN gallery instead: an `ivf`
index of N crops of `bench_search.py`'s generator, grown by A commits of F x N new crops each (what A runs of
`tagclip index --add` commit), against an index of the same rows built at once; batch-1 text queries,
interleaved, with their recall@10 against exact search and the segments on disk. It records the grown index's
retrains and recalibrations (``index.json``) and what the adds cost: CPU time in all, per added crop, in the
adds that retrained or recalibrated, and the slowest add, beside the CPU time of the build at once.

    python benchmarks/bench_add.py --ann-size 10000 --adds 1000 --add-fraction 0.01 --output benchmarks/results/add_ann_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    add_allow_dirty,
    check_publishable,
    machine_info,
    median,
    print_table,
    run_info,
    time_call,
    write_json,
)
from modeling_tagclip.retrieval.embedded import index_store  # noqa: E402
from modeling_tagclip.retrieval.embedded.gallery_index import GalleryIndex, chunked_topk  # noqa: E402
from modeling_tagclip.retrieval.embedded.index_build import index_embeddings  # noqa: E402

DIMS = {"global": 512, "local": 1024}
EQUAL_RECALL = 0.01  # grown and fresh recall@10 closer than this count as equal
QUERY_COLUMNS = ("rows", "adds", "retrains", "recalibrations", "lists_grown", "lists_fresh", "recall_fresh")
QUERY_COLUMNS += ("recall_grown", "ms_fresh", "ms_grown", "grown_vs_fresh", "equal_recall")
COST_COLUMNS = ("add_cpu_s", "add_ms_per_row", "add_median_ms", "add_max_s", "growth_cpu_s", "build_cpu_s")
COST_COLUMNS += ("fresh_build_cpu_s", "segments_on_disk", "indexes_searched")


def rows(count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        key: torch.nn.functional.normalize(torch.randn(count, dim, generator=generator), dim=-1)
        for key, dim in DIMS.items()
    }


class ReadCounter:
    """Bytes the checksummed reader (``index_store._read_hashed``) reads while active."""

    def __init__(self):
        self.bytes, self.real = 0, index_store._read_hashed

    def __enter__(self):
        def counted(path, sha256):
            self.bytes += path.stat().st_size
            return self.real(path, sha256)

        index_store._read_hashed = counted
        return self

    def __exit__(self, *_):
        index_store._read_hashed = self.real


def bench_size(size: int, ks: list[int], repeats: int, folder: Path) -> list[dict[str, Any]]:
    out, root, results = folder / "idx", folder / "root", []
    index_embeddings(out, rows(size, 0), [f"base/{i:07d}.jpg" for i in range(size)], root)
    served = GalleryIndex.load(out)  # a server's cached index, its segments read once
    served.search({key: value[:1] for key, value in rows(1, 1).items()}, top_k=1)
    seed = 10
    for k in ks:
        for how in ("index_embeddings", "GalleryIndex.add"):
            times, read = [], 0
            for _ in range(repeats):
                seed += 1
                new, paths = rows(k, seed), [f"add{seed}/{i:05d}.jpg" for i in range(k)]
                add = _adder(how, out, root, served, new, paths)
                GalleryIndex.load(out)  # the server takes the previous adds first (not timed)
                with ReadCounter() as counter:
                    times.append(time_call(add, torch.device("cpu"), "cpu"))
                read = counter.bytes
            results.append(
                {
                    "size": size,
                    "k": k,
                    "how": how,
                    "cpu_ms": round(1000 * median(times), 1),
                    "mib_read": round(read / 2**20, 3),
                    "index_mib": round(_bytes(out) / 2**20, 1),
                }
            )
    return results


def bench_ann_adds(size: int, adds: int, fraction: float, queries: int, folder: Path) -> dict[str, Any]:
    """Query cost and recall of an `ivf` gallery grown by ``adds`` commits, against one built at once."""
    from benchmarks import bench_search

    gen = bench_search.Generator(0)
    step = max(1, round(fraction * size))
    ids = gen.identities((size + adds * step) // 2 + 1, 1)
    images = gen.images(ids, 2)
    total = size + adds * step
    images = {key: value[:total].half() for key, value in images.items()}
    paths, root = [f"crops/{i:08d}.jpg" for i in range(total)], folder / "root"
    part = lambda a, b: {key: value[a:b] for key, value in images.items()}  # noqa: E731
    grown_out = folder / "grown"
    start = time.process_time()
    index_embeddings(grown_out, part(0, size), paths[:size], root, ann="ivf")
    build_s, times, growth_s = time.process_time() - start, [], 0.0
    for a in range(adds):
        lo, before = size + a * step, _growth(grown_out)
        begin = time.process_time()
        index_embeddings(grown_out, part(lo, lo + step), paths[lo : lo + step], root)
        times.append(time.process_time() - begin)
        growth_s += times[-1] if _growth(grown_out) != before else 0.0
    start = time.process_time()
    index_embeddings(folder / "fresh", images, paths, root, ann="ivf")
    fresh_s = time.process_time() - start
    # both served as a user serves them: loaded from their folders (memory-mapped segments)
    fresh, grown = (GalleryIndex.load(folder / name, cache=False) for name in ("fresh", "grown"))
    picked = torch.randperm(ids.shape[0] - 1, generator=torch.Generator().manual_seed(5))[:queries]
    text = gen.texts(ids[picked], 7)
    exact = chunked_topk(text, grown.embeds, 10)[1]
    trainings, calibrations = _growth(grown_out)
    row = {
        "size": size,
        "adds": adds,
        "add_rows": step,
        "rows": total,
        "retrains": trainings - 1,  # after the first build's training
        "recalibrations": calibrations - 1,
        "build_cpu_s": round(build_s, 2),
        "add_cpu_s": round(sum(times), 1),
        "add_ms_per_row": round(1000 * sum(times) / (adds * step), 3),
        "add_median_ms": round(1000 * median(times), 1),
        "add_max_s": round(max(times), 2),
        "growth_cpu_s": round(growth_s, 1),  # the adds that retrained or recalibrated
        "fresh_build_cpu_s": round(fresh_s, 1),
        "segments_on_disk": len(grown._segments),
        "indexes_searched": len(grown.ann_indexes),
    }
    for name, index in (("fresh", fresh), ("grown", grown)):
        params = index.meta["ann"]["params"]
        row[f"lists_{name}"] = faiss_lists(index)
        row[f"nprobe_{name}"], row[f"k_factor_{name}"] = params["nprobe"], params["k_factor"]
        row[f"recall_{name}"] = round(bench_search.recall(index.topk(text, 10)[1], exact), 4)
    timed = {name: [] for name in ("fresh", "grown")}
    for _ in range(3):  # interleaved rounds: load drift hits both alike
        for name, index in (("fresh", fresh), ("grown", grown)):
            timed[name].append(bench_search.batch1_ms(lambda q, i=index: i.topk(q, 10), text, "cpu"))
    row.update({f"ms_{name}": median(values) for name, values in timed.items()})
    row["grown_vs_fresh"] = round(row["ms_grown"] / row["ms_fresh"], 3)
    row["recall_gap"] = round(row["recall_grown"] - row["recall_fresh"], 4)
    row["equal_recall"] = abs(row["recall_gap"]) <= EQUAL_RECALL  # so the time ratio compares like with like
    return row


def _growth(out: Path) -> tuple[int, int]:
    """(trainings, calibrations) of the index's ANN so far (``index.json``)."""
    ann = json.loads((out / index_store.HEADER).read_text()).get("ann") or {}
    return ann.get("trainings", 1), ann.get("calibrations", 1)


def faiss_lists(index: GalleryIndex) -> int:
    """IVF lists of the index's (merged) faiss index."""
    import faiss

    return faiss.extract_index_ivf(index.ann_indexes[0]).nlist


def _adder(how: str, out: Path, root: Path, served: GalleryIndex, new: dict, paths: list[str]):
    if how == "index_embeddings":
        return lambda: index_embeddings(out, new, paths, root)
    return lambda: served.add(new, paths)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--k", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ann-size", type=int, default=None, help="time queries after adds to an ANN gallery"
    )
    parser.add_argument("--adds", type=int, default=1000, help="with --ann-size: the commits that grow it")
    parser.add_argument("--add-fraction", type=float, default=0.01, help="with --ann-size: rows per add / N")
    parser.add_argument("--queries", type=int, default=200, help="with --ann-size: batch-1 text queries")
    parser.add_argument("--output", default=None, help="default: results/add_cpu.json (add_ann_cpu.json)")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    default = "add_ann_cpu.json" if args.ann_size else "add_cpu.json"
    args.output = args.output or str(RESULTS_DIR / default)
    check_publishable(args.output)
    torch.set_num_threads(1)
    info = run_info()
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.ann_size:
            rows_out.append(
                bench_ann_adds(args.ann_size, args.adds, args.add_fraction, args.queries, Path(tmp))
            )
            print_table(rows_out, [*QUERY_COLUMNS])
            print_table(rows_out, [*COST_COLUMNS])
        for size in [] if args.ann_size else args.sizes:
            rows_out.extend(bench_size(size, args.k, args.repeats, Path(tmp) / str(size)))
            print_table(rows_out, ["size", "k", "how", "cpu_ms", "mib_read", "index_mib"])
    payload = {
        "command": "python benchmarks/bench_add.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(torch.device("cpu")),
        **info,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "threads": 1,
        "clock": "cpu",
        "rows": rows_out,
        **({"equal_recall_within": EQUAL_RECALL} if args.ann_size else {}),
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
