"""Push a TAG-CLIP checkpoint to the Hugging Face Hub with its code, processor, model card and results.

Usage::

    tagclip push --checkpoint outputs/tagclip-synthetic/best --repo-id ORG/NAME [--private]
        [--eval-results FILE] [--training-config FILE] [--adapter DIR ...] [--stage-dir DIR] [--dry-run]

The checkpoint is loaded and re-saved with ``save_with_pipeline`` (safetensors weights, the modeling code with
``auto_map``, the ``text-to-person-retrieval`` pipeline in ``custom_pipelines``, processor files), so the
repository loads with ``trust_remote_code=True`` where this package is not installed. Next to it go the
rendered card (``hub_cards/tagclip_card.md``), ``eval_results.json`` and plots of the run (found in the
checkpoint folder or its parent), two example crops used by the card's snippet, LoRA adapter folders under
``adapters/NAME/`` and the Inference Endpoints ``handler.py``. ``--dry-run`` only stages the files.

A ViSA checkpoint (``"model_type": "visa"`` in its ``config.json``, as ``tagclip train --task reid`` saves it) is
recognised automatically: it is re-saved with its custom code (``AutoModel`` → ``ViSAModel``), the card is
rendered from ``hub_cards/visa_card.md`` with a ``model-index`` of every re-ID protocol (R1/R5/R10/mAP/mINP)
from ``reid_results.json`` (``tagclip eval --task reid --output FILE``, in the checkpoint folder,
the run folder above it, or given as ``--eval-results FILE``) or the run's ``eval_results.json``, and two
synthetic example crops go with it; no handler or adapters.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.flags import accept_both_spellings
from modeling_tagclip.tagclip.configuration_tagclip import AERIAL, GROUND, VIEW_NAMES

__all__ = ["main", "push_folder", "render_card", "render_visa_card", "stage_checkpoint"]

CARDS_DIR = Path(__file__).resolve().parent / "cards"  # shipped with the package (hub_cards/ links here)
DEFAULT_TEMPLATE = CARDS_DIR / "tagclip_card.md"
VISA_TEMPLATE = CARDS_DIR / "visa_card.md"
HANDLER_FILE = Path(__file__).resolve().parents[1] / "retrieval" / "handler.py"
TRANSFORMERS_RANGE = ">=5.20,<6"
TAGS = [
    "custom_code",
    "person-retrieval",
    "text-to-image-retrieval",
    "aerial-ground",
    "mixture-of-experts",
    "clip",
    "tag-clip",
]
EVAL_FILE = "eval_results.json"
VISA_TAGS = [
    "custom_code",
    "person-reidentification",
    "aerial-ground",
    "mixture-of-experts",
    "vision-transformer",
    "visa",
]
REID_RESULTS_FILE = "reid_results.json"  # evaluation.reid --output (its usual name); tagclip train --task reid writes EVAL_FILE
REID_METRICS = (
    ("R1", "recall@1"),
    ("R5", "recall@5"),
    ("R10", "recall@10"),
    ("mAP", "map"),
    ("mINP", "minp"),
)
RUN_CONFIG_NAMES = (
    "training_config.json",
    "train_config.json",
    "training_args.json",
    "run_config.json",
    "config.yaml",
    "train_config.yaml",
    "run_config.yaml",
    "config.json",
)
METRICS = (("R@1", "recall@1"), ("R@5", "recall@5"), ("R@10", "recall@10"), ("mAP", "map"), ("mINP", "minp"))
CANDIDATE_LABELS = ["a person in red clothes", "a person in black clothes", "a person with a backpack"]
DEFAULT_QUERY = "a young woman in a red jacket with a black backpack"


# ---------------------------------------------------------------------------------------------------------
# Run files next to the checkpoint
# ---------------------------------------------------------------------------------------------------------


RUN_MARKERS = (EVAL_FILE, "metrics.jsonl")


def run_folders(checkpoint: Path) -> list[Path]:
    """The checkpoint folder, plus the training run's OUTPUT_DIR above it (up to two levels, has run markers).

    ``train.py`` writes ``OUTPUT_DIR/best`` (LoRA: ``OUTPUT_DIR/best/adapter``) next to ``eval_results.json``,
    ``metrics.jsonl``, the run's ``config.json`` and the plots.
    """
    for parent in list(checkpoint.resolve().parents)[:2]:
        if any((parent / marker).is_file() for marker in RUN_MARKERS):
            return [checkpoint, parent]
    return [checkpoint]


def find_run_file(checkpoint: Path, names: Sequence[str]) -> Path | None:
    """The first of ``names`` in the checkpoint folder, else in the run folder above it.

    A ``config.json`` counts only in the run folder: in the checkpoint it is the model's config.
    """
    for folder in run_folders(checkpoint):
        for name in names:
            if (folder / name).is_file() and not (name == "config.json" and folder == checkpoint):
                return folder / name
    return None


def _read_mapping(path: Path) -> dict[str, Any]:
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(path.read_text())
    else:
        data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping")
    return data


def load_eval_results(checkpoint: Path, explicit: str | None = None) -> dict[str, Any] | None:
    """``eval_results.json`` of the run (explicit path, checkpoint folder or its parent), checked for the metrics."""
    path = Path(explicit) if explicit else find_run_file(checkpoint, [EVAL_FILE])
    if path is None:
        return None
    results = _read_mapping(path)
    missing = [key for key, _ in METRICS if not isinstance(results.get(key), (int, float))]
    if missing:
        raise ValueError(f"{path} lacks the metrics {missing} (expected keys R@1, R@5, R@10, mAP, mINP)")
    return results


def load_training_config(checkpoint: Path, explicit: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(flattened scalar settings, file name) of the run's training configuration, if one is found."""
    path = Path(explicit) if explicit else find_run_file(checkpoint, RUN_CONFIG_NAMES)
    if path is None:
        return None
    return flatten(_read_mapping(path)), path.name


