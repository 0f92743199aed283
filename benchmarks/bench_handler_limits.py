"""What one endpoint request may cost: peak memory and CPU time of the handler's image decoding
(``handler.decode_images``) for requests of large, highly compressible PNGs (a few KB each, inside every
per-image default limit).

- ``over_request_bound``: 64 images of 16 Mpx (1 Gpx in all): refused with a 413 from the headers, nothing
  decoded;
- ``at_request_bound``: 4 images of 16 Mpx (64 Mpx, the default ``max_request_pixels``): decoded;
- ``per_image_bound_only_first_8_of_64``: the request bound lifted to what per-image bounds alone allow (64 x 16
  Mpx); 8 of those images decoded (the whole 64-image request holds 8 times as much).

Peak memory is the rise of this process's resident set (VmHWM after a reset); CPU time is this process's.

    python benchmarks/bench_handler_limits.py
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    add_allow_dirty,
    machine_info,
    peak_memory_mib,
    print_table,
    write_json,
)
from modeling_tagclip.retrieval.handler import Limits, PayloadTooLargeError, decode_images  # noqa: E402

SIDE = 4000  # 16 Mpx: the default per-image limit


def payload() -> str:
    """A 16 Mpx RGB PNG (one colour: a few KB of base64)."""
    buffer = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), (120, 60, 200)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def measure(name: str, images: list[str], limits: Limits) -> dict[str, Any]:
    """Peak RSS rise and CPU time of decoding one request; the status it ends with."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.process_time()
        try:
            decoded = decode_images(images, limits)
            outcome["status"] = 200
            outcome["decoded_pixels"] = sum(i.width * i.height for i in decoded)
        except PayloadTooLargeError as error:
            outcome["status"], outcome["decoded_pixels"] = error.status, 0
        outcome["cpu_s"] = round(time.process_time() - start, 4)

    peak, method = peak_memory_mib(run, torch.device("cpu"))
    return {
        "case": name,
        "images": len(images),
        "request_pixels": len(images) * SIDE * SIDE,
        "payload_bytes": sum(len(i) for i in images),
        "peak_rss_rise_mib": round(peak, 1),
        "memory_method": method,
        **outcome,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "handler_limits.json")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    image = payload()
    limits = Limits()
    lifted = limits._replace(max_request_pixels=64 * SIDE * SIDE)
    rows = [
        measure("over_request_bound", [image] * 64, limits),
        measure("at_request_bound", [image] * 4, limits),
        measure("per_image_bound_only_first_8_of_64", [image] * 8, lifted),
    ]
    print_table(
        rows,
        [
            "case",
            "images",
            "request_pixels",
            "payload_bytes",
            "status",
            "decoded_pixels",
            "peak_rss_rise_mib",
            "cpu_s",
        ],
    )
    result = {
        "benchmark": "handler_limits",
        "limits": limits._asdict(),
        "rows": rows,
        "machine": machine_info(torch.device("cpu")),
    }
    write_json(args.output, result)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
