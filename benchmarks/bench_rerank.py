"""k-reciprocal re-ranking on aerial-ground re-ID sets in CARGO's layout: mAP and R@1 of each protocol with and
without re-ranking, per set and trained ViSA model (one per seed), and what re-ranking costs.

    accelerate launch training/train.py --task reid --seed S --output runs/visa-sS   # for S in 0 1 2
    python benchmarks/bench_rerank.py --models runs/visa-s0/best runs/visa-s1/best runs/visa-s2/best

Sets (``--data``, default both): ``data/synthetic_reid`` (the set the models train on; its test identities),
and ``data/footage_reid``, person crops cut at the ground-truth boxes of the synthetic footage
(``modeling_tagclip.data.footage_reid``; rendered there from footage seed ``--footage-seed`` when absent). The
real CARGO runs with ``--data path/to/CARGO``. Each model encodes each set once; the plain ranking and the
re-ranked one (``tagclip eval --task reid --rerank``, k1 20, k2 6, lambda 0.3 unless given) use the same
features. Rows: one per set and protocol, mean ± 95% Student-t half-width over the models; ``rerank_s`` is the
re-ranking's CPU time for every protocol of one model on one set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, add_allow_dirty, check_publishable, write_json  # noqa: E402

SYNTHETIC_SET, FOOTAGE_SET = "data/synthetic_reid", "data/footage_reid"
PROTOCOLS = ("ALL", "A<->G", "G->A", "G<->G", "A<->A")


def describe(path: Path) -> dict[str, Any]:
    """A set's description for the results file: how it was made (its ``dataset_info.json``) in words."""
    info_path = path / "dataset_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    generator = (info or {}).get("generator", "")
    if generator.endswith("data.synthetic_reid"):
        p = info["parameters"]
        text = (
            f"people rendered by modeling_tagclip.data.synthetic_reid (seed {p['seed']}, {p['num_identities']} "
            f"identities), each image on its own camera; the ViSA models train on its train identities"
        )
    elif generator.endswith("data.footage_reid"):
        f = info["footage"]
        text = (
            f"crops cut at the ground-truth boxes of the synthetic footage (seed {f['seed']}: "
            f"{f['aerial_cameras']} drones, {f['ground_cameras']} street cameras, {f['people']} people, "
            f"{f['people_per_camera']} a camera), {info['parameters']['crops_per_camera']} a person and camera"
        )
    else:
        text = f"the CARGO-layout folder {path.name}"
    return {"path": str(path), "description": text, "info": info}


def ensure_set(path: Path, footage_seed: int) -> Path:
    """``path`` if it exists; the default footage set is rendered there when absent."""
    if path.is_dir():
        return path
    if path != Path(FOOTAGE_SET):
        raise SystemExit(f"bench_rerank: error: --data {path}: no such folder")
    from modeling_tagclip.data.footage_reid import render_footage_reid

    print(f"rendering the footage re-ID set into {path} (footage seed {footage_seed})")
    render_footage_reid(path, seed=footage_seed)
    return path


def measure(model: Any, model_path: str, data: Any, config: Any) -> dict[str, Any]:
    """One model on one set: features once, then every protocol plain and re-ranked (metrics and CPU time)."""
    from modeling_tagclip.evaluation.reid import encode
    from modeling_tagclip.metrics.reid import evaluate_protocols

    query, gallery = encode(model, data.query), encode(model, data.gallery)
    protocols = {name: data.protocols[name] for name in PROTOCOLS}
    plain = evaluate_protocols(query, gallery, data.query, data.gallery, protocols)
    start = time.process_time()
    reranked = evaluate_protocols(query, gallery, data.query, data.gallery, protocols, rerank=config)
    return {
        "model": model_path,
        "plain": plain,
        "reranked": reranked,
        "rerank_s": time.process_time() - start,
        "query": len(data.query),
        "gallery": len(data.gallery),
    }


def summary_rows(runs: list[dict[str, Any]], name: str | None = None) -> list[dict[str, Any]]:
    """One row per protocol (of set ``name``): mean ± 95% CI over the models of mAP and R@1, plain and re-ranked."""
    from modeling_tagclip.ablation import mean_ci

    def cell(values: list[float]) -> str:
        stats = mean_ci(values)
        return f"{stats['mean']:.2f}" if stats["n"] == 1 else f"{stats['mean']:.2f} ± {stats['ci95']:.2f}"

    rows = []
    for protocol in PROTOCOLS:
        row: dict[str, Any] = {} if name is None else {"set": name}
        row.update({"protocol": protocol, "models": len(runs)})
        for kind in ("plain", "reranked"):
            for metric in ("mAP", "R1"):
                row[f"{metric}_{kind}"] = cell([run[kind][protocol][metric] for run in runs])
        row["mAP_gain"] = cell(
            [run["reranked"][protocol]["mAP"] - run["plain"][protocol]["mAP"] for run in runs]
        )
        rows.append(row)
    return rows


def set_names(paths: list[Path]) -> list[str]:
    """Each set's name: its folder's name (two sets of one name are an error)."""
    names = [path.name for path in paths]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SystemExit(
            f"bench_rerank: error: --data: two sets named {repeated[0]!r} (folder names must differ)"
        )
    return names


def run(paths: list[Path], models: list[str], config: Any) -> dict[str, Any]:
    """Every model on every set: the results file's payload (without the machine record)."""
    from modeling_tagclip.data.reid import load_reid_dataset
    from modeling_tagclip.evaluation.reid import load_visa

    named = dict(zip(set_names(paths), paths, strict=True))
    sets = {name: load_reid_dataset(str(path)) for name, path in named.items()}
    runs = []
    for model_path in models:
        model = load_visa(model_path, "cpu")
        runs += [{"set": name, **measure(model, model_path, data, config)} for name, data in sets.items()]
    return {
        "benchmark": "rerank",
        "rows": [row for name in named for row in summary_rows([r for r in runs if r["set"] == name], name)],
        "runs": runs,
        "sets": {name: describe(path) for name, path in named.items()},
        "rerank": {"k1": config.k1, "k2": config.k2, "lambda_value": config.lambda_value},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from modeling_tagclip.metrics.rerank import RerankConfig

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", required=True, help="saved ViSA folders, one per seed")
    parser.add_argument(
        "--data",
        nargs="+",
        type=Path,
        default=[Path(SYNTHETIC_SET), Path(FOOTAGE_SET)],
        help="CARGO-layout re-ID sets (default: %(default)s)",
    )
    parser.add_argument("--footage-seed", type=int, default=0, help="footage seed of a rendered footage set")
    parser.add_argument("--k1", type=int, default=RerankConfig.k1)
    parser.add_argument("--k2", type=int, default=RerankConfig.k2)
    parser.add_argument("--lambda-value", type=float, default=RerankConfig.lambda_value)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "rerank_cpu.json")
    add_allow_dirty(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from modeling_tagclip.metrics.rerank import RerankConfig

    args = parse_args(argv)
    check_publishable(args.output)
    paths = [ensure_set(path, args.footage_seed) for path in args.data]
    payload = run(paths, args.models, RerankConfig(args.k1, args.k2, args.lambda_value))
    print(f"wrote {write_json(args.output, payload)}")
    for row in payload["rows"]:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