def flatten(data: dict[str, Any], prefix: str = "", limit: int = 60) -> dict[str, str]:
    """Scalar and short-list settings as ``a.b`` → text, at most ``limit`` rows."""
    rows: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.update(flatten(value, f"{name}.", limit))
        elif isinstance(value, (list, tuple)) and len(value) > 8:
            rows[name] = f"[{len(value)} items]"
        elif value is not None:
            rows[name] = str(value).replace("|", "\\|").replace("\n", " ")
    return dict(list(rows.items())[:limit])


def architecture_summary(config) -> dict[str, str]:
    """A few headline settings of a TagClipConfig for the card."""
    vision, text = config.vision_config, config.text_config
    size = vision.image_size if isinstance(vision.image_size, (list, tuple)) else [vision.image_size] * 2
    return {
        "image tower": f"ViT, {vision.num_hidden_layers} blocks, width {vision.hidden_size}, patch {vision.patch_size}",
        "input size (H x W)": f"{size[0]} x {size[1]}",
        "HR-MoE blocks": ", ".join(map(str, getattr(vision, "active_moe_layers", []) or [])) or "none",
        "text tower": f"{text.num_hidden_layers} blocks, width {text.hidden_size}, context {text.max_position_embeddings}",
        "embedding": f"{config.projection_dim}-d global + {config.tse_embed_dim}-d TSE (Eq. 14)",
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


def discover_plots(checkpoint: Path) -> list[Path]:
    """PNG plots of the run (checkpoint folder and the run folder above it)."""
    return [p for folder in run_folders(checkpoint) for p in sorted(folder.glob("*.png"))]


def _stage_plots(checkpoint: Path, out: Path) -> list[str]:
    """Copy the run's plots into ``out/plots``; returns their repo paths."""
    names = []
    for plot in discover_plots(checkpoint):
        (out / "plots").mkdir(exist_ok=True)
        shutil.copy2(plot, out / "plots" / plot.name)
        names.append(f"plots/{plot.name}")
    return names


ABLATION_STUDIES = ("table4", "table5", "init")


def _stage_ablations(folder: str | Path | None, out: Path) -> list[dict[str, str]]:
    """The ablation harness's tables (``STUDY.md``) and plots from ``folder`` (``tagclip ablate --out``).

    Plots are copied to ``out/ablation``; returns ``[{"table": markdown, "plot": repo path or ""}]`` in study order.
    """
    if folder is None:
        return []
    folder = Path(folder)
    found = [name for name in ABLATION_STUDIES if (folder / f"{name}.md").is_file()]
    if not found:
        raise FileNotFoundError(f"--ablation {folder}: no table4.md, table5.md or init.md (run tagclip ablate)")
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


# ---------------------------------------------------------------------------------------------------------
# Example crops for the card's snippet
# ---------------------------------------------------------------------------------------------------------


def _dataset_examples(data_dir: Path, split: str) -> list[tuple[Path, str, str]]:
    """(image, view, caption) of the first aerial and the first ground image of a TAG-PEDES-style split."""
    records = json.loads((data_dir / f"{split}_reid.json").read_text())
    picked: dict[int, tuple[Path, str, str]] = {}
    for record in records:
        view = int(record.get("cam_id", 1))
        image = data_dir / "images" / record["file_path"]
        if view in (AERIAL, GROUND) and view not in picked and image.is_file():
            picked[view] = (image, VIEW_NAMES[view], record["captions"][0])
    return [picked[v] for v in sorted(picked)]


def _rendered_examples(out: Path, size: tuple[int, int]) -> list[tuple[Path, str, str]]:
    """Two synthetic crops (aerial, ground) of one identity drawn by modeling_tagclip.data.synthetic."""
    import numpy as np

    from modeling_tagclip.data.synthetic import make_captions, render_person, sample_identity

    rng = np.random.default_rng(7)
    attrs = sample_identity(rng)
    caption = make_captions(attrs, rng)[0]
    examples = []
    for view, name in enumerate(VIEW_NAMES):
        path = out / f"render_{name}.png"
        render_person(attrs, view, np.random.default_rng([7, view]), size).save(path)
        examples.append((path, name, caption))
    return examples


def stage_examples(
    eval_results: dict | None, out: Path, size: tuple[int, int]
) -> tuple[list[str], list[str], str]:
    """Copy two example crops into ``out/examples``; returns (repo paths, views, query)."""
    examples: list[tuple[Path, str, str]] = []
    data = Path(str((eval_results or {}).get("data", "")))
    split = str((eval_results or {}).get("split", "test"))
    if eval_results and (data / f"{split}_reid.json").is_file():
        examples = _dataset_examples(data, split)
    folder = out / "examples"
    folder.mkdir(parents=True, exist_ok=True)
    if len(examples) < 2:
        examples = _rendered_examples(folder, size)
    from PIL import Image

    names = []
    for image, view, _ in examples:
        with Image.open(image) as img:
            img.convert("RGB").save(folder / f"{view}.png")
        names.append(f"examples/{view}.png")
    for leftover in folder.glob("render_*.png"):
        leftover.unlink()
    query = examples[-1][2] if examples else DEFAULT_QUERY
    return names, [v for _, v, _ in examples], query


# ---------------------------------------------------------------------------------------------------------
# The card
# ---------------------------------------------------------------------------------------------------------


def _dataset_facts(eval_results: dict | None, dataset_name: str | None) -> dict[str, Any]:
    data = str((eval_results or {}).get("data", ""))
    info = Path(data) / "dataset_info.json"
    synthetic = "synthetic" in data.lower() or (
        info.is_file() and json.loads(info.read_text()).get("generator") == "modeling_tagclip.data.synthetic"
    )
    default = "Synthetic aerial-ground persons (procedural)" if synthetic else (Path(data).name or "unknown")
    name = dataset_name or default
    return {
        "is_synthetic": synthetic,
        "dataset_name": name,
        "dataset_type": "synthetic-aerial-ground-persons" if synthetic else name.lower().replace(" ", "-"),
        "dataset_split": str((eval_results or {}).get("split", "test")),
    }


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


def _template_file(template: str | Path) -> Path:
    """``template`` as a Path; FileNotFoundError if there is no such file."""
    template = Path(template)
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found (run from a source checkout)")
    return template


def _card_data(repo_id: str, facts: dict[str, Any], **fields: Any):
    """The card metadata (``ModelCardData``) every card carries, plus ``fields``."""
    from huggingface_hub import ModelCardData

    return ModelCardData(
        library_name="transformers",
        license="mit",
        datasets=[facts["dataset_type"]],
        metrics=["recall", "map", "minp"],
        model_name=repo_id.split("/")[-1],
        **fields,
    )


def _from_template(
    card_data,
    template: Path,
    repo_id: str,
    training: tuple[dict, str] | None,
    facts: dict[str, Any],
    **fields: Any,
):
    """Render ``template`` with the values every card uses (training config, versions, dataset facts) and ``fields``."""
    import torch
    import transformers
    from huggingface_hub import ModelCard

    return ModelCard.from_template(
        card_data,
        template_path=str(template),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        training=training[0] if training else None,
        training_source=training[1] if training else None,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__.split("+")[0],
        transformers_range=TRANSFORMERS_RANGE,
        **fields,
        **facts,
    )


def render_card(
    config,
    repo_id: str,
    eval_results: dict | None = None,
    training: tuple[dict, str] | None = None,
    examples: tuple[list[str], list[str], str] | None = None,
    adapters: Sequence[str] = (),
    plots: Sequence[str] = (),
    dataset_name: str | None = None,
    template: str | Path = DEFAULT_TEMPLATE,
    ablations: Sequence[dict[str, str]] = (),
):
    """The model card (``huggingface_hub.ModelCard``) of a TAG-CLIP checkpoint with ``config``."""
    import huggingface_hub

    template = _template_file(template)
    facts = _dataset_facts(eval_results, dataset_name)
    files, views, query = examples or ([], [], DEFAULT_QUERY)
    endpoint = huggingface_hub.constants.ENDPOINT.rstrip("/")
    widget = [
        {
            "src": f"{endpoint}/{repo_id}/resolve/main/{name}",
            "candidate_labels": ", ".join(CANDIDATE_LABELS),
            "example_title": f"{view.capitalize()} view",
        }
        for name, view in zip(files, views, strict=True)
    ]
    card_data = _card_data(
        repo_id,
        facts,
        pipeline_tag="zero-shot-image-classification",
        language=["en"],
        tags=TAGS,
        eval_results=_eval_result_entries(eval_results, facts) if eval_results else None,
        widget=widget or None,
    )
    results = eval_results or {}
    return _from_template(
        card_data,
        template,
        repo_id,
        training,
        facts,
        results=eval_results,
        num_queries=results.get("num_queries"),
        num_gallery=results.get("num_gallery"),
        num_identities=results.get("num_identities"),
        chance_r1=results.get("chance_R@1"),
        match_view_breakdown=results.get("match_view_breakdown") or results.get("view_breakdown") or {},
        view_probe=_view_probe_text(results),
        plots=list(plots),
        example_files=json.dumps(files),
        example_views=views,
        example_query=query.replace('"', "'"),
        candidate_labels=json.dumps(CANDIDATE_LABELS),
        adapters=list(adapters),
        architecture=architecture_summary(config),
        ablations=list(ablations),
    )


# ---------------------------------------------------------------------------------------------------------
# ViSA (image-to-image re-ID) checkpoints
# ---------------------------------------------------------------------------------------------------------


def checkpoint_model_type(checkpoint: str | Path) -> str | None:
    """``model_type`` of the checkpoint's ``config.json`` (None if there is none)."""
    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return None


def load_reid_results(checkpoint: Path, explicit: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(results, file name) of a ViSA checkpoint: ``reid_results.json`` (evaluate_reid) or the run's
    ``eval_results.json`` (train_reid), each ``{"protocols": {name: {R1, R5, R10, mAP, mINP, ...}}, ...}``."""
    path = Path(explicit) if explicit else find_run_file(checkpoint, [REID_RESULTS_FILE, EVAL_FILE])
    if path is None:
        return None
    results = _read_mapping(path)
    protocols = results.get("protocols")
    if not isinstance(protocols, dict) or not protocols:
        raise ValueError(f"{path} has no 'protocols' mapping (expected the output of modeling_tagclip.evaluation.reid)")
    for name, row in protocols.items():
        if not isinstance(row, dict):
            raise ValueError(f"{path}: protocol {name!r} is not a mapping")
        if row.get("num_queries") == 0 and "mAP" not in row:
            continue  # a protocol without valid queries
        missing = [key for key, _ in REID_METRICS if not isinstance(row.get(key), (int, float))]
        if missing:
            raise ValueError(
                f"{path}: protocol {name!r} lacks the metrics {missing} (expected R1, R5, R10, mAP, mINP)"
            )
    return results, path.name


def visa_architecture_summary(config) -> dict[str, str]:
    """A few headline settings of a ViSAConfig for the card."""
    height, width = config.image_size
    return {
        "trunk": f"ViT, {config.num_hidden_layers} blocks, width {config.hidden_size}, "
        f"{config.num_attention_heads} heads",
        "input size (H x W)": f"{height} x {width}",
        "patch embedding": f"patch {config.patch_size}, stride {' x '.join(map(str, config.patch_stride))}",
        "ETGM experts": f"{config.num_experts} experts of {config.num_prompt_tokens} tokens, top-{config.expert_top_k}",
        "DLFM graph": f"top-{config.graph_top_k} neighbours",
        "embedding": f"{config.embedding_dim}-d (BNNeck(z_inv) + BNNeck(f_loc))",
        "training identities": str(getattr(config, "num_identities", "")),
    }


def _reid_eval_entries(protocols: dict, facts: dict) -> list:
    from huggingface_hub import EvalResult

    return [
        EvalResult(
            task_type="image-feature-extraction",
            task_name=f"Aerial-ground person re-identification ({name})",
            dataset_type=facts["dataset_type"],
            dataset_name=facts["dataset_name"],
            dataset_split=facts["dataset_split"],
            dataset_config=name,
            metric_type=metric_type,
            metric_name=f"{key} ({name})",
            metric_value=round(float(row[key]), 2),
        )
        for name, row in protocols.items()
        if isinstance(row.get("mAP"), (int, float))
        for key, metric_type in REID_METRICS
    ]


def _reid_dataset_facts(results: dict | None, dataset_name: str | None) -> dict[str, Any]:
    results = results or {}
    data = str(results.get("data", ""))
    info = Path(data) / "dataset_info.json" if data else None
    generator = json.loads(info.read_text()).get("generator") if info and info.is_file() else None
    synthetic = "synthetic" in (data + str(results.get("dataset", ""))).lower() or str(generator).startswith(
        "modeling_tagclip.data.synthetic"
    )
    default = (
        "Synthetic aerial-ground persons (procedural)"
        if synthetic
        else str(results.get("dataset") or Path(data).name or "unknown")
    )
    name = dataset_name or default
    return {
        "is_synthetic": synthetic,
        "dataset_name": name,
        "dataset_type": "synthetic-aerial-ground-reid" if synthetic else name.lower().replace(" ", "-"),
        "dataset_split": str(results.get("split", "test")),
    }


def render_visa_card(
    config,
    repo_id: str,
    reid_results: dict | None = None,
    training: tuple[dict, str] | None = None,
    examples: tuple[list[str], list[str]] | None = None,
    plots: Sequence[str] = (),
    dataset_name: str | None = None,
    template: str | Path = VISA_TEMPLATE,
    results_source: str | None = None,
):
    """The model card (``huggingface_hub.ModelCard``) of a ViSA checkpoint with ``config``."""
    template = _template_file(template)
    facts = _reid_dataset_facts(reid_results, dataset_name)
    protocols = (reid_results or {}).get("protocols") or {}
    files, views = examples or (["examples/aerial.png", "examples/ground.png"], ["aerial", "ground"])
    entries = _reid_eval_entries(protocols, facts)
    card_data = _card_data(
        repo_id, facts, pipeline_tag="image-feature-extraction", tags=VISA_TAGS, eval_results=entries or None
    )
    height, width = config.image_size
    return _from_template(
        card_data,
        template,
        repo_id,
        training,
        facts,
        protocols=protocols,
        results_source=results_source,
        best_step=(reid_results or {}).get("best_step"),
        plots=list(plots),
        example_files=json.dumps(files),
        example_views=views,
        example_view_labels=json.dumps([0 if v == "aerial" else 1 for v in views]),
        embedding_dim=config.embedding_dim,
        image_height=height,
        image_width=width,
        architecture=visa_architecture_summary(config),
    )


def stage_visa_checkpoint(
    checkpoint: Path,
    repo_id: str,
    out: Path,
    eval_results: str | None = None,
    training_config: str | None = None,
    dataset_name: str | None = None,
    template: str | Path = VISA_TEMPLATE,
) -> Path:
    """Stage a ViSA checkpoint: weights + custom code (AutoModel → ViSAModel), results, example crops, card."""
    from transformers.utils import logging as hf_logging

    from modeling_tagclip.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.visa.image_processing_visa import build_visa_image_processor
    from modeling_tagclip.visa.modeling_visa import ViSAForReID, ViSAModel

    config = ViSAConfig.from_pretrained(checkpoint)
    cls = ViSAForReID if "ViSAForReID" in (config.architectures or []) else ViSAModel
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(checkpoint).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    ViSAConfig.register_for_auto_class()
    ViSAModel.register_for_auto_class("AutoModel")
    ViSAForReID.register_for_auto_class("AutoModelForImageClassification")
    model.save_pretrained(out)
    build_visa_image_processor(*model.config.image_size).save_pretrained(out)
    loaded = load_reid_results(checkpoint, eval_results)
    results, source = loaded if loaded else (None, None)
    if results is not None:
        (out / REID_RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
    plots = _stage_plots(checkpoint, out)
    folder = out / "examples"
    folder.mkdir(parents=True, exist_ok=True)
    names, views = [], []
    for path, view, _ in _rendered_examples(folder, tuple(config.image_size)):
        path.rename(folder / f"{view}.png")
        names.append(f"examples/{view}.png")
        views.append(view)
    training = load_training_config(checkpoint, training_config)
    card = render_visa_card(
        model.config,
        repo_id,
        results,
        training,
        (names, views),
        plots,
        dataset_name=dataset_name,
        template=template,
        results_source=source,
    )
    card.save(out / "README.md")
    return out


# ---------------------------------------------------------------------------------------------------------
# Staging and upload
# ---------------------------------------------------------------------------------------------------------


def model_folder(checkpoint: str | Path) -> Path:
    """The saved model of ``checkpoint``: the folder itself, or ``best/`` of a training run folder (whose own
    ``config.json`` is the training config, not a model config)."""
    checkpoint = Path(checkpoint)
    best = checkpoint / "best"
    if checkpoint_model_type(checkpoint) is None and checkpoint_model_type(best) is not None:
        return best
    return checkpoint


def _load_checkpoint(checkpoint: Path):
    from modeling_tagclip.evaluation.text_retrieval import load_model

    if not (checkpoint / "config.json").is_file() and not (checkpoint / "adapter_config.json").is_file():
        adapters = _adapter_dirs(checkpoint) if checkpoint.is_dir() else []
        if len(adapters) != 1:
            raise FileNotFoundError(f"{checkpoint} is not a saved TAG-CLIP folder (no config.json)")
        checkpoint = adapters[0]  # a LoRA-only run: best/adapter, merged onto its base for the root model
    return load_model(checkpoint, "cpu")


def stage_checkpoint(
    checkpoint: str | Path,
    repo_id: str,
    out: str | Path,
    eval_results: str | None = None,
    training_config: str | None = None,
    adapters: Sequence[str] = (),
    dataset_name: str | None = None,
    with_handler: bool = True,
    template: str | Path | None = None,
    ablation: str | Path | None = None,
) -> Path:
    """Write everything the Hub repository should hold into ``out`` and return it.

    ``ablation``: a ``tagclip ablate`` results folder whose tables and plots the card carries (TAG-CLIP only).
    A ViSA checkpoint (``model_type`` ``visa``) is staged by `stage_visa_checkpoint` with the ViSA card;
    ``template`` None picks the card template of the checkpoint's model family.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    if checkpoint_model_type(checkpoint) == "visa":
        return stage_visa_checkpoint(
            checkpoint,
            repo_id,
            out,
            eval_results=eval_results,
            training_config=training_config,
            dataset_name=dataset_name,
            template=template or VISA_TEMPLATE,
        )
    template = template or DEFAULT_TEMPLATE
    from modeling_tagclip.retrieval.pipeline_tagclip import save_with_pipeline

    model, processor = _load_checkpoint(checkpoint)
    save_with_pipeline(model, processor, out)
    results = load_eval_results(checkpoint, eval_results)
    if results is not None:
        (out / EVAL_FILE).write_text(json.dumps(results, indent=2) + "\n")
    plots = _stage_plots(checkpoint, out)
    ablations = _stage_ablations(ablation, out)
    adapter_names = []
    for adapter in discover_adapters(checkpoint, adapters):
        shutil.copytree(adapter, out / "adapters" / adapter.name, dirs_exist_ok=True)
        adapter_names.append(f"adapters/{adapter.name}")
    size = tuple(processor.image_processor.size[k] for k in ("height", "width"))
    examples = stage_examples(results, out, size)
    if with_handler and HANDLER_FILE.is_file():
        shutil.copy2(HANDLER_FILE, out / "handler.py")
    training = load_training_config(checkpoint, training_config)
    card = render_card(
        model.config,
        repo_id,
        results,
        training,
        examples,
        adapter_names,
        plots,
        dataset_name=dataset_name,
        template=template,
        ablations=ablations,
    )
    card.save(out / "README.md")
    return out


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload TAG-CLIP",
) -> str:
    """Create the model repository if needed and upload ``folder``; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message)
    return str(info.commit_url)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tagclip push", description="Push a TAG-CLIP checkpoint (with card and code) to the Hub.")
    p.add_argument(
        "--checkpoint", required=True, help="saved model folder, e.g. outputs/tagclip-synthetic/best"
    )
    p.add_argument("--repo-id", required=True, help="ORG/NAME of the model repository")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="default: HF_TOKEN / the stored login")
    p.add_argument(
        "--eval-results",
        default=None,
        help=f"default: {EVAL_FILE} (ViSA: {REID_RESULTS_FILE}, else {EVAL_FILE}) in the checkpoint or its parent",
    )
    p.add_argument(
        "--training-config", default=None, help="default: the run's config file next to the checkpoint"
    )
    p.add_argument("--adapter", action="append", default=[], help="extra LoRA adapter folder (repeatable)")
    p.add_argument("--dataset-name", default=None, help="pretty dataset name for the card")
    p.add_argument(
        "--template",
        default=None,
        help=f"Jinja model card template (default: {DEFAULT_TEMPLATE.name}, {VISA_TEMPLATE.name} for ViSA)",
    )
    p.add_argument(
        "--no-handler", action="store_true", help="do not upload the Inference Endpoints handler.py"
    )
    p.add_argument(
        "--ablation", default=None, help="tagclip ablate results folder (e.g. outputs/ablation): tables in the card"
    )
    p.add_argument("--commit-message", default="Upload TAG-CLIP checkpoint")
    p.add_argument("--stage-dir", default=None, help="keep the staged files here (default: a temp dir)")
    p.add_argument(
        "--dry-run", action="store_true", help="stage the files and render the card, upload nothing"
    )
    return accept_both_spellings(p).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    """CLI entry point; returns the commit URL (or the staging folder for --dry-run)."""
    args = _parse_args(argv)
    args.checkpoint = str(model_folder(args.checkpoint))
    keep = args.stage_dir or (tempfile.mkdtemp(prefix="tagclip-push-") if args.dry_run else None)
    with tempfile.TemporaryDirectory(prefix="tagclip-push-") as tmp:
        out = Path(keep) if keep else Path(tmp) / "repo"
        stage_checkpoint(
            args.checkpoint,
            args.repo_id,
            out,
            eval_results=args.eval_results,
            training_config=args.training_config,
            adapters=args.adapter,
            dataset_name=args.dataset_name,
            with_handler=not args.no_handler,
            template=args.template,
            ablation=args.ablation,
        )
        files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
        print(f"staged {len(files)} files in {out}: {', '.join(files)}")
        if args.dry_run:
            return str(out)
        url = _push_online(out, args)
    print(f"pushed to {args.repo_id}: {url}")
    return url


def _push_online(folder: Path, args: argparse.Namespace) -> str:
    """``push_folder``, with no network (or offline mode) one line pointing at ``--dry-run``."""
    import httpx
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        return push_folder(folder, args.repo_id, args.private, args.token, args.commit_message)
    except (ConnectionError, httpx.TransportError) as error:  # OfflineModeIsEnabled is a ConnectionError
        reason = "HF_HUB_OFFLINE is set" if isinstance(error, OfflineModeIsEnabled) else f"no connection ({error})"
        raise SystemExit(
            f"tagclip push: cannot reach the Hub: {reason}; `tagclip push --dry-run --stage-dir DIR` stages and "
            "renders everything without uploading"
        ) from None
