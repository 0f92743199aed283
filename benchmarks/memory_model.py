"""Memory model of a served gallery index: bytes a row by component, plus fixed costs, as a function of N.

Components (bytes a row unless said):

- re-rank store: (512 global + 1024 TSE) dims x 2 (fp16) or 1 (int8, plus a float32 scale per embedding),
  plus the float32 view probabilities (2 x 4). Read into memory it is anonymous memory; memory-mapped
  (``GalleryIndex.load``'s default for fp16 and int8) it is file-backed pages, resident only where searches
  touched them (the kernel drops them under pressure), so it leaves the anonymous set.
- PQ codes: 128 sub-quantisers x 4 bits = 64, plus faiss's 8-byte id in its inverted list.
- the skipped-row mask: 1 (image paths stay in the crop database, read for the hits a search returns).
- fixed: the PCA projection (128 x 1536 float32, its bias and mean), the IVF centroids (nlist x 128 float32),
  and SQLite's page cache of the crop database (its default bound, 2000 KiB).

The model counts live memory. The C allocator also keeps some freed heap in the process (a query's re-ranking
workspace, 800 candidate rows in float32, is about 7 MiB): ``bench_serving.py`` records the added anonymous
memory before and after handing that back (``added_anon_mib``, ``added_live_anon_mib``); ``check`` compares the
live part where a row records it.

``check`` compares the model with measured serving rows (``bench_serving.py``'s added resident set: its
anonymous part where the row records it, which is what the model counts; a mapped store's pages are file-backed),
and
``python benchmarks/memory_model.py`` prints the model at 100k, 300k, 1M and 10M crops, extrapolating where
nothing can be measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, print_table  # noqa: E402
from modeling_tagclip.retrieval.embedded.ann import ivf_lists  # noqa: E402

GLOBAL_DIM, LOCAL_DIM, VIEWS, PCA_DIM, PQ_BYTES, FAISS_ID = 512, 1024, 2, 128, 64, 8
MASK = 1
SQLITE_CACHE = 2000 * 1024  # SQLite's default page cache bound (PRAGMA cache_size = -2000)
TOLERANCE = 0.10  # the model is within 10% of every measured point of 100k crops or more,
SLACK_MIB = (
    8.0  # or within 8 MiB (allocator arenas, freed memory reused): what bounds a mapped store's few MiB
)
MODES_FILE = "serving_cpu_store_modes.json"  # fp16 and int8 stores, mapped and read (bench_serving.py --load)
MILLION_FILE = "serving_cpu_1m.json"  # fp16 and int8 stores at 1M crops, mapped (bench_serving.py --generate)
SERVING_FILES = (MODES_FILE, MILLION_FILE)


def store_bytes(store_dtype: str) -> float:
    """Bytes a row of the re-rank store (embeddings, int8 scales, view probabilities)."""
    per_dim = {"fp32": 4, "fp16": 2, "int8": 1}[store_dtype]
    scales = 2 * 4 if store_dtype == "int8" else 0
    return (GLOBAL_DIM + LOCAL_DIM) * per_dim + scales + VIEWS * 4


def predict(
    size: int,
    store_dtype: str = "fp16",
    mapped: bool = False,
    nlist: int | None = None,
) -> dict[str, float]:
    """Anonymous bytes a served index of ``size`` rows holds, by component (``total``: their sum); with
    ``mapped`` the store is file-backed (``store_file``, not in ``total``)."""
    store = size * store_bytes(store_dtype)
    nlist = nlist or ivf_lists(size)
    parts = {
        "store": 0.0 if mapped else store,
        "pq_codes": size * (PQ_BYTES + FAISS_ID),
        "mask": size * MASK,
        "fixed": (GLOBAL_DIM + LOCAL_DIM) * (PCA_DIM + 1) * 4 + nlist * PCA_DIM * 4 + SQLITE_CACHE,
    }
    return {**parts, "total": sum(parts.values()), "store_file": store if mapped else 0.0}


def measured_rows(results: Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """The serving rows measured so far: size, factory, store dtype, mapped, added resident MiB (rows of files
    from before ``bench_serving.py`` recorded the store: fp16, read into memory)."""
    rows = []
    for name in SERVING_FILES:
        path = results / name
        if path.is_file():
            for row in json.loads(path.read_text())["rows"]:
                rows.append({"store_dtype": "fp16", "mapped": False, **row})
    return rows


def measured_anon(row: dict[str, Any]) -> float | None:
    """The anonymous MiB a serving row added: ``added_live_anon_mib`` (after the freed heap is handed back),
    else ``added_anon_mib``, else (a row from before either was recorded) the whole added resident set of a
    store read into memory; None for a mapped row without them."""
    for key in ("added_live_anon_mib", "added_anon_mib"):
        if key in row:
            return row[key]
    return None if row["mapped"] else row["added_rss_mib"]


def within(model: float, measured: float) -> bool:
    """Whether the model is within ``TOLERANCE`` of a measurement, or within ``SLACK_MIB`` of it."""
    return abs(model - measured) <= max(TOLERANCE * measured, SLACK_MIB)


def check(rows: list[dict[str, Any]], min_size: int = 100_000) -> list[dict[str, Any]]:
    """Model against measurement for each row of ``min_size`` rows or more: predicted and measured anonymous
    MiB, their ratio and whether they agree (``within``); for a mapped store also the file-backed MiB the
    queries touched and the model's bound on them (the whole store file)."""
    out = []
    for row in rows:
        measured = measured_anon(row)
        if row["size"] < min_size or measured is None:
            continue
        nlist = int(row["ann"].split("IVF")[1].split(",")[0]) if row.get("ann") else None
        parts = predict(row["size"], row["store_dtype"], row["mapped"], nlist)
        model = parts["total"] / 2**20
        out.append({**{k: row[k] for k in ("size", "store_dtype", "mapped")}, "model_mib": round(model, 1)})
        out[-1] |= {"measured_mib": measured, "model_over_measured": round(model / max(measured, 1e-9), 3)}
        out[-1] |= {"within": within(model, measured)}
        if row["mapped"]:
            out[-1] |= {
                "store_file_mib": round(parts["store_file"] / 2**20, 1),
                "measured_file_mib": row.get("added_file_mib"),
            }
    return out


def table(sizes: tuple[int, ...] = (100_000, 300_000, 1_000_000, 10_000_000)) -> list[dict[str, Any]]:
    """The model at each size for the fp16 store read, fp16 mapped and int8 (read and mapped), in GiB."""
    rows = []
    for size in sizes:
        for store_dtype, mapped in (("fp16", False), ("fp16", True), ("int8", False), ("int8", True)):
            parts = predict(size, store_dtype, mapped)
            rows.append(
                {
                    "size": size,
                    "store": f"{store_dtype}{' mapped' if mapped else ''}",
                    "anon_gib": round(parts["total"] / 2**30, 2),
                    "store_file_gib": round(parts["store_file"] / 2**30, 2),
                    "all_resident_gib": round((parts["total"] + parts["store_file"]) / 2**30, 2),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", default=str(RESULTS_DIR), help="folder of the serving results files")
    args = parser.parse_args(argv)
    checked = check(measured_rows(Path(args.results)))
    columns = ["size", "store_dtype", "mapped", "model_mib", "measured_mib", "model_over_measured", "within"]
    print_table(checked, columns + ["store_file_mib", "measured_file_mib"])
    model = table()
    print_table(model, ["size", "store", "anon_gib", "store_file_gib", "all_resident_gib"])
    return {"checked": checked, "model": model}


if __name__ == "__main__":
    main()
