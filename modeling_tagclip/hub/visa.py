"""The ViSA family on the Hub: the re-ID model with its custom code (``AutoModel`` → ``ViSAModel``), its image
processor, ``reid_results.json`` and the image-to-image re-ID card with a ``model-index`` of every protocol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeling_tagclip.hub.examples import stage_examples
from modeling_tagclip.hub.run_files import EVAL_FILE, read_mapping, results_path

if TYPE_CHECKING:
    from modeling_tagclip.hub.family import StageOptions

TEMPLATE = Path(__file__).resolve().parent / "cards" / "visa_card.md"
TAGS = [
    "custom_code",
    "person-reidentification",
    "aerial-ground",
    "mixture-of-experts",
    "vision-transformer",
    "visa",
]
# tagclip eval --task reid --output (its usual name); tagclip train --task reid writes EVAL_FILE
REID_RESULTS_FILE = "reid_results.json"
REID_METRICS = (
    ("R1", "recall@1"),
    ("R5", "recall@5"),
    ("R10", "recall@10"),
    ("mAP", "map"),
    ("mINP", "minp"),
)


def load_reid_results(checkpoint: Path, explicit: str | None = None) -> tuple[dict[str, Any], str] | None:
    """(results, file name) of a ViSA checkpoint: ``reid_results.json`` (evaluate_reid) or the run's
    ``eval_results.json`` (train_reid), each ``{"protocols": {name: {R1, R5, R10, mAP, mINP, ...}}, ...}``."""
    path = results_path(checkpoint, [REID_RESULTS_FILE, EVAL_FILE], explicit)
    if path is None:
        return None
    results = read_mapping(path)
    protocols = results.get("protocols")
    if not isinstance(protocols, dict) or not protocols:
        raise ValueError(
            f"{path} has no 'protocols' mapping (expected the output of modeling_tagclip.evaluation.reid)"
        )
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


def architecture_summary(config) -> dict[str, str]:
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


def _load_quietly(checkpoint: Path):
    """The ViSA model of ``checkpoint`` (``ViSAForReID`` if it was saved as one), without load warnings."""
    from transformers.utils import logging as hf_logging

    from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
    from modeling_tagclip.models.visa.modeling_visa import ViSAForReID, ViSAModel

    config = ViSAConfig.from_pretrained(checkpoint)
    cls = ViSAForReID if "ViSAForReID" in (config.architectures or []) else ViSAModel
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(checkpoint).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


class ViSAHub:
    """ViSA's adapter to the generic Hub path (see ``hub/family.py``): no handler, no adapters."""

    template = TEMPLATE
    results_file = REID_RESULTS_FILE
    synthetic_type = "synthetic-aerial-ground-reid"

    def save_model(self, checkpoint: Path, out: Path) -> tuple[Any, tuple[int, int]]:
        from modeling_tagclip.models.visa.configuration_visa import ViSAConfig
        from modeling_tagclip.models.visa.image_processing_visa import build_visa_image_processor
        from modeling_tagclip.models.visa.modeling_visa import ViSAForReID, ViSAModel

        model = _load_quietly(checkpoint)
        ViSAConfig.register_for_auto_class()
        ViSAModel.register_for_auto_class("AutoModel")
        ViSAForReID.register_for_auto_class("AutoModelForImageClassification")
        model.save_pretrained(out)
        build_visa_image_processor(*model.config.image_size).save_pretrained(out)
        return model.config, tuple(model.config.image_size)

    def load_results(self, checkpoint: Path, explicit: str | None) -> tuple[dict[str, Any], str] | None:
        return load_reid_results(checkpoint, explicit)

    def stage_files(
        self, checkpoint: Path, out: Path, results: dict | None, size: tuple[int, int], options: StageOptions
    ) -> dict[str, Any]:
        if options.adapters or options.ablation is not None:
            raise ValueError("a ViSA checkpoint takes no --adapter or --ablation (they are TAG-CLIP's)")
        files, views, _ = stage_examples(out, size)  # synthetic crops: a re-ID split has no captions to show
        return {"examples": (files, views)}

    def card(
        self,
        config: Any,
        repo_id: str,
        results: dict | None,
        facts: dict[str, Any],
        examples: tuple[list[str], list[str]] | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        protocols = (results or {}).get("protocols") or {}
        files, views = examples or (["examples/aerial.png", "examples/ground.png"], ["aerial", "ground"])
        entries = _reid_eval_entries(protocols, facts)
        metadata = {"pipeline_tag": "image-feature-extraction", "tags": TAGS, "eval_results": entries or None}
        height, width = config.image_size
        fields = {
            "protocols": protocols,
            "best_step": (results or {}).get("best_step"),
            "example_files": json.dumps(files),
            "example_views": views,
            "example_view_labels": json.dumps([0 if v == "aerial" else 1 for v in views]),
            "embedding_dim": config.embedding_dim,
            "image_height": height,
            "image_width": width,
            "architecture": architecture_summary(config),
        }
        return metadata, fields
