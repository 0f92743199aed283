"""Run an ablation study (paper Table 4, Table 5, or the initialisation study) over seeds; tabulate and plot.

    tagclip ablate --study table4 --seeds 3                # embedded synthetic set, CPU
    tagclip ablate --study table5 --seeds 3 --data DIR     # your {split}_reid.json dataset
    tagclip ablate --study table4 --launch "accelerate launch --num_processes 4 -m modeling_tagclip.cli"
    CUDA_VISIBLE_DEVICES=1 tagclip ablate --study table4 --shard 1/4   # one GPU per shard
    tagclip ablate --study table4 --report-only            # table + plot from finished runs

Each run (variant x seed) trains through ``tagclip train`` (``python -m modeling_tagclip.cli``, or the
``--launch`` prefix) into ``OUT/runs/STUDY/VARIANT/seedS/train`` and writes ``result.json`` there when done; a
run with a ``result.json`` is skipped, an interrupted one resumes from its last checkpoint. ``OUT/STUDY.md``,
``OUT/STUDY.json`` and ``OUT/STUDY.png`` hold the table (mean, std, 95% t-CI), the paper's orderings and the plot.

Table 5 keeps the identities that have both views (as the paper does), trains on their aerial images, their
ground images, or both (filtered annotation files under ``OUT/data``; images are read in place), and tests each
model on aerial, ground and mixed galleries of the test identities with both views. The init study trains a
plain transformers ``CLIPModel`` of the same size on the training split (``engine/clip_pretraining.py``), converts it
as ``tagclip convert hf-clip`` does and fine-tunes it (``init_from``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.ablation import (
    ALL,
    STUDIES,
    VIEW_NAMES,
    Study,
    Variant,
    markdown_table,
    orderings,
    plot_summary,
    summarize,
)
from modeling_tagclip.atomic_io import atomic_write
from modeling_tagclip.flags import positive_int, usage_error

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds modeling_tagclip/
DEFAULT_CONFIG = "default"
# Per-run settings on top of the config (the main job's recipe): every run takes the same number of optimiser
# steps (Table 5's single-view runs have half the images: equal epochs would also halve their training), about
# 40% of the main job's, so that Table 4 + Table 5 (11 variants x 3 seeds = 33 runs) fit about 2 hours on a
# 2-core CPU; a checkpoint every epoch (resume).
RUN_SETTINGS = {  # the variants start from scratch with a trainable patch embedding (the init study sets its own)
    "pretrain_clip.epochs": 0,
    "freeze_patch_embedding": False,
    "max_steps": 600,
    "save_steps": 0,
    "save_total_limit": 1,
    "plots": False,
    "validation_fraction": 0.1,  # every run is selected on a validation split (the main job keeps its last epoch)
    "model_selection": "validation",
    "synthetic": None,
}
# The embedded set the studies render when no --data is given: the set their published tables were measured on
# (the main job renders a larger one)
STUDY_SYNTHETIC = {"num_identities": 260, "seed": 0, "image_size": (128, 64)}
DEFAULT_LAUNCH = "python -m modeling_tagclip.cli"


class AblationError(ValueError):
    """Bad study input (data layout, options)."""


# ----------------------------------------------------------------------------------------------- files
def _write_text(path: Path, text: str) -> None:
    """Write atomically (a crash never leaves a half-written file; shards may write the same report)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _read_records(data: Path, split: str) -> list[dict[str, Any]]:
    """Records of ``DATA/{split}_reid.json`` (the TAG-PEDES / synthetic layout)."""
    path = data / f"{split}_reid.json"
    if not path.is_file():
        raise AblationError(f"{path} not found: view-filtered studies need the {{split}}_reid.json layout")
    records = json.loads(path.read_text())
    if any(r.get("cam_id") not in (0, 1) for r in records):
        raise AblationError(f"{path}: every record needs cam_id 0 (aerial) or 1 (ground) for a view study")
    return records


