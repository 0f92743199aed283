"""The TAG-CLIP family on the Hub: the model with its retrieval pipeline, ``eval_results.json``, LoRA adapters,
the Inference Endpoints handler, ablation tables and the text-to-image retrieval card."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeling_tagclip.hub.examples import DEFAULT_QUERY, stage_examples
from modeling_tagclip.hub.run_files import EVAL_FILE, read_mapping, results_path, run_folders

if TYPE_CHECKING:
    from modeling_tagclip.hub.family import StageOptions

CARDS_DIR = Path(__file__).resolve().parent / "cards"  # shipped with the package (hub_cards/ links here)
TEMPLATE = CARDS_DIR / "tagclip_card.md"
HANDLER_FILE = Path(__file__).resolve().parents[1] / "retrieval" / "handler.py"
TAGS = [
    "custom_code",
    "person-retrieval",
    "text-to-image-retrieval",
    "aerial-ground",
    "mixture-of-experts",
    "clip",
    "tag-clip",
]
METRICS = (("R@1", "recall@1"), ("R@5", "recall@5"), ("R@10", "recall@10"), ("mAP", "map"), ("mINP", "minp"))
CANDIDATE_LABELS = ["a person in red clothes", "a person in black clothes", "a person with a backpack"]
ABLATION_STUDIES = ("table4", "table5", "init")


def load_eval_results(checkpoint: Path, explicit: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(results, file name) of the run's ``eval_results.json`` (explicit path, checkpoint folder or the run
    folder above it), checked for the metrics."""
    path = results_path(checkpoint, [EVAL_FILE], explicit)
    if path is None:
        return None
    results = read_mapping(path)
    missing = [key for key, _ in METRICS if not isinstance(results.get(key), (int, float))]
    if missing:
        raise ValueError(f"{path} lacks the metrics {missing} (expected keys R@1, R@5, R@10, mAP, mINP)")
    return results, path.name


def architecture_summary(config) -> dict[str, str]:
    """A few headline settings of a TagClipConfig for the card."""
    vision, text = config.vision_config, config.text_config
    size = vision.image_size if isinstance(vision.image_size, (list, tuple)) else [vision.image_size] * 2
    return {
        "image tower": f"ViT, {vision.num_hidden_layers} blocks, width {vision.hidden_size}, patch {vision.patch_size}",
        "input size (H x W)": f"{size[0]} x {size[1]}",
        "HR-MoE blocks": ", ".join(map(str, getattr(vision, "active_moe_layers", []) or [])) or "none",
        "text tower": f"{text.num_hidden_layers} blocks, width {text.hidden_size}, context {text.max_position_embeddings}",
        "embedding": f"{config.projection_dim}-d global + {config.tse_embed_dim}-d TSE (TAG-PR Eq. 14)",
        "routing": str(getattr(vision, "routing", "")),
    }


def _adapter_dirs(folder: Path) -> list[Path]:
    return [f for f in sorted(folder.iterdir()) if f.is_dir() and (f / "adapter_config.json").is_file()]


