"""The model card: dataset facts, the metadata every card carries, and rendering a family's Jinja template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRANSFORMERS_RANGE = ">=5.20,<6"
SYNTHETIC_NAME = "Synthetic aerial-ground persons (procedural)"


def template_file(template: str | Path) -> Path:
    """``template`` as a Path; FileNotFoundError if there is no such file."""
    template = Path(template)
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found (run from a source checkout)")
    return template


def dataset_facts(results: dict | None, dataset_name: str | None, synthetic_type: str) -> dict[str, Any]:
    """Name, type slug and split of the dataset ``results`` were measured on, and whether it is synthetic.

    Synthetic: the path or dataset name says so, or its ``dataset_info.json`` names this package's generator;
    its type slug is then ``synthetic_type``. ``dataset_name`` overrides the name.
    """
    results = results or {}
    data = str(results.get("data", ""))
    info = Path(data) / "dataset_info.json" if data else None
    generator = json.loads(info.read_text()).get("generator") if info and info.is_file() else None
    synthetic = "synthetic" in (data + str(results.get("dataset", ""))).lower() or str(generator).startswith(
        "modeling_tagclip.data.synthetic"
    )
    default = SYNTHETIC_NAME if synthetic else str(results.get("dataset") or Path(data).name or "unknown")
    name = dataset_name or default
    return {
        "is_synthetic": synthetic,
        "dataset_name": name,
        "dataset_type": synthetic_type if synthetic else name.lower().replace(" ", "-"),
        "dataset_split": str(results.get("split", "test")),
    }


def render_template(
    template: Path,
    repo_id: str,
    facts: dict[str, Any],
    training: tuple[dict, str] | None,
    metadata: dict[str, Any],
    fields: dict[str, Any],
):
    """The ``huggingface_hub.ModelCard`` of ``template``: the card metadata every card carries plus
    ``metadata``, rendered with the values every card uses (training config, versions, dataset facts) and
    ``fields``."""
    import torch
    import transformers
    from huggingface_hub import ModelCard, ModelCardData

    model_name = repo_id.split("/")[-1]
    card_data = ModelCardData(
        library_name="transformers",
        license="mit",
        datasets=[facts["dataset_type"]],
        metrics=["recall", "map", "minp"],
        model_name=model_name,
        **metadata,
    )
    return ModelCard.from_template(
        card_data,
        template_path=str(template_file(template)),
        model_name=model_name,
        repo_id=repo_id,
        training=training[0] if training else None,
        training_source=training[1] if training else None,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__.split("+")[0],
        transformers_range=TRANSFORMERS_RANGE,
        **fields,
        **facts,
    )
