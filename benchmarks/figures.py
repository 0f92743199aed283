"""Which results file feeds which published figure: one `Figure` entry per table (`benchmarks/render.py`).

To publish a new table, add an entry here and put `<!-- figure: NAME -->` `<!-- /figure -->` in the page.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import memory_model, scaling_plot
from benchmarks.render import Column, Figure, Picture

CPU_S = "{:.3f}"
SEEDS_COMMAND = (
    "python benchmarks/bench_search.py --sizes 5000 10000 30000 100000 300000 --no-tune --seeds 0 1 2 "
    "--generators default noisy-text --queries 300 --timed 100"
)
MILLION_COMMAND = (
    "python benchmarks/bench_search.py --sizes 1000000 --no-tune --shard 100000 --store-dtype fp16 int8 "
    "--queries 300 --timed 100 --timed-exact 3"
)
INT8_COMMAND = (
    "python benchmarks/bench_search.py --sizes 100000 --no-tune --seeds 0 1 2 --store-dtype fp16 int8 "
    "--queries 300 --timed 100"
)
MODEL_COMMAND = (
    "python benchmarks/bench_search.py --sizes 0 --no-tune --model outputs/tagclip-synthetic/best "
    "--calibration queries rows captions"
)
RATIO = "{:.2f}x"
ANN_COLUMNS = (  # an ANN search row: gallery size, method, its search parameters and recall@10
    Column("gallery crops", "size", "{:,}"),
    Column("method", "method", align="---"),
    Column("nprobe", "nprobe"),
    Column("k_factor", "k_factor"),
    Column("recall@10", "recall", "{:.3f}"),
    Column("recall@10 held-out", "recall_held_out", "{:.3f}"),
)
SEED_COLUMNS = (  # a summary row of bench_search.py over seeds: the seeds, min and mean recall@10
    Column("seeds", "seeds", "{}"),
    Column("min recall@10", "recall_min", "{:.3f}"),
    Column("mean recall@10", "recall_mean", "{:.3f}"),
    Column("min recall@10 held-out", "recall_held_out_min", "{:.3f}"),
)


def ablation_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant and test gallery: mean ± 95% CI half-width of each metric."""
    rows = []
    for variant in data["summary"].values():
        for gallery, metrics in variant["galleries"].items():
            row = {"variant": variant["label"], "gallery": gallery, "seeds": len(variant["seeds"])}
            row.update({name: f"{m['mean']:.2f} ± {m['ci95']:.2f}" for name, m in metrics.items()})
            rows.append(row)
    return rows


def ordering_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's expected orderings: difference of means and the paired per-seed 95% interval."""
    labels = {key: variant["label"] for key, variant in data["summary"].items()}
    return [
        {
            "claim": f"{labels[o['better']]} > {labels[o['worse']]}",
            "gallery": o["gallery"],
            "difference": o["difference"],
            "paired": f"{o['paired']['mean']:+.2f} ± {o['paired']['ci95']:.2f}",
            "holds": o["holds"],
            "established": o["paired_excludes_zero"],
        }
        for o in data["orderings"]
    ]


def milvus_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Milvus Lite rows, each query time also as a ratio to the embedded `ivf` preset's in the same run (whose
    own latency is published once, in the search figure)."""
    embedded = {r["size"]: r for r in data["rows"] if r["backend"] == "embedded"}
    rows = []
    for row in data["rows"]:
        if row["backend"] == "embedded":
            continue
        base = embedded.get(row["size"], {}).get("ms_per_query_b1")
        rows.append({**row, "vs_embedded": row["ms_per_query_b1"] / base if base else None})
    return rows


def first_seed_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a ``bench_search.py`` file's first generator and seed (every row of a file without them)."""
    rows = data["rows"]
    first = (rows[0].get("generator"), rows[0].get("seed")) if rows else None
    return [row for row in rows if (row.get("generator"), row.get("seed")) == first]


def ablation_provenance(data: dict[str, Any]) -> str:
    settings = data.get("run_settings", {})
    minutes = f", {data['wall_time_s'] / 60:.0f} min of run time" if data.get("wall_time_s") else ""
    return (
        f"From `docs/ablation/{data['study']}.json` (`tagclip ablate --study {data['study']}`): "
        f"{settings.get('max_steps', '?')} optimiser steps per run{minutes}; every run's numbers are in the file."
    )


