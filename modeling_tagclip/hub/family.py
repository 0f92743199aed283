"""The per-family part of the Hub path: what a model family (``hub/tagclip.py``, ``hub/visa.py``) adds to the
generic stage → card → push of ``hub/push_to_hub.py``, and which family a checkpoint belongs to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class StageOptions:
    """Family-specific staging choices: extra LoRA adapter folders, the Inference Endpoints handler, a
    ``tagclip ablate`` results folder whose tables the card carries."""

    adapters: Sequence[str] = ()
    with_handler: bool = True
    ablation: str | Path | None = None


class HubFamily(Protocol):
    """One model family's adapter to the generic Hub path."""

    template: Path  # the default model card template
    results_file: str  # the name the run's results are staged under
    synthetic_type: str  # the card's dataset type slug for this package's synthetic data

    def save_model(self, checkpoint: Path, out: Path) -> tuple[Any, tuple[int, int]]:
        """Save the model (safetensors + custom code with ``auto_map``) and its processor into ``out``;
        returns (model config, input (height, width))."""
        ...

    def load_results(self, checkpoint: Path, explicit: str | None) -> tuple[dict[str, Any], str] | None:
        """(results, file name) of the run, checked for the metrics the card reports; None if there are none."""
        ...

    def stage_files(
        self, checkpoint: Path, out: Path, results: dict | None, size: tuple[int, int], options: StageOptions
    ) -> dict[str, Any]:
        """Stage the family's own files (example crops, adapters, ...) into ``out``; returns the keyword
        arguments of ``card`` that name them."""
        ...

    def card(
        self, config: Any, repo_id: str, results: dict | None, facts: dict[str, Any], **fields: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(card metadata: pipeline tag, tags, ``model-index``, ...; template values) of a checkpoint."""
        ...


def family_for(model_type: str | None) -> HubFamily:
    """The adapter of ``model_type`` (a ``config.json``'s): ViSA for ``visa``, else TAG-CLIP (whose LoRA-only
    run folders have no model config)."""
    if model_type == "visa":
        from modeling_tagclip.hub.visa import ViSAHub

        return ViSAHub()
    from modeling_tagclip.hub.tagclip import TagClipHub

    return TagClipHub()