def _multi_view(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of the identities that have images of both views."""
    views: dict[Any, set[int]] = {}
    for r in records:
        views.setdefault(r["id"], set()).add(r["cam_id"])
    return [r for r in records if len(views[r["id"]]) == 2]


def _of_view(records: list[dict[str, Any]], view: str) -> list[dict[str, Any]]:
    return records if view == ALL else [r for r in records if r["cam_id"] == VIEW_NAMES.index(view)]


def view_data(data: Path, out: Path, study: Study, variant: Variant) -> Path:
    """Filtered annotation folder of one Table 5 variant: train on ``variant.train_view``, test galleries."""
    folder = out / "data" / study.name / variant.name
    if (folder / "done").is_file():
        return folder
    train = _multi_view(_read_records(data, "train"))
    test = _multi_view(_read_records(data, "test"))
    if not train or not test:
        raise AblationError(f"{data}: Table 5 needs identities with both views in train and test")
    _write_json(folder / "train_reid.json", _of_view(train, variant.train_view))
    for gallery in study.galleries:
        _write_json(folder / _gallery_split(gallery), _of_view(test, gallery))
    (folder / "done").write_text("")
    return folder


def _gallery_split(gallery: str) -> str:
    """Annotation file name of a test gallery (the mixed one is the training run's own ``test`` split)."""
    return "test_reid.json" if gallery == ALL else f"test_{gallery}_reid.json"


# ----------------------------------------------------------------------------------------------- runs
class Runner:
    """Trains and evaluates the runs of one study."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.study = STUDIES[args.study]
        self.out = Path(args.out).resolve()
        self.data = Path(args.data).resolve() if args.data else self.out / "data" / "synthetic"
        image_dir = Path(args.image_dir).resolve() if args.image_dir else self.data / "images"
        # None: the data loader finds the images itself (raw dataset layouts)
        self.image_dir = image_dir if args.image_dir or not args.data or image_dir.is_dir() else None
        self.launch = shlex.split(args.launch)
        if self.launch[:1] == ["python"]:
            self.launch[0] = sys.executable

    def run_dir(self, variant: Variant, seed: int) -> Path:
        return self.out / "runs" / self.study.name / variant.name / f"seed{seed}"

    def runs(self) -> list[tuple[Variant, int]]:
        """(variant, seed) pairs of this shard, in study order."""
        names = self.args.variants or self.study.variant_names
        pairs = [(self.study.variant(n), s) for s in range(self.args.seeds) for n in names]
        index, count = self.args.shard
        return [p for i, p in enumerate(pairs) if i % count == index]

    def prepare(self) -> None:
        """Render the embedded set when no ``--data`` is given (deterministic; skipped when present)."""
        from modeling_tagclip.data.synthetic import generate_dataset, stale_render

        if self.args.data or (self.data / "test_reid.json").is_file():
            stale = None if self.args.data else stale_render(self.data, self.args.synthetic)
            if stale:
                raise AblationError(f"{stale}; delete the folder to re-render it")
            return

        tmp = self.data.with_name(f"{self.data.name}.{os.getpid()}.partial")
        generate_dataset(tmp, **self.args.synthetic, progress=False)
        try:
            os.replace(tmp, self.data)
        except OSError:  # another shard finished rendering first (same bytes: deterministic)
            shutil.rmtree(tmp)

    def _train_argv(self, variant: Variant, seed: int, data: Path, out: Path) -> list[str]:
        from modeling_tagclip.engine.config import recipe_path

        argv = [
            "--config",
            str(recipe_path(self.args.config).resolve()),
            "--output",
            str(out / "train"),
            "--data",
            str(data),
            "--seed",
            str(seed),
        ]
        if self.image_dir is not None:
            argv += ["--set", f"image_dir={self.image_dir}"]
        for key, value in {**RUN_SETTINGS, **variant.set, **dict(self.args.set)}.items():
            argv += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        if variant.pretrained_init:
            argv += ["--init-from", str(self.pretrained_clip())]
        if any((out / "train" / "checkpoints").glob("step_*")):
            argv += ["--resume-from-checkpoint", "latest"]
        return argv

    def pretrained_clip(self) -> Path:
        """The converted CLIP of the init study (trained and converted once, shared by all seeds)."""
        from modeling_tagclip.engine.clip_pretraining import pretrained_tagclip
        from modeling_tagclip.engine.config import load_config

        settings = {**RUN_SETTINGS, **dict(self.args.set)}
        cfg = load_config(self.args.config, {k: v for k, v in settings.items() if k != "synthetic"})
        out = self.out / "pretrained"
        return pretrained_tagclip(self.data, self.image_dir, out, cfg, epochs=int(cfg.num_train_epochs))

    def train(self, variant: Variant, seed: int, data: Path, out: Path) -> None:
        """Run the training entry point; its output goes to ``train.log``."""
        cmd = [*self.launch, "train", *self._train_argv(variant, seed, data, out)]
        env = {
            **os.environ,
            "TQDM_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "train.log", "a") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0 or not (out / "train" / "eval_results.json").is_file():
            tail = (out / "train.log").read_text()[-3000:]
            raise RuntimeError(f"run {out} failed (exit {proc.returncode}); end of train.log:\n{tail}")

    def evaluate(self, data: Path, out: Path) -> dict[str, dict[str, float]]:
        """Metrics per test gallery: the run's own test result, and the other galleries of the study."""
        from modeling_tagclip.evaluation.text_retrieval import evaluate_model, load_model

        own = json.loads((out / "train" / "eval_results.json").read_text())
        galleries = {ALL: own} if ALL in self.study.galleries else {}
        others = [g for g in self.study.galleries if g != ALL]
        if others:
            from modeling_tagclip.data.text_retrieval import load_dataset_split

            model, processor = load_model(out / "train" / "best")
            for gallery in others:
                ds = load_dataset_split(data / _gallery_split(gallery), "test", image_dir=self.image_dir)
                galleries[gallery] = evaluate_model(model, processor, ds, probe=False)
        keys = ("R@1", "R@5", "R@10", "mAP", "mINP", "chance_R@1")
        return {g: {k: float(r[k]) for k in keys if k in r} for g, r in galleries.items()}

    def run(self, variant: Variant, seed: int) -> dict[str, Any] | None:
        """Train + evaluate one run unless its ``result.json`` exists; returns the result (None if skipped)."""
        out = self.run_dir(variant, seed)
        if (out / "result.json").is_file():
            return None
        data = self.data
        if self.study.multi_view_ids_only:
            if self.image_dir is None:
                raise AblationError(f"{self.data}: no images/ folder; pass --image-dir for a view study")
            data = view_data(self.data, self.out, self.study, variant)
        reused = self.reuse(variant, seed)
        if reused is not None:
            _write_json(out / "result.json", reused)
            return reused
        start = time.time()
        if not (out / "train" / "eval_results.json").is_file():
            self.train(variant, seed, data, out)
        own = json.loads((out / "train" / "eval_results.json").read_text())
        result = {
            "study": self.study.name,
            "variant": variant.name,
            "seed": seed,
            "galleries": self.evaluate(data, out),
            "wall_time_s": round(time.time() - start, 1),
            "train_time_s": own.get("train_time_s"),
            "train_images": own.get("train_images"),
            "train_identities": own.get("train_identities"),
            "best_step": own.get("best_step"),
        }
        _write_json(out / "result.json", result)
        return result

    def reuse(self, variant: Variant, seed: int) -> dict[str, Any] | None:
        """The finished result of the identical run ``variant.same_as`` (same seed, data and overrides), if any."""
        if variant.same_as is None or self.args.set:
            return None
        path = self.out / "runs" / variant.same_as / f"seed{seed}" / "result.json"
        if not path.is_file():
            return None
        result = json.loads(path.read_text())
        if set(result["galleries"]) != set(self.study.galleries):
            return None
        return {**result, "study": self.study.name, "variant": variant.name, "reused_from": variant.same_as}


def collect(out: Path, study: Study) -> list[dict[str, Any]]:
    """Every finished run's result of ``study`` under ``out``."""
    files = sorted((out / "runs" / study.name).glob("*/seed*/result.json"))
    return [json.loads(p.read_text()) for p in files]


def report(out: Path, study: Study) -> dict[str, Any] | None:
    """Write ``STUDY.json``, ``STUDY.md`` and ``STUDY.png`` from the finished runs; returns the JSON."""
    results = [r for r in collect(out, study) if r["variant"] in study.variant_names]
    if not results:
        return None
    summary = summarize(study, results)
    wall = sum(float(r.get("wall_time_s") or 0.0) for r in results if "reused_from" not in r)
    payload = {
        "study": study.name,
        "title": study.title,
        "summary": summary,
        "orderings": orderings(study, summary),
        "runs": results,
        "wall_time_s": wall,
        "run_settings": {k: v for k, v in RUN_SETTINGS.items() if k != "synthetic"},
    }
    _write_json(out / f"{study.name}.json", payload)
    _write_text(out / f"{study.name}.md", markdown_table(study, summary, wall))
    plot_summary(study, summary, out / f"{study.name}.png")
    return payload


# ----------------------------------------------------------------------------------------------- CLI
def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard expects I/N, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def _key_value(text: str) -> tuple[str, Any]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip ablate``."""
    p.description = __doc__.split("\n")[0]
    p.add_argument("--study", required=True, choices=sorted(STUDIES), help="which study's variants to run")
    p.add_argument(
        "--seeds", type=positive_int, default=3, metavar="N", help="seeds 0..N-1 per variant (>= 2 for a CI)"
    )
    p.add_argument("--data", default=None, help="dataset folder ({split}_reid.json); default: embedded set")
    p.add_argument("--image-dir", default=None, help="image folder (default DATA/images)")
    p.add_argument(
        "--output",
        dest="out",
        metavar="DIR",
        default="outputs/ablation",
        help="results folder (runs, tables, plots)",
    )
    p.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="NAME|PATH",
        help="training recipe of every run: a shipped name or a YAML file (default: default)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        type=_key_value,
        metavar="KEY=VALUE",
        help="extra training config override for every run",
    )
    p.add_argument("--variants", nargs="+", default=None, help="only these variants")
    p.add_argument(
        "--launch",
        default=DEFAULT_LAUNCH,
        help="command prefix that runs tagclip (`train` and its flags follow)",
    )
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="run every N-th run from I")
    p.add_argument("--report-only", action="store_true", help="only write the table/plot of finished runs")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``tagclip ablate ARGV`` as ``run`` receives it, the variants checked and the study's synthetic set added."""
    from modeling_tagclip.cli import parse

    return _checked(parse("ablate", argv))


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with its ``--variants`` checked against the study and the study's synthetic set added."""
    for name in args.variants or ():
        try:
            STUDIES[args.study].variant(name)
        except ValueError as err:
            usage_error("tagclip ablate", str(err))
    args.synthetic = study_synthetic(args.config)
    return args


def study_synthetic(config: str | None) -> dict[str, Any]:
    """The embedded set a study renders: ``STUDY_SYNTHETIC`` for the default recipe, else the recipe's block."""
    from modeling_tagclip.engine.config import read_recipe

    if config in (None, "default"):
        return dict(STUDY_SYNTHETIC)
    synthetic = dict(read_recipe(config).get("synthetic") or STUDY_SYNTHETIC)
    if "image_size" in synthetic:
        synthetic["image_size"] = tuple(synthetic["image_size"])
    return synthetic


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """``tagclip ablate ARGV`` from Python; returns the report JSON."""
    return study(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """``tagclip ablate`` with its parsed flags; the exit status."""
    study(_checked(args))
    return 0


def study(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the study's unfinished runs of this shard, then write the report; returns the report JSON."""
    runner = Runner(args)
    if not args.report_only:
        runner.prepare()
        for variant, seed in runner.runs():
            result = runner.run(variant, seed)
            if result is None:
                print(f"[{args.study}] {variant.name} seed {seed}: done before, skipped", flush=True)
                continue
            r1 = {g: round(m["R@1"], 2) for g, m in result["galleries"].items()}
            print(
                f"[{args.study}] {variant.name} seed {seed}: R@1 {r1} ({result['wall_time_s']:.0f}s)",
                flush=True,
            )
            report(runner.out, runner.study)
    payload = report(runner.out, runner.study)
    if payload is not None:
        stem = runner.out / args.study
        print((runner.out / f"{args.study}.md").read_text())
        print(f"wrote {stem}.md (table), {stem}.json (runs and statistics) and {stem}.png (plot)")
    return payload
