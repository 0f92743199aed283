"""Text -> gallery search at the width the index stores (global 512 + TSE 1024), through the real index code.

Each gallery is written with ``index_build.index_embeddings`` and searched with ``GalleryIndex.topk`` (exact
chunked TAG-PR Eq. 14, or an ANN proposing candidates that are re-ranked exactly from the stored fp16 vectors), so
the timings include the re-rank, the filters' plumbing and the Python around faiss.

Generator (harder than a clustered toy): 2 images per identity; identity content in a low-rank subspace plus
isotropic noise, shared by the global and the TSE embedding (lifted to 1024-d by a fixed random isometry);
image and text embeddings each carry their own modality offset (a CLIP-like gap: text and image cones), and
noise levels give a matched text-image cosine of ~0.35 (printed). Queries describe gallery identities; the
"preset" rows use the index's own parameters (what `tagclip index --ann ivf` gives: nprobe and k_factor
calibrated at build time on held-out gallery rows), "tuned" rows the fastest ones reaching the target on
*held-out* text queries (other identities; skipped with --no-tune); recall@10 vs the exact top-10 is reported on
the held-out and on separate test queries.

Recall is reported across named generators (``--generators``: ``default``, the one the calibration constants
were chosen on, and ``noisy-text``, whose matched text-image cosine comes from isotropic text noise rather than
the modality gap) and seeds (``--seeds``): rows per generator and seed, and a ``summary`` with the minimum recall
over the seeds. With ``--model PATH`` a real-model set is measured too (``search_sets.model_set``): a trained
TAG-CLIP's embeddings of the synthetic test crops it was evaluated on plus rendered distractors as the gallery,
and the test captions as queries.

With ``--filtered``, every row also gets a view, a camera (one of 1000) and a time, all random, and the ``ivf``
preset (its own settings) and Milvus Lite (``--milvus``) answer the same filters keeping 50% (view), 50%, 10%,
1% and 0.1% (camera, time window) of the rows, side by side: recall@10 against the exact filtered top-10 and
batch-1 ms. The embedded rows say which path the measured crossover chose (``ann`` or ``exact``).

    python benchmarks/bench_search.py --quick                          # 4k gallery, seconds
    python benchmarks/bench_search.py --sizes 100000 300000 --threads 1 --clock cpu
    python benchmarks/bench_search.py --sizes 100000 --no-tune --filtered --output /tmp/filtered.json
    python benchmarks/bench_search.py --sizes 30000 --no-tune --seeds 0 1 2 --generators default noisy-text
    python benchmarks/bench_search.py --sizes 0 --no-tune --model outputs/tagclip-synthetic/best
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
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
    run_info,
    time_call,
    write_json,
)
from modeling_tagclip.flags import finite_float, fraction, integer, positive_int  # noqa: E402


def openblas_coretype() -> str | None:
    """OPENBLAS_CORETYPE matching this CPU's flags (SkylakeX for AVX-512, Haswell for AVX2), if any."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return "SkylakeX" if "avx512f" in flags else "Haswell" if {"avx2", "fma"} <= flags else None


if openblas_coretype():  # faiss-cpu's OpenBLAS may run Prescott kernels on a virtualised AVX-512 CPU
    os.environ.setdefault("OPENBLAS_CORETYPE", openblas_coretype())

try:
    import faiss
except ImportError:  # faiss-cpu is optional: `pip install faiss-cpu`
    faiss = None

from modeling_tagclip.retrieval.embedded import ann as annlib  # noqa: E402
from modeling_tagclip.retrieval.embedded import gallery_index as gi  # noqa: E402
from modeling_tagclip.retrieval.embedded.index_build import index_embeddings  # noqa: E402