def discover_adapters(checkpoint: Path, explicit: Sequence[str] = ()) -> list[Path]:
    """LoRA adapter folders: the given ones, the checkpoint itself if it is one, and those in the checkpoint
    folder and the run folder (any folder holding adapter_config.json)."""
    found = [Path(p) for p in explicit]
    for folder in found:
        if not (folder / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a LoRA adapter folder (no adapter_config.json)")
    if (checkpoint / "adapter_config.json").is_file():
        found.append(checkpoint)
    for folder in run_folders(checkpoint):
        found += _adapter_dirs(folder)
    return list(dict.fromkeys(p.resolve() for p in found))


def stage_ablations(folder: str | Path | None, out: Path) -> list[dict[str, str]]:
    """The ablation harness's tables (``STUDY.md``) and plots from ``folder`` (``tagclip ablate --output``).

    Plots are copied to ``out/ablation``; returns ``[{"table": markdown, "plot": repo path or ""}]`` in study order.
    """
    if folder is None:
        return []
    folder = Path(folder)
    found = [name for name in ABLATION_STUDIES if (folder / f"{name}.md").is_file()]
    if not found:
        raise FileNotFoundError(
            f"--ablation {folder}: no table4.md, table5.md or init.md (run tagclip ablate)"
        )
    studies = []
    for name in found:
        plot = ""
        if (folder / f"{name}.png").is_file():
            (out / "ablation").mkdir(exist_ok=True)
            shutil.copy2(folder / f"{name}.png", out / "ablation" / f"{name}.png")
            plot = f"ablation/{name}.png"
        table = (folder / f"{name}.md").read_text().replace("### ", "### Ablation — ", 1)
        studies.append({"table": table.strip(), "plot": plot})
    return studies


def _load_checkpoint(checkpoint: Path):
    from modeling_tagclip.evaluation.text_retrieval import load_model

    if not (checkpoint / "config.json").is_file() and not (checkpoint / "adapter_config.json").is_file():
        adapters = _adapter_dirs(checkpoint) if checkpoint.is_dir() else []
        if len(adapters) != 1:
            raise FileNotFoundError(f"{checkpoint} is not a saved TAG-CLIP folder (no config.json)")
        checkpoint = adapters[0]  # a LoRA-only run: best/adapter, merged onto its base for the root model
    return load_model(checkpoint, "cpu")


def _eval_result_entries(results: dict, facts: dict) -> list:
    from huggingface_hub import EvalResult

    return [
        EvalResult(
            task_type="text-to-image-retrieval",
            task_name="Text-based aerial-ground person retrieval",
            dataset_type=facts["dataset_type"],
            dataset_name=facts["dataset_name"],
            dataset_split=facts["dataset_split"],
            metric_type=metric_type,
            metric_name=key,
            metric_value=round(float(results[key]), 2),
        )
        for key, metric_type in METRICS
    ]


def _view_probe_text(results: dict) -> str | None:
    probe = results.get("view_probe")
    if not isinstance(probe, dict) or "accuracy" not in probe:
        return None
    base = probe.get("majority_baseline")
    suffix = f" (majority baseline {base:.1f}%)" if isinstance(base, (int, float)) else ""
    return f"{probe['accuracy']:.1f}% accuracy{suffix}"


def _widget(repo_id: str, files: Sequence[str], views: Sequence[str]) -> list[dict[str, str]]:
    """The Hub widget's zero-shot examples: the staged crops with the candidate labels."""
    import huggingface_hub

    endpoint = huggingface_hub.constants.ENDPOINT.rstrip("/")
    return [
        {
            "src": f"{endpoint}/{repo_id}/resolve/main/{name}",
            "candidate_labels": ", ".join(CANDIDATE_LABELS),
            "example_title": f"{view.capitalize()} view",
        }
        for name, view in zip(files, views, strict=True)
    ]


class TagClipHub:
    """TAG-CLIP's adapter to the generic Hub path (see ``hub/family.py``)."""

    template = TEMPLATE
    results_file = EVAL_FILE
    synthetic_type = "synthetic-aerial-ground-persons"

    def save_model(self, checkpoint: Path, out: Path) -> tuple[Any, tuple[int, int]]:
        from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline

        model, processor = _load_checkpoint(checkpoint)
        save_with_pipeline(model, processor, out)
        return model.config, tuple(processor.image_processor.size[k] for k in ("height", "width"))

    def load_results(self, checkpoint: Path, explicit: str | None) -> tuple[dict[str, Any], str] | None:
        return load_eval_results(checkpoint, explicit)

    def stage_files(
        self, checkpoint: Path, out: Path, results: dict | None, size: tuple[int, int], options: StageOptions
    ) -> dict[str, Any]:
        ablations = stage_ablations(options.ablation, out)
        adapters = []
        for adapter in discover_adapters(checkpoint, options.adapters):
            shutil.copytree(adapter, out / "adapters" / adapter.name, dirs_exist_ok=True)
            adapters.append(f"adapters/{adapter.name}")
        examples = stage_examples(out, size, results)
        if options.with_handler and HANDLER_FILE.is_file():
            shutil.copy2(HANDLER_FILE, out / "handler.py")
        return {"examples": examples, "adapters": adapters, "ablations": ablations}

    def card(
        self,
        config: Any,
        repo_id: str,
        results: dict | None,
        facts: dict[str, Any],
        examples: tuple[list[str], list[str], str] | None = None,
        adapters: Sequence[str] = (),
        ablations: Sequence[dict[str, str]] = (),
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        files, views, query = examples or ([], [], DEFAULT_QUERY)
        metadata = {
            "pipeline_tag": "zero-shot-image-classification",
            "language": ["en"],
            "tags": TAGS,
            "eval_results": _eval_result_entries(results, facts) if results else None,
            "widget": _widget(repo_id, files, views) or None,
        }
        known = results or {}
        fields = {
            "results": results,
            "num_queries": known.get("num_queries"),
            "num_gallery": known.get("num_gallery"),
            "num_identities": known.get("num_identities"),
            "chance_r1": known.get("chance_R@1"),
            "match_view_breakdown": known.get("match_view_breakdown") or known.get("view_breakdown") or {},
            "view_probe": _view_probe_text(known),
            "example_files": json.dumps(files),
            "example_views": views,
            "example_query": query.replace('"', "'"),
            "candidate_labels": json.dumps(CANDIDATE_LABELS),
            "adapters": list(adapters),
            "architecture": architecture_summary(config),
            "ablations": list(ablations),
        }
        return metadata, fields
