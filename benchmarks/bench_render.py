"""Cost of rendering the synthetic set with 1 and with several worker processes (``generate_dataset(workers=)``).

For each worker count the set is rendered into a fresh temporary folder; the CPU time of this process and of its
reaped workers (``RUSAGE_CHILDREN``), the wall time and the load average are recorded, and the rendered files of
every count are checked byte-identical to the 1-worker render. On a shared machine compare CPU times: wall time
only shows the speedup on an otherwise idle machine.

    python benchmarks/bench_render.py --identities 100 --workers 1 2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, print_table, write_json  # noqa: E402
from modeling_tagclip.data.synthetic import generate_dataset  # noqa: E402


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _digest(root: Path) -> str:
    """One hash of every file's relative path and bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def measure(identities: int, workers: int, size: tuple[int, int]) -> dict[str, Any]:
    """Render once with ``workers`` processes; CPU (this process + workers), wall, image count, files' digest."""
    with tempfile.TemporaryDirectory() as tmp:
        load = os.getloadavg()[0]
        cpu, children, wall = time.process_time(), _children_cpu(), time.perf_counter()
        summary = generate_dataset(tmp, identities, image_size=size, progress=False, workers=workers)
        wall = time.perf_counter() - wall
        parent, children = time.process_time() - cpu, _children_cpu() - children
        images = sum(split["images"] for split in summary.values())
        return {
            "workers": workers,
            "images": images,
            "cpu_s": round(parent + children, 3),
            "cpu_main_s": round(parent, 3),
            "cpu_workers_s": round(children, 3),
            "cpu_ms_per_image": round(1000 * (parent + children) / images, 2),
            "wall_s": round(wall, 3),
            "load_average_1m_before": load,
            "digest": _digest(Path(tmp)),
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--identities", type=int, default=100)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--size", type=int, nargs=2, default=[128, 64], metavar=("H", "W"))
    p.add_argument("--output", type=Path, default=RESULTS_DIR / "render_synthetic_cpu.json")
    add_allow_dirty(p)
    args = p.parse_args(argv)
    rows = [measure(args.identities, w, tuple(args.size)) for w in args.workers]
    if len({row["digest"] for row in rows}) != 1:
        raise SystemExit(
            "the renders differ between worker counts: " + ", ".join(r["digest"][:12] for r in rows)
        )
    print_table(
        rows, ["workers", "images", "cpu_s", "cpu_main_s", "cpu_workers_s", "cpu_ms_per_image", "wall_s"]
    )
    payload = {"identities": args.identities, "image_size": args.size, "rows": rows}
    print(f"wrote {write_json(args.output, payload)}")
    return payload


if __name__ == "__main__":
    main()