ABLATION_COLUMNS = (
    Column("variant", "variant", align="---"),
    Column("test gallery", "gallery", align="---"),
    Column("seeds", "seeds"),
    Column("R@1", "R@1"),
    Column("R@5", "R@5"),
    Column("R@10", "R@10"),
    Column("mAP", "mAP"),
)
ORDERING_COLUMNS = (
    Column("expected ordering", "claim", align="---"),
    Column("gallery", "gallery", align="---"),
    Column("Δ R@1", "difference", "{:+.2f}"),
    Column("paired Δ ± 95% CI", "paired"),
    Column("holds on the means", "holds"),
    Column("interval excludes 0", "established"),
)


def _ablation(study: str) -> list[Figure]:
    path, command = f"docs/ablation/{study}.json", f"tagclip ablate --study {study}"
    return [
        Figure(
            f"ablation-{study}",
            path,
            ABLATION_COLUMNS,
            command,
            rows=ablation_rows,
            record=False,
            note="Cells: mean ± 95% CI half-width (Student t) over seeds.",
            provenance=ablation_provenance,
        ),
        Figure(
            f"ablation-{study}-orderings",
            path,
            ORDERING_COLUMNS,
            command,
            rows=ordering_rows,
            record=False,
            provenance=ablation_provenance,
        ),
    ]


TOWER_COLUMNS = (
    Column("tower", "tower", align="---"),
    Column("batch", "batch"),
    Column("CPU s / batch", "median_s", CPU_S),
    Column("/ CLIP", "ratio_vs_baseline", RATIO),
    Column("FLOP-ideal", "flop_ideal_ratio", RATIO),
    Column("overhead", "overhead", RATIO),
    Column("peak MiB", "memory_peak_mib", "{:.0f}"),
)


def _spread(row: dict[str, Any], key: str, fmt: str) -> str | None:
    """``mean ± std`` of a metric over seeds (None where the row has no such metric)."""
    if row.get(key) is None:
        return None
    return f"{fmt.format(row[key])} ± {fmt.format(row[key + '_std'])}"


def ingest_accuracy_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    metrics = (
        ("recall", "{:.3f}"),
        ("precision", "{:.3f}"),
        ("idf1", "{:.3f}"),
        ("mota", "{:.3f}"),
        ("num_switches", "{:.1f}"),
    )
    return [
        {"mode": r["mode"], "view": r["view"], **{k: _spread(r, k, f) for k, f in metrics}}
        for r in data["accuracy"]
    ]


def _crop_level(result: dict[str, Any] | None) -> str:
    """The model's own crop-level test figures (its eval_results.json), for comparison."""
    if not result:
        return "The model folder has no eval_results.json beside it: no crop-level figure to compare."
    size = (
        f" over {result['num_gallery']} test crops of {result['num_identities']} identities"
        if result.get("num_gallery") and result.get("num_identities")
        else ""
    )
    return (
        f"The same model's crop-level test R@1 {result['R@1']:.2f}, mAP {result['mAP']:.2f}{size}: a gallery "
        "of other sizes, so the two figures do not compare directly."
    )


INGEST_NOTE = (
    "The default synthetic footage (two street cameras, one drone; 12 s at 10 fps, 480x270), sampled at 4 "
    "frames per second; mean ± standard deviation over seeds 0, 1, 2, each view's cameras scored together by "
    "py-motmetrics (IoU 0.5). Noise: each coordinate of a true box moved by 5% of its size, 10% of the frames "
    "dropped whole. `trackers ByteTrack`: the Apache-2.0 `trackers` package (2.6.1, installed for this run "
    "only) with the same score thresholds and lost-track buffer."
)


