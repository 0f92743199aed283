"""Cost of growing a gallery index: adding k crops to an N-crop index reads and hashes only what changed.

For each N, an index of N synthetic rows (global 512 + TSE 1024, fp32, one segment) is written with
``index_build.index_embeddings``; then k new rows are added twice: through ``index_embeddings`` (what
``tagclip index --add`` commits: new segment, crop rows, manifest; the returned index reads nothing more) and
through a server's cached ``GalleryIndex`` (``GalleryIndex.add``: the commit, then only the new segment is
read). CPU time of this process with one torch thread; the bytes read by the checksummed reader are counted.

    python benchmarks/bench_add.py --sizes 10000 100000 --k 10 100
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
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
    machine_info,
    median,
    print_table,
    time_call,
    write_json,
)
from modeling_tagclip.retrieval import index_store  # noqa: E402
from modeling_tagclip.retrieval.gallery_index import GalleryIndex  # noqa: E402
from modeling_tagclip.retrieval.index_build import index_embeddings  # noqa: E402

DIMS = {"global": 512, "local": 1024}


def rows(count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.nn.functional.normalize(torch.randn(count, dim, generator=generator), dim=-1)
            for key, dim in DIMS.items()}  # fmt: skip


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
            results.append({"size": size, "k": k, "how": how, "cpu_ms": round(1000 * median(times), 1),
                            "mib_read": round(read / 2**20, 3), "index_mib": round(_bytes(out) / 2**20, 1)})  # fmt: skip
    return results


def _adder(how: str, out: Path, root: Path, served: GalleryIndex, new: dict, paths: list[str]):
    if how == "index_embeddings":
        return lambda: index_embeddings(out, new, paths, root)
    return lambda: served.add(new, paths)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_info() -> dict[str, Any]:
    """Commit, date, load average and the CPU's SIMD flags of this run."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return {"commit": commit.strip(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "cpu_flags": sorted(flags & {"avx2", "avx512f", "fma", "avx512_bf16", "amx_bf16"})}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--k", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(RESULTS_DIR / "add_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    info = run_info()
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
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
    }
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