GLOBAL_DIM, LOCAL_DIM, RANK = 512, 1024, 64
CALIBRATION_SEED = (
    37  # the text queries an index calibrates on: other picks and noise than held-out (11), test (23)
)
TUNE_K_FACTORS, TUNE_TIMED = (20, 40, 80, 120), 30
# Defaults: the matched text-image cosine (~0.35, printed) comes mostly from the modality gap, as in CLIP;
# --text-noise 2.0 --gap 1.0 puts it in isotropic text noise instead (much harder for IVF, see README).
IMAGE_NOISE, TEXT_NOISE, GAP, COMMON = 0.6, 1.2, 1.6, 0.4
GENERATORS = {  # named generators: (text noise, modality gap)
    "default": (TEXT_NOISE, GAP),  # the one the calibration constants (ann.py) were chosen on
    "noisy-text": (2.0, 1.0),  # the matched cosine from isotropic text noise: harder for IVF
}


@dataclass(frozen=True)
class Source:
    """One synthetic generator setting: its name, seed and noise levels."""

    generator: str
    seed: int
    text_noise: float
    gap: float


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


class Generator:
    """Identities, their images (2 each) and text queries; global and TSE share the identity content."""

    def __init__(self, seed: int = 0, text_noise: float = TEXT_NOISE, gap: float = GAP):
        self.g = torch.Generator().manual_seed(seed)
        self.text_noise, self.gap = text_noise, gap
        self.common = unit(torch.randn(GLOBAL_DIM, generator=self.g))  # what every person crop shares
        self.basis = torch.linalg.qr(torch.randn(GLOBAL_DIM, RANK, generator=self.g)).Q
        self.lift = torch.linalg.qr(torch.randn(LOCAL_DIM, GLOBAL_DIM, generator=self.g)).Q  # isometry
        offsets = torch.linalg.qr(torch.randn(GLOBAL_DIM + LOCAL_DIM, 4, generator=self.g)).Q.T
        self.image_offset = (offsets[0, :GLOBAL_DIM], offsets[1, GLOBAL_DIM:])
        self.text_offset = (offsets[2, :GLOBAL_DIM], offsets[3, GLOBAL_DIM:])

    def identities(self, count: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        low = unit(torch.randn(count, RANK, generator=g) @ self.basis.T)
        return unit(low + 0.5 * unit(torch.randn(count, GLOBAL_DIM, generator=g)) + COMMON * self.common)

    def _embed(self, ids: torch.Tensor, noise: float, offset: tuple, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        n = ids.shape[0]
        glob = ids + noise * torch.randn(n, GLOBAL_DIM, generator=g) / GLOBAL_DIM**0.5 + self.gap * offset[0]
        local = ids @ self.lift.T + noise * torch.randn(n, LOCAL_DIM, generator=g) / LOCAL_DIM**0.5
        return {"global": unit(glob), "local": unit(local + self.gap * offset[1])}

    def images(self, ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        return self._embed(ids.repeat_interleave(2, 0), IMAGE_NOISE, self.image_offset, seed)

    def texts(self, ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        return self._embed(ids, self.text_noise, self.text_offset, seed)


def make_gallery(size: int, source: Source, chunk: int = 50_000):
    """(generator, identities, gallery embeddings in fp16, built in chunks to bound memory)."""
    seed = source.seed
    gen = Generator(seed, source.text_noise, source.gap)
    ids = gen.identities(size // 2, seed + 1)
    parts = [gen.images(ids[s : s + chunk // 2], seed + 2 + s) for s in range(0, ids.shape[0], chunk // 2)]
    gallery = {key: torch.cat([p[key].half() for p in parts]) for key in ("global", "local")}
    return gen, ids, gallery


def queries(gen: Generator, ids: torch.Tensor, count: int, seed: int) -> dict[str, torch.Tensor]:
    picked = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(seed))[:count]
    return gen.texts(ids[picked], seed + 7)


def recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    return float((found[:, :, None] == exact[:, None, :]).any(-1).float().mean())


def batch1_ms(search, query: dict[str, torch.Tensor], clock: str) -> float:
    """Median ms of ``search`` called with one query at a time (after one warm-up call)."""
    one = lambda i: {key: value[i : i + 1] for key, value in query.items()}  # noqa: E731
    search(one(0))
    times = [
        time_call(lambda i=i: search(one(i)), torch.device("cpu"), clock) for i in range(len(query["global"]))
    ]
    return round(1000 * median(times), 3)


def tune(
    index: gi.GalleryIndex, held_out: dict, exact: torch.Tensor, k: int, target: float, clock: str
) -> tuple[dict, float]:
    """The fastest (nprobe, k_factor) reaching ``target`` recall on the held-out queries (batch-1 time of
    ``TUNE_TIMED`` of them), else the most accurate: nprobe lists/8 to every list, k_factor 20 to 120."""
    nlist = faiss.extract_index_ivf(index.ann_indexes[0]).nlist
    tried = []
    for nprobe in sorted({max(1, nlist // d) for d in (8, 4, 2)} | {3 * nlist // 4, nlist}):
        for k_factor in TUNE_K_FACTORS:
            set_params(index, nprobe, k_factor)
            value = recall(index.topk(held_out, k)[1], exact)
            ms = (
                batch1_ms(lambda q: index.topk(q, k), _first(held_out, TUNE_TIMED), clock)
                if value >= target
                else 0
            )
            tried.append(({"nprobe": nprobe, "k_factor": k_factor}, value, ms))
    reached = [t for t in tried if t[1] >= target]
    params, value, _ = min(reached, key=lambda t: t[2]) if reached else max(tried, key=lambda t: t[1])
    return params, value


def set_params(index: gi.GalleryIndex, nprobe: int, k_factor: int) -> None:
    index.ann_params["k_factor"] = k_factor
    for ann in index.ann_indexes:
        faiss.extract_index_ivf(ann).nprobe = nprobe


def bench_size(size: int, args: argparse.Namespace, source: Source, folder: Path) -> list[dict[str, Any]]:
    gen, ids, gallery = make_gallery(size, source)
    held_out, test = queries(gen, ids, args.queries, 11), queries(gen, ids, args.queries, 23)
    calibration = {"queries": queries(gen, ids, annlib.CALIBRATION_QUERIES, CALIBRATION_SEED)}
    return bench_set(gallery, held_out, test, args, source.seed, folder, calibration=calibration)


def bench_set(
    gallery, held_out, test, args, seed: int, folder: Path, people=None, calibration=None
) -> list[dict[str, Any]]:
    """Exact search and every ANN on one gallery (fp16 ``global``/``local``) and its held-out and test queries;
    with ``people`` (the person of each gallery row and test query), each row's ``person_r1`` too: the share of
    test queries whose first result shows their person. ``calibration``: the text queries an index built with
    ``--calibration NAME`` is given, by name (``queries``: never the held-out or test ones; ``captions``: the
    held-out ones); a name the set lacks is skipped, ``rows`` gives none."""
    size = gallery["global"].shape[0]
    paths = [f"{i:08d}.jpg" for i in range(size)]
    # exact TAG-PR Eq. 14 over the fp16 vectors the index stores: what an exact index's topk computes
    exact = {
        name: gi.chunked_topk(query, gallery, args.k)[1]
        for name, query in (("held_out", held_out), ("test", test))
    }
    exact_ms = batch1_ms(
        lambda q: gi.chunked_topk(q, gallery, args.k), _first(test, args.timed_exact), args.clock
    )
    rows = [{"size": size, "method": "exact", "recall": 1.0, "ms_per_query_b1": exact_ms}]
    if people is not None:
        rows[0]["person_r1"] = person_r1(exact["test"], people)
    if faiss is None or size < annlib.ANN_MIN_SIZE:  # no ANN is built below that size: exact only
        return rows
    for ann, on, dtype, calibrated in itertools.product(
        args.ann, args.ann_on, args.store_dtype, args.calibration
    ):
        if calibrated != "rows" and calibrated not in (calibration or {}):
            continue
        suffix = ("" if dtype == "fp16" else "_" + dtype) + (
            "" if calibrated == "queries" else "_" + calibrated
        )
        given = (calibrated, calibration[calibrated]) if calibrated != "rows" else None
        rows.extend(
            bench_ann(
                ann,
                on,
                gallery,
                paths,
                held_out,
                test,
                exact,
                args,
                seed,
                folder / f"{ann}_{on}{suffix}",
                people,
                dtype,
                given,
            )
        )
    return rows


def person_r1(found: torch.Tensor, people: dict[str, torch.Tensor]) -> float:
    """The share of test queries whose first result [Q, >=1 gallery rows] shows the query's person."""
    return round(float((people["gallery"][found[:, 0]] == people["test"]).float().mean()), 4)


def _first(query: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    return {key: value[:count] for key, value in query.items()}


def bench_ann(
    ann,
    on,
    gallery,
    paths,
    held_out,
    test,
    exact,
    args,
    seed,
    out: Path,
    people=None,
    store_dtype="fp16",
    calibration=None,
) -> list[dict[str, Any]]:
    """Build one ANN index (``ann`` preset or factory over the ``on`` vectors, a ``store_dtype`` re-rank store,
    ``calibration``: (name, text queries) or None); measure it with the preset's own search parameters, then with the
    fastest ones reaching the target on held-out queries. Recall is against exact search over the fp16 rows: an
    int8 store's recall cost."""
    start = time.perf_counter()
    metadata = filter_metadata(len(paths), paths, seed) if args.filtered else None
    given = calibration[1] if calibration is not None else None
    index = build_ann(out, gallery, paths, ann, on, metadata, args.shard, store_dtype, given)
    build = time.perf_counter() - start
    os.sync()  # the build's files reach the disk before anything is timed: no writeback beside the queries
    ann_bytes = sum((out / s["ann_file"]).stat().st_size for s in index_meta(out))
    refine_bytes = sum(v.numel() * v.element_size() for k, v in index.embeds.items() if k != "view_probs")
    common = {
        "size": len(paths),
        "method": f"ann_{on}",
        "ann": ann,
        "factory": index.meta["ann"]["factory"],
        "store_dtype": store_dtype,
        "calibration": f"rows+{calibration[0]}" if calibration is not None else "rows",
        "build": f"streamed: {args.shard} rows a commit" if 0 < args.shard < len(paths) else "one commit",
        "segments": len(index_meta(out)),
        "build_s": round(build, 1),
        "faiss_mib": round(ann_bytes / 2**20, 1),
        "ann_index_mib": round((ann_bytes + refine_bytes) / 2**20, 1),
    }
    nprobe = faiss.extract_index_ivf(index.ann_indexes[0]).nprobe
    defaults = {"nprobe": nprobe, "k_factor": int(index.ann_params.get("k_factor", annlib.IVF_K_FACTOR))}
    calibration = index.meta["ann"].get("calibration")
    if calibration:
        common["calibration_recall_proxies"] = calibration["recall_at_10"]
        for name, found in calibration.get("sets", {}).items():
            common[f"calibration_recall_{name}"] = found["recall_at_10"]
    settings = [("preset", defaults)]
    if args.filtered and ann == "ivf" and on == "combined":
        args.filtered_rows.extend(bench_filtered(index, gallery, paths, test, args, seed, out.parent))
    if not args.no_tune:
        settings.append(
            ("tuned", tune(index, held_out, exact["held_out"], args.k, args.target, args.clock)[0])
        )
    return [
        {**common, "params": name, **params, **measure(index, params, held_out, test, exact, args, people)}
        for name, params in settings
    ]


def build_ann(
    out: Path,
    gallery: dict,
    paths: list[str],
    ann: str,
    on: str,
    metadata,
    shard: int,
    store_dtype="fp16",
    calibration: dict | None = None,
):
    """The ANN index of ``gallery``: written at once, or (``shard`` > 0) streamed as a user's ingest writes it,
    one commit of ``shard`` rows after another (``index_embeddings`` adds: segments merged by size tier, the
    quantizer retrained and recalibrated as the gallery grows), given the ``calibration`` text queries when
    built; served as loaded from its folder."""
    size = len(paths)
    shard = shard if 0 < shard < size else size
    for start in range(0, size, shard):
        part = slice(start, start + shard)
        index_embeddings(
            out,
            {key: value[part] for key, value in gallery.items()},
            paths[part],
            out.parent,
            ann=ann if start == 0 else None,
            ann_on=on,
            metadata={p: metadata[p] for p in paths[part]} if metadata else None,
            store_dtype=store_dtype,
            calibration_queries=calibration if start == 0 else None,
        )
    return gi.GalleryIndex.load(out, cache=False)


def measure(
    index, params: dict, held_out: dict, test: dict, exact: dict, args, people=None
) -> dict[str, Any]:
    """Recall@k on the held-out and on the test queries, and batch-1 ms on the test queries, at ``params``
    (with ``people``, the person R@1 of the test queries too)."""
    set_params(index, params["nprobe"], params["k_factor"])
    found = index.topk(test, args.k)[1]
    return {
        "recall_held_out": round(recall(index.topk(held_out, args.k)[1], exact["held_out"]), 4),
        "recall": round(recall(found, exact["test"]), 4),
        **({"person_r1": person_r1(found, people)} if people is not None else {}),
        "ms_per_query_b1": batch1_ms(lambda q: index.topk(q, args.k), _first(test, args.timed), args.clock),
    }


FILTER_SHARES = (0.5, 0.1, 0.01, 0.001)
CAMERAS, T0 = 1000, 1_700_000_000


def filter_metadata(size: int, paths: list[str], seed: int) -> dict[str, dict]:
    """Random view (half aerial), camera (one of ``CAMERAS``) and time (a permutation of T0 + 0..size-1) per
    row: a filter keeps a random share of the rows, spread over the embedding space."""
    g = torch.Generator().manual_seed(seed + 101)
    aerial = torch.randperm(size, generator=g) < size // 2
    cameras = torch.randint(0, CAMERAS, (size,), generator=g)
    times = torch.randperm(size, generator=g)
    return {
        path: {"view": "aerial" if a else "ground", "camera": str(int(c)), "timestamp": T0 + int(t)}
        for path, a, c, t in zip(paths, aerial.tolist(), cameras.tolist(), times.tolist(), strict=True)
    }


def truth_recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    """The share of the exact top-k found (a filter keeping fewer than k rows has fewer to find)."""
    return float((exact[:, :, None] == found[:, None, :]).any(-1).float().mean())


def filter_cases(size: int) -> list[tuple[str, float, dict]]:
    """(kind, share, filters): the view filter (half), camera lists and time windows keeping each share."""
    cases = [("view", 0.5, {"view": "aerial"})]
    for share in FILTER_SHARES:
        cases.append(("camera", share, {"camera": [str(c) for c in range(max(1, round(share * CAMERAS)))]}))
        cases.append(("time", share, {"after": T0, "before": T0 + max(1, round(share * size))}))
    return cases


def case_mask(metadata: dict[str, dict], paths: list[str], spec: dict) -> torch.Tensor:
    """Bool [N]: the rows a filter keeps, from the metadata itself (not through either backend)."""
    rows = [metadata[p] for p in paths]
    keep = torch.ones(len(paths), dtype=torch.bool)
    if "view" in spec:
        keep &= torch.tensor([r["view"] == spec["view"] for r in rows])
    if "camera" in spec:
        cams = set(spec["camera"])
        keep &= torch.tensor([r["camera"] in cams for r in rows])
    if "after" in spec:
        stamps = torch.tensor([r["timestamp"] for r in rows])
        keep &= (stamps >= spec["after"]) & (stamps < spec["before"])
    return keep


def bench_filtered(index, gallery, paths, test, args, seed: int, folder: Path) -> list[dict[str, Any]]:
    """The ``ivf`` preset and Milvus Lite (``args.milvus`` index types) under the same filters: recall@k vs the
    exact filtered top-k, batch-1 ms; the embedded rows name the path the measured crossover chose."""
    metadata = filter_metadata(len(paths), paths, seed)
    cases = [
        (kind, share, spec, case_mask(metadata, paths, spec))
        for kind, share, spec in filter_cases(len(paths))
    ]
    exact = {i: gi.chunked_topk(test, gallery, args.k, mask=mask)[1] for i, (*_, mask) in enumerate(cases)}
    crossover = index.describe()["filtered_search"]
    rows = []
    for i, (kind, share, spec, mask) in enumerate(cases):
        found = index.topk(test, args.k, filters=spec)[1]
        path = "exact" if int(mask.sum()) <= index.crossover_rows() else "ann"
        ms = batch1_ms(
            lambda q, spec=spec: index.topk(q, args.k, filters=spec), _first(test, args.timed), args.clock
        )
        rows.append(
            {
                "size": len(paths),
                "backend": "embedded",
                "index": "ivf",
                "filter": kind,
                "share": share,
                "kept_rows": int(mask.sum()),
                "path": path,
                "crossover_rows": crossover["crossover_rows"],
                "recall": round(truth_recall(found, exact[i]), 4),
                "ms_per_query_b1": ms,
            }
        )
    for kind_index in args.milvus:
        rows.extend(milvus_filtered(kind_index, gallery, paths, metadata, test, cases, exact, args, folder))
    return rows


def milvus_filtered(kind_index, gallery, paths, metadata, test, cases, exact, args, folder) -> list[dict]:
    """One Milvus Lite collection of ``kind_index`` with the same rows and metadata, under every filter case."""
    from benchmarks.bench_milvus import _rows
    from modeling_tagclip.retrieval.milvus import MilvusGallery

    store = MilvusGallery.create(
        str(folder / f"milvus_{kind_index}.db"),
        "bench",
        dim=gallery["global"].shape[1] + gallery["local"].shape[1],
        fingerprint=None,
        image_root="",
        index_type=kind_index,
    )
    rows = []
    try:
        for s in range(0, len(paths), 8192):
            chunk = paths[s : s + 8192]
            store.add({k: v[s : s + 8192] for k, v in gallery.items()}, chunk, [metadata[p] for p in chunk])
        store.flush()
        timed = _first(test, args.timed_milvus)
        for i, (kind, share, spec, mask) in enumerate(cases):
            found = _rows(store.search(test, args.k, filters=spec), args.k)
            ms = batch1_ms(lambda q, spec=spec: store.search(q, args.k, filters=spec), timed, args.clock)
            rows.append(
                {
                    "size": len(paths),
                    "backend": "milvus-lite",
                    "index": kind_index,
                    "filter": kind,
                    "share": share,
                    "kept_rows": int(mask.sum()),
                    "path": None,
                    "crossover_rows": None,
                    "recall": round(truth_recall(found, exact[i]), 4),
                    "ms_per_query_b1": ms,
                }
            )
    finally:
        store.close()
    return rows


def index_meta(path: Path) -> list[dict]:
    import json

    return json.loads((path / "manifest.json").read_text())["segments"]


def matched_cosine(source: Source, count: int = 2000) -> dict[str, float]:
    """Mean text-image cosine (global) of matched pairs, of random pairs, and image-image of one identity."""
    seed = source.seed
    gen = Generator(seed, source.text_noise, source.gap)
    ids = gen.identities(count, seed + 1)
    img, txt = gen.images(ids, 5)["global"], gen.texts(ids, 6)["global"]
    return {
        "text_image_matched": round(float((txt * img[::2]).sum(1).mean()), 3),
        "text_image_random": round(float((txt * img[1::2].roll(1, 0)).sum(1).mean()), 3),
        "image_image_same_identity": round(float((img[::2] * img[1::2]).sum(1).mean()), 3),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=integer, nargs="+", default=[100_000, 300_000], help="gallery sizes (0: none)"
    )
    parser.add_argument(
        "--ann", nargs="+", default=["ivf"], help="ANN presets (ivf, ivf-full) or faiss factories"
    )
    parser.add_argument("--ann-on", nargs="+", default=["combined"], choices=["global", "combined"])
    parser.add_argument(
        "--store-dtype",
        nargs="+",
        default=["fp16"],
        choices=["fp16", "int8"],
        help="re-rank stores to build each ANN index with (int8: its recall cost against fp16)",
    )
    parser.add_argument(
        "--calibration",
        nargs="+",
        default=["queries"],
        choices=["queries", "rows", "captions"],
        help="what each ANN index calibrates on besides moved gallery rows: 'queries' = text queries never "
        "measured (generators: other picks; --model: the person descriptions `tagclip index --ann` uses), "
        "'captions' = --model's held-out captions (a user's --calibration-texts), 'rows' = nothing more",
    )
    parser.add_argument("--queries", type=positive_int, default=500, help="held-out and test queries (each)")
    parser.add_argument("--timed", type=positive_int, default=200, help="test queries timed one by one")
    parser.add_argument(
        "--timed-exact", type=positive_int, default=10, help="test queries timed one by one, exact search"
    )
    parser.add_argument("-k", type=positive_int, default=10)
    parser.add_argument("--target", type=fraction, default=0.95, help="recall@k the tuning aims for")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument(
        "--seeds",
        type=integer,
        nargs="+",
        default=[0],
        help="generator seeds (rows per seed, minimum in summary)",
    )
    parser.add_argument(
        "--generators",
        nargs="+",
        default=["default"],
        choices=sorted(GENERATORS),
        help="named synthetic generators (default: the one the ANN constants were chosen on)",
    )
    parser.add_argument(
        "--text-noise", type=finite_float, help="a custom generator: isotropic noise of text embeddings"
    )
    parser.add_argument(
        "--gap", type=finite_float, help="a custom generator: modality offset of text and images"
    )
    parser.add_argument(
        "--model", metavar="PATH", help="also measure a trained TAG-CLIP's embeddings (search_sets.model_set)"
    )
    parser.add_argument(
        "--distractors",
        type=positive_int,
        default=8192,
        help="rendered distractor crops added to the model set's gallery",
    )
    parser.add_argument(
        "--no-tune", action="store_true", help="measure the preset's own (calibrated) settings only"
    )
    parser.add_argument("--quick", action="store_true", help="4k gallery, 100 queries, ANN over both vectors")
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="write the indexes under DIR/<size>/ and keep them (default: a temp folder)",
    )
    parser.add_argument(
        "--filtered",
        action="store_true",
        help="also time filters keeping 50/10/1/0.1%% of the rows (ivf preset)",
    )
    parser.add_argument(
        "--milvus",
        nargs="*",
        default=["flat"],
        choices=["flat", "hnsw", "ivf_flat", "ivf_sq8"],
        help="Milvus Lite index types given the same filters (none: embedded only)",
    )
    parser.add_argument(
        "--timed-milvus", type=positive_int, default=20, help="test queries timed on Milvus Lite"
    )
    parser.add_argument(
        "--shard",
        type=integer,
        default=0,
        metavar="ROWS",
        help="stream each ANN index as commits of ROWS rows (the first builds, the rest add), as ingest does; "
        "0: one commit",
    )
    parser.add_argument("--output", default=str(RESULTS_DIR / "search_cpu.json"))
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.queries, args.timed, args.timed_exact = [4096], 100, 20, 5
        args.ann_on = ["global", "combined"]
    if args.shard < 0:
        parser.error(f"--shard must be >= 0 rows, got {args.shard}")
    if any(size < 0 for size in args.sizes):
        parser.error(f"--sizes must be >= 0, got {args.sizes}")
    args.sizes = [size for size in args.sizes if size]
    if not args.sizes and not args.model:
        parser.error("nothing to measure: give --sizes above 0 or --model")
    folders = [path for source in sources(args) for path in size_folders(args, source)] if args.keep else []
    taken = [str(path) for path in folders if path.exists()]
    if taken:  # an index folder there would get the new rows appended
        parser.error(f"--keep: {', '.join(taken)} already exist(s); name a folder without them")
    return args


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def sources(args: argparse.Namespace) -> list[Source]:
    """Every (generator, seed) asked for, generator-major; ``--text-noise`` / ``--gap`` make one ``custom``
    generator instead of the named ones."""
    named = {name: GENERATORS[name] for name in args.generators}
    if args.text_noise is not None or args.gap is not None:
        named = {"custom": (_given(args.text_noise, TEXT_NOISE), _given(args.gap, GAP))}
    return [Source(name, seed, *noise) for name, noise in named.items() for seed in args.seeds]


def size_folders(args: argparse.Namespace, source: Source, root: Path | None = None) -> list[Path]:
    """Index folder per size: ``<root>/<size>`` for the first generator's first seed (what ``bench_serving.py``
    reads with ``--keep``), ``<root>/<generator>-seed<seed>/<size>`` for the others."""
    root = Path(args.keep) if root is None else root
    first = source == sources(args)[0]
    return [root / ("" if first else f"{source.generator}-seed{source.seed}") / str(s) for s in args.sizes]


TABLE = ["generator", "seed", "size", "method", "factory", "params", "nprobe", "k_factor"]
TABLE += ["recall_held_out", "recall", "ms_per_query_b1", "build_s", "faiss_mib", "ann_index_mib"]
SUMMARY_KEYS = ("generator", "size", "method", "ann", "store_dtype", "calibration", "params")


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per generator, size, method and setting: the seeds, the minimum (and mean) recall over them and the
    median ms per query."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(key) for key in SUMMARY_KEYS), []).append(row)
    out = []
    for key, group in groups.items():
        held = [r["recall_held_out"] for r in group if r.get("recall_held_out") is not None]
        out.append(
            {
                **{name: value for name, value in zip(SUMMARY_KEYS, key, strict=True) if value is not None},
                "seeds": [r["seed"] for r in group],
                "recall_min": min(r["recall"] for r in group),
                "recall_mean": round(sum(r["recall"] for r in group) / len(group), 4),
                "recall_held_out_min": min(held) if held else None,
                "ms_per_query_b1": round(median([r["ms_per_query_b1"] for r in group]), 3),
            }
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if faiss is not None:
        faiss.omp_set_num_threads(args.threads)
    rows, args.filtered_rows, generators = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources(args) if args.sizes else []:
            params = {"text_noise": source.text_noise, "gap": source.gap}
            generators.setdefault(source.generator, {**params, "matched_cosine": {}})
            generators[source.generator]["matched_cosine"][source.seed] = matched_cosine(source)
            for size, folder in zip(
                args.sizes, size_folders(args, source, Path(args.keep or tmp)), strict=True
            ):
                tag = {"generator": source.generator, "seed": source.seed}
                rows.extend({**tag, **row} for row in bench_size(size, args, source, folder))
                print_table(rows, TABLE)
        if args.model:
            from benchmarks.search_sets import model_set

            gallery, held_out, test, info, people, calibration = model_set(
                args.model, args.distractors, args.seeds[0]
            )
            generators["model"] = info
            folder = Path(args.keep or tmp) / "model"
            tag = {"generator": "model", "seed": args.seeds[0]}
            rows.extend(
                {**tag, **row}
                for row in bench_set(
                    gallery, held_out, test, args, args.seeds[0], folder, people, calibration
                )
            )
            print_table(rows, TABLE)
    print_table(
        summary(rows), [*SUMMARY_KEYS, "seeds", "recall_min", "recall_held_out_min", "ms_per_query_b1"]
    )
    payload = {
        "command": "python benchmarks/bench_search.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(torch.device("cpu")),
        **run_info(),
        "threads": args.threads,
        "clock": args.clock,
        "dims": {"global": GLOBAL_DIM, "local": LOCAL_DIM, "stored": GLOBAL_DIM + LOCAL_DIM},
        "generators": generators,
        "rows": rows,
        "summary": summary(rows),
        **({"filtered_rows": args.filtered_rows} if args.filtered else {}),
    }
    if args.filtered:
        print_table(
            args.filtered_rows,
            ["size", "backend", "index", "filter", "share", "kept_rows", "path", "recall", "ms_per_query_b1"],
        )
    write_json(args.output, payload)
    return payload


if __name__ == "__main__":
    main()