def rerank_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows, each naming its set (a file from before sets measured only the synthetic set)."""
    return [{"set": "synthetic_reid", **row} for row in data["rows"]]


def rerank_note(data: dict[str, Any]) -> str:
    cfg = data["rerank"]
    sets = data.get("sets", {"synthetic_reid": {"description": "the synthetic re-ID set"}})
    parts = []
    for name, about in sets.items():
        runs = [run for run in data["runs"] if run.get("set", "synthetic_reid") == name]
        seconds = [run["rerank_s"] for run in runs]
        parts.append(
            f"`{name}`: {about['description']} ({runs[0]['query']} queries, {runs[0]['gallery']} gallery images; "
            f"re-ranking took {min(seconds):.1f}-{max(seconds):.1f} CPU s for the five protocols of one model)"
        )
    return (
        f"ViSA trained on the synthetic re-ID set (the `visa-synthetic` recipe), one model per seed; cells: mean "
        f"± 95% CI half-width over the models. Re-ranking: k1 {cfg['k1']}, k2 {cfg['k2']}, lambda "
        f"{cfg['lambda_value']}. Sets: {'; '.join(parts)}."
    )


def _footage_text(data: dict[str, Any]) -> str:
    """The footage of a crossview run in words, with its tracks per seed."""
    f, runs = data["footage"], data["runs"]
    tracks = [run["tracks"] for run in runs]
    count = str(min(tracks)) if min(tracks) == max(tracks) else f"{min(tracks)}-{max(tracks)}"
    return (
        f"Synthetic footage of seeds {', '.join(str(s) for s in data['seeds'])} ({f['ground_cameras']} street "
        f"cameras and {f['aerial_cameras']} drones, {f['people']} people, {f['people_per_camera']} a camera, "
        f"{f['seconds']:g} s each) ingested by `tagclip ingest` at {data['fps']:g} frames a second: "
        f"{count} tracks a seed, each given the true identity its boxes overlap"
    )


def crossview_note(data: dict[str, Any]) -> str:
    cfg, reid = data["rerank"], data["reid_models"]
    visa = f"ViSA: {', '.join(f'`{m}`' for m in reid)}, one per seed" if reid else "no ViSA model was given"
    return (
        f"{_footage_text(data)}. A query is a track (the mean of its crops' embeddings); the gallery is every "
        f"track of the other view, scored by its best crop. TAG-CLIP: `{data['model']}`, global + TSE "
        f"embeddings by TAG-PR Eq. 14; {visa}. Re-ranking: k-reciprocal, k1 {cfg['k1']}, k2 {cfg['k2']}, lambda "
        f"{cfg['lambda_value']}. Cells: mean ± 95% CI half-width over the seeds; queries summed over them."
    )


def crossview_timeline_note(data: dict[str, Any]) -> str:
    chance = sum(100.0 * min(data["top"], run["tracks"]) / run["tracks"] for run in data["runs"]) / len(
        data["runs"]
    )
    return (
        f"{_footage_text(data)}. Each caption of each identity shown finds its first sighting (the top track "
        f"for the description, TAG-CLIP); that track is the image query; the share is that of the person's "
        f"true tracks among its top {data['top']} tracks (ground->aerial: the person's aerial tracks when the "
        f"first sighting is a ground track; all: every track of the person). A random ranking finds "
        f"{chance:.0f}% of them on average."
    )


CROSSVIEW_COMMAND = (
    "python benchmarks/bench_crossview.py --model outputs/tagclip-synthetic/best --reid-models runs/visa-s0/best "
    "runs/visa-s1/best runs/visa-s2/best"
)


FIGURES_LIST: list[Figure] = [
    Figure(
        "rerank",
        "benchmarks/results/rerank_cpu.json",
        (
            Column("set", "set", align="---"),
            Column("protocol", "protocol", align="---"),
            Column("models", "models"),
            Column("mAP", "mAP_plain"),
            Column("mAP re-ranked", "mAP_reranked"),
            Column("mAP gain", "mAP_gain"),
            Column("R@1", "R1_plain"),
            Column("R@1 re-ranked", "R1_reranked"),
        ),
        "python benchmarks/bench_rerank.py --models runs/visa-s0/best runs/visa-s1/best runs/visa-s2/best",
        rows=rerank_rows,
        note=rerank_note,
    ),
    Figure(
        "crossview",
        "benchmarks/results/crossview_cpu.json",
        (
            Column("embeddings", "embedding", align="---"),
            Column("query -> gallery", "direction", align="---"),
            Column("queries", "queries"),
            Column("gallery tracks", "gallery_tracks"),
            Column("R@1", "R@1"),
            Column("mAP", "mAP"),
        ),
        CROSSVIEW_COMMAND,
        note=crossview_note,
    ),
    Figure(
        "crossview-timeline",
        "benchmarks/results/crossview_cpu.json",
        (
            Column("image query", "embedding", align="---"),
            Column("first sighting -> the person's tracks", "direction", align="---"),
            Column("queries", "queries"),
            Column("first sighting is the person, %", "first_right"),
            Column("true tracks found, %", "share"),
        ),
        CROSSVIEW_COMMAND,
        rows=lambda data: data["timeline_rows"],
        note=crossview_timeline_note,
    ),
    Figure(
        "export",
        "benchmarks/results/export_base_cpu.json",
        (
            Column("batch", "batch"),
            Column("PyTorch eager CPU s", "pytorch_s", CPU_S),
            Column("ONNX Runtime CPU s", "onnxruntime_s", CPU_S),
            Column("ONNX Runtime / PyTorch", "ratio", RATIO),
            Column("max diff (global)", "max_diff_global", "{:.1e}"),
            Column("TSE tokens equal", "tse_indices_equal"),
        ),
        "python benchmarks/bench_export.py --threads 1 --clock cpu",
        note=lambda data: (
            "ViT-B/16 HR-MoE image graph at 224x224, fp32; median of per-round ratios, interleaved "
            f"rounds, on one CPU ({data['machine']['cpu'].get('model')}, "
            f"{', '.join(data['machine']['cpu'].get('flags') or []) or 'no flags recorded'}): the ratio holds for that "
            "CPU at that load only. The work differs: the ONNX graph runs every expert on every token (the dense "
            "formula), PyTorch only the routed (token, expert) pairs."
        ),
    ),
    Figure(
        "grad-cache",
        "benchmarks/results/grad_cache_small.json",
        (
            Column("chunks", "chunks"),
            Column("batch", "batch"),
            Column("CPU s / step", "median_s", CPU_S),
            Column("time / whole batch", "time_vs_full", RATIO),
            Column("activations held for backward, MiB", "saved_mib", "{:.0f}"),
            Column("memory / whole batch", "saved_vs_full", RATIO),
        ),
        "python benchmarks/bench_grad_cache.py --size small --batch-size 16 --chunks 1 4 --repeats 3 --threads 1 "
        "--clock cpu",
    ),
    Figure(
        "towers",
        "benchmarks/results/towers_base_cpu.json",
        TOWER_COLUMNS,
        "python benchmarks/bench_towers.py --threads 1 --clock cpu",
        note="Image towers at the reference ViT-B/16 config, fp32 eager, against transformers' "
        "`CLIPVisionModel` in the same run.",
    ),
    Figure(
        "search",
        "benchmarks/results/search_cpu_seeds.json",
        (
            *ANN_COLUMNS[:2],
            Column("store", "store_dtype", align="---"),
            *ANN_COLUMNS[2:],
            Column("ms / query", "ms_per_query_b1", "{:.2f}"),
            Column("ANN index MiB", "ann_index_mib", "{:.0f}"),
        ),
        SEEDS_COMMAND,
        rows=first_seed_rows,
        note="The `ivf` preset with the nprobe and k_factor it calibrates at build time (nothing tuned by hand), "
        "against exact search, on `bench_search.py`'s default generator (seed 0; every seed and a second "
        "generator in the [next table](search.md#recall-on-other-seeds-and-generators)); one thread, CPU time per "
        "query at batch 1.",
        more=[("benchmarks/results/search_cpu_1m.json", MILLION_COMMAND)],
        order=lambda row: row["size"],
    ),
    Figure(
        "search-seeds",
        "benchmarks/results/search_cpu_seeds.json",
        (
            Column("generator", "generator", align="---"),
            Column("gallery crops", "size", "{:,}"),
            *SEED_COLUMNS,
        ),
        SEEDS_COMMAND,
        rows=lambda data: data["summary"],
        keep=lambda row: row["method"] == "ann_combined",
        note=lambda data: (
            "The `ivf` preset (its calibrated settings) against exact search, the minimum over "
            "the seeds: "
            + "; ".join(
                f"`{name}` text noise {g['text_noise']}, modality gap {g['gap']}"
                for name, g in data["generators"].items()
                if "text_noise" in g
            )
            + ". The `ivf` constants were chosen on `default`; `noisy-text` puts the text-image distance in "
            "isotropic text noise instead of the modality gap. Each index calibrates on moved gallery rows and "
            "256 text queries of its generator, never the held-out or test ones."
        ),
    ),
    Figure(
        "search-int8",
        "benchmarks/results/search_cpu_int8.json",
        (
            Column("gallery crops", "size", "{:,}"),
            Column("store", "store_dtype", align="---"),
            *SEED_COLUMNS,
            Column("ms / query", "ms_per_query_b1", "{:.2f}"),
        ),
        INT8_COMMAND,
        rows=lambda data: data["summary"],
        keep=lambda row: row["method"] == "ann_combined",
        note="The `ivf` preset (its calibrated settings) built with each store on the same galleries of "
        "`bench_search.py`'s default generator, recall@10 against exact search over the fp16 vectors (for "
        "int8: its recall cost), the minimum and mean over the seeds; one thread, CPU time per query at batch "
        "1 (the median over the seeds).",
    ),
    Figure(
        "search-model",
        "benchmarks/results/search_model.json",
        (
            *ANN_COLUMNS[:2],
            Column("calibrated on", "calibration", align="---"),
            *ANN_COLUMNS[2:],
            Column("ms / query", "ms_per_query_b1", "{:.2f}"),
            Column("person R@1", "person_r1", "{:.1%}"),
        ),
        MODEL_COMMAND,
        note=lambda data: (
            "The `ivf` preset (its calibrated settings) against exact search on a trained "
            "TAG-CLIP's embeddings: {test_crops:,} synthetic test crops and {distractors:,} rendered distractors, "
            "{captions:,} test captions as queries (half held out: the other caption of each test crop). "
            "Calibrated on `rows`: moved gallery rows alone; `rows+queries`: and the model's embeddings of the "
            "256 built-in person descriptions (the default); `rows+captions`: and the held-out captions, as "
            "`--calibration-texts` gives a user's own (its held-out column is then in-sample). Recall@10: the share of exact search's top 10 found; person R@1: the share of test captions "
            "whose first result shows their person; one thread, CPU time per query at batch 1."
        ).format(**data["generators"]["model"]),
    ),
    Figure(
        "search-filtered",
        "benchmarks/results/search_filtered_cpu.json",
        (
            Column("gallery crops", "size", "{:,}"),
            Column("backend", "backend", align="---"),
            Column("index", "index", align="---"),
            Column("filter", "filter", align="---"),
            Column("kept", "share", "{:.1%}"),
            Column("kept rows", "kept_rows", "{:,}"),
            Column("path", "path", align="---"),
            Column("recall@10", "recall", "{:.3f}"),
            Column("filtered ms / query", "ms_per_query_b1", "{:.2f}"),
        ),
        "python benchmarks/bench_search.py --sizes 100000 --no-tune --filtered --milvus flat --queries 200 "
        "--timed 100 --timed-milvus 20",
        rows=lambda data: data["filtered_rows"],
        note="The same random view, camera and time filters on the `ivf` preset (its own settings; `path`: the "
        "filtered ANN, or an exact scan of the kept rows below the crossover it measures) and on Milvus Lite; "
        "recall against the exact filtered TAG-PR Eq. 14 top-10; one thread, CPU time per query at batch 1.",
    ),
    Figure(
        "serving",
        f"benchmarks/results/{memory_model.MODES_FILE}",
        (
            Column("gallery crops", "size", "{:,}"),
            Column("store", "store_dtype", align="---"),
            Column("load", "load", align="---"),
            Column("index on disk, MiB", "index_mib", "{:.0f}"),
            Column("added at peak, MiB", "added_peak_mib", "{:.0f}"),
            Column("peak / index", "peak_over_index", RATIO),
            Column("anonymous, MiB", "added_anon_mib", "{:.0f}"),
            Column("anonymous live, MiB", "added_live_anon_mib", "{:.0f}"),
            Column("file-backed, MiB", "added_file_mib", "{:.0f}"),
        ),
        scaling_plot.STORE_MODES[1],
        note="Added memory = served - baseline. Fresh processes load the model and encode the queries; then the "
        "served one opens the index (`mapped`: `GalleryIndex.load`'s default, the store's pages file-backed; "
        "`read`: into memory) and answers them at batch 1, the baseline does not. Each counts its growth from "
        "that point: the resident set at its peak, and at the end its anonymous part (before and after the "
        "allocator's freed heap is handed back: `live`) and its file-backed part. The indexes are the `ivf` "
        "preset over `bench_search.py`'s generator.",
        more=[
            (
                f"benchmarks/results/{memory_model.MILLION_FILE}",
                "python benchmarks/bench_serving.py --generate 1000000:fp16 1000000:int8 --load mapped",
            )
        ],
    ),
    Figure(
        "milvus",
        "benchmarks/results/milvus_lite_cpu.json",
        (
            Column("gallery crops", "size", "{:,}"),
            Column("backend", "backend", align="---"),
            Column("index", "index", align="---"),
            Column("inserted rows / CPU s", "insert_rows_per_s", "{:.0f}"),
            Column("flush CPU s", "flush_s"),
            Column("recall@10", "recall", "{:.3f}"),
            Column("CPU ms / query", "ms_per_query_b1", "{:.1f}"),
            Column("/ embedded ivf", "vs_embedded", "{:.1f}x"),
        ),
        "python benchmarks/bench_milvus.py --threads 1 --clock cpu",
        rows=milvus_rows,
        note="One thread, process CPU time (Milvus Lite's in-process server included), batch-1 queries; recall "
        "against exact TAG-PR Eq. 14 search. `/ embedded ivf`: the query time against the embedded `ivf` preset's in the "
        "same run (the preset's own latency per size is the [search figure](search.md#approximate-search-for-"
        "large-galleries)).",
        more=[
            (
                "benchmarks/results/milvus_lite_cpu_100k.json",
                "python benchmarks/bench_milvus.py --size 100000 --queries 100 --timed 30 --threads 1 --clock cpu",
            )
        ],
    ),
    Figure(
        "index",
        "benchmarks/results/index_cpu.json",
        (
            Column("images", "images"),
            Column("batch", "batch"),
            Column("workers", "workers"),
            Column("bare forward img/s", "forward_img_s", "{:.2f}"),
            Column("`tagclip index` img/s", "index_img_s", "{:.2f}"),
            Column("index / forward", "ratio", RATIO),
            Column("per round", "ratios", align="---"),
        ),
        "python benchmarks/bench_index.py --threads 1",
        note="Process CPU time, one thread; the ratio is the median of the interleaved rounds' ratios.",
    ),
    Figure(
        "add-ann",
        "benchmarks/results/add_ann_cpu.json",
        (
            Column("start crops", "size", "{:,}"),
            Column("adds", "adds", "{:,}"),
            Column("crops per add", "add_rows", "{:,}"),
            Column("retrains", "retrains"),
            Column("recalibrations", "recalibrations"),
            Column("lists grown / fresh", "lists", align="---"),
            Column("recall@10 fresh", "recall_fresh", "{:.3f}"),
            Column("recall@10 grown", "recall_grown", "{:.3f}"),
            Column("equal recall", "equal_recall"),
            Column("fresh ms / query", "ms_fresh", "{:.2f}"),
            Column("grown ms / query", "ms_grown", "{:.2f}"),
            Column("grown / fresh", "grown_vs_fresh", RATIO),
            Column("add CPU ms / crop", "add_ms_per_row", "{:.2f}"),
            Column("retrain + recalibration CPU s", "growth_cpu_s", "{:.1f}"),
            Column("slowest add CPU s", "add_max_s", "{:.1f}"),
            Column("build at once CPU s", "fresh_build_cpu_s", "{:.1f}"),
        ),
        "python benchmarks/bench_add.py --ann-size 10000 --adds 1000 --add-fraction 0.01 "
        "--output benchmarks/results/add_ann_cpu.json",
        rows=lambda data: [
            {**row, "lists": f"{row['lists_grown']} / {row['lists_fresh']}"} for row in data["rows"]
        ],
        note=lambda data: (
            "An `ivf` gallery grown by many `--add`s against one built at once from the same crops "
            f"(equal recall: recall@10 within {data['equal_recall_within']}). One thread; CPU time per query at batch 1, "
            "in interleaved rounds; the add cost includes the adds that retrained or recalibrated."
        ),
    ),
    Figure(
        "eval",
        "benchmarks/results/eval_cpu.json",
        (
            Column("measure", "measure", align="---"),
            Column("gallery images", "gallery", "{:,}"),
            Column("captions", "captions", "{:,}"),
            Column("CPU s", "new_cpu_s", "{:.1f}"),
            Column("peak MiB beyond the embeddings", "peak_beyond_embeddings_mib", "{:.0f}"),
        ),
        "python benchmarks/bench_eval.py --threads 1 --compare-sizes 10000x20000 --memory-sizes 100000x2000",
    ),
    Figure(
        "suite-times",
        "benchmarks/results/suite_times.json",
        (
            Column("tests", "tier", align="---"),
            Column("command", "command", "`{}`", align="---"),
            Column("tests run", "tests"),
            Column("wall time", "wall_s", "{:.0f} s"),
            Column("pytest exit status", "exit_status"),
        ),
        "python benchmarks/time_suite.py",
    ),
    Figure(
        "mainjob",
        "benchmarks/results/mainjob_seeds.json",
        (
            Column("seed", "seed"),
            Column("test R@1", "R@1", "{:.2f}"),
            Column("R@5", "R@5", "{:.2f}"),
            Column("R@10", "R@10", "{:.2f}"),
            Column("mAP", "mAP", "{:.2f}"),
            Column("mINP", "mINP", "{:.2f}"),
            Column("torch threads", "threads"),
            Column("wall time", "wall_s", "{:.0f} s"),
            Column("CPU time", "cpu_s", "{:.0f} s"),
        ),
        "python benchmarks/mainjob_seeds.py",
        note="CPU time is the job's processes' user + system time: on a machine shared with other work, wall "
        "time close to CPU time / threads means the job had the cores to itself.",
    ),
    Figure(
        "pretrain-scale",
        "benchmarks/results/pretrain_scale.json",
        (
            Column("initial scale", "scale", "{:.1f}"),
            Column("seed", "seed"),
            Column("first epoch under chance", "plateau_left_epoch"),
            Column("last-epoch loss", "final_loss", "{:.2f}"),
            Column("zero-shot test R@1", "zero_shot_R@1", "{:.2f}"),
        ),
        "python benchmarks/bench_pretrain_scale.py",
        note=lambda data: (
            f"The main job's pre-training phase alone ({data['epochs']} epochs, batch {data['batch_size']}; chance "
            f"loss ln {data['batch_size']} = {math.log(data['batch_size']):.2f}), at each initial similarity scale; "
            "an epoch is under chance when its mean loss is 0.1 below it (epochs count from 0). Zero-shot: the "
            "plain CLIP's global features, text to image, on the test split."
        ),
    ),
    Figure(
        "handler-limits",
        "benchmarks/results/handler_limits.json",
        (
            Column("request", "case", align="---"),
            Column("images", "images"),
            Column("pixels", "request_pixels", "{:,}"),
            Column("payload bytes", "payload_bytes", "{:,}"),
            Column("HTTP status", "status"),
            Column("peak memory rise, MiB", "peak_rss_rise_mib", "{:.0f}"),
            Column("CPU s", "cpu_s", CPU_S),
        ),
        "python benchmarks/bench_handler_limits.py",
        note="Image decoding of one endpoint request of 16 Mpx PNGs at the default limits (one torch thread).",
    ),
    Figure(
        "ingest-accuracy",
        "benchmarks/results/ingest_cpu.json",
        (
            Column("boxes", "mode", align="---"),
            Column("view", "view", align="---"),
            Column("recall", "recall"),
            Column("precision", "precision"),
            Column("IDF1", "idf1"),
            Column("MOTA", "mota"),
            Column("ID switches", "num_switches"),
        ),
        "python benchmarks/bench_ingest.py --trackers",
        rows=ingest_accuracy_rows,
        note=INGEST_NOTE,
    ),
    Figure(
        "ingest-throughput",
        "benchmarks/results/ingest_cpu.json",
        (
            Column("height", "height", "{}p"),
            Column("stage", "stage", align="---"),
            Column("frames", "frames"),
            Column("frames / s", "fps", "{:.1f}"),
            Column("CPU s", "cpu_s", "{:.2f}"),
            Column("share of the motion pipeline", "share", "{:.0%}"),
        ),
        "python benchmarks/bench_ingest.py --trackers",
        rows=lambda data: data["throughput"],
        note=lambda data: (
            f"One street camera scaled to 16:9 at each height and encoded with H.264, sampled at {data['fps']:g} "
            f"frames per second, on {data['threads']} torch threads; frames per second from wall time. Embed: "
            f"the crops of the finished tracks through the image tower ({data['embed_model']}). The RT-DETR row "
            "is a detector of RT-DETR-R18's size (ResNet-18 backbone, 640x640 input) with random weights, timed "
            "on the first frames only: a real detector's cost, not its boxes."
        ),
    ),
    Figure(
        "ingest-memory",
        "benchmarks/results/ingest_memory_cpu.json",
        (Column("stream minute", "minute"), Column("resident memory, MiB", "rss_mib", "{:.0f}")),
        "python benchmarks/bench_ingest_memory.py",
        rows=lambda data: [r for r in data["rows"] if r["minute"] % 5 == 0],
        note=lambda data: (
            f"The street camera looped for {data['minutes']} minutes of stream time at {data['fps']:g} frames per "
            f"second ({data['frames']:,} frames, {data['tracks_finished']:,} tracks finished and handed off) "
            "through the motion detector, the tracker and the crop keeper; the process's resident set size "
            "(it includes the imported libraries) every 5 minutes."
        ),
    ),
    Figure(
        "ingest-end-to-end",
        "benchmarks/results/ingest_e2e_cpu.json",
        (
            Column("seed", "seed"),
            Column("tracks", "tracks"),
            Column("identities", "identities"),
            Column("caption queries", "queries"),
            Column("text -> track R@1", "R@1", "{:.2f}"),
            Column("mAP", "mAP", "{:.2f}"),
            Column("test crops of these identities", "crops"),
            Column("text -> crop R@1", "crop_R@1", "{:.2f}"),
            Column("crop mAP", "crop_mAP", "{:.2f}"),
        ),
        "python benchmarks/bench_ingest.py --model outputs/tagclip-synthetic/best --no-accuracy --heights "
        "--output benchmarks/results/ingest_e2e_cpu.json",
        rows=lambda data: data["end_to_end"]["per_seed"],
        note=lambda data: (
            "Each caption of each identity the footage shows ranks every kept track of that seed's footage (motion "
            "detector, 3 crops a track, a track scored by its best crop); the same captions rank the crop set's "
            "test crops of the same identities in the last three columns"
            + (
                f" (mean R@1: {data['end_to_end']['R@1']:.2f} over tracks, {data['end_to_end']['crop_R@1']:.2f} over "
                "crops). "
                if "crop_R@1" in data["end_to_end"]
                else ". "
            )
            + _crop_level(data["end_to_end"].get("crop_level"))
        ),
    ),
    Figure(
        "cli-startup",
        "benchmarks/results/cli_startup.json",
        (
            Column("command", "command", align="---"),
            Column("CPU s", "cpu_s", CPU_S),
            Column("wall s", "wall_s", CPU_S),
            Column("exit status", "exit_status"),
            Column("torch / transformers imported", "heavy_imports", align="---"),
        ),
        "python benchmarks/bench_cli_startup.py",
        note=lambda data: (
            f"Each command is a fresh process (`python -m modeling_tagclip.cli`, what `tagclip` runs), median of "
            f"{data['repeats']}; CPU is user + system time. The parsers live in modules that import neither torch "
            "nor transformers, so help and argument errors come before the model code is imported."
        ),
    ),
    *_ablation("table4"),
    *_ablation("table5"),
    *_ablation("init"),
]

FIGURES: dict[str, Figure | Picture] = {figure.name: figure for figure in FIGURES_LIST}


def _sources(name: str) -> list[tuple[str, str]]:
    figure = FIGURES[name]
    return [(figure.path, figure.command), *figure.more]


def _draw_scaling(root):
    """Latency and memory against N: the search, Milvus and serving figures' files, the faiss baselines."""
    found = scaling_plot.collect(_sources("search"), _sources("milvus"), _sources("serving"), root)
    return scaling_plot.svg(found), scaling_plot.markdown(found, "images/scaling.svg")


FIGURES["scaling"] = Picture("scaling", "docs/images/scaling.svg", _draw_scaling)
