"""Push a checkpoint to the Hugging Face Hub with its code, processor, model card and results.

Usage::

    tagclip push --model outputs/tagclip-synthetic/best --repo-id ORG/NAME [--private]
        [--eval-results FILE] [--training-config FILE] [--adapter DIR ...] [--stage-dir DIR] [--dry-run]

One path for every model family: stage (the model re-saved as safetensors with its custom code and
``auto_map``, its processor, the run's results, plots and the family's own files), render the card from the
family's template, push the folder. ``config.json``'s ``model_type`` picks the family (``hub/family.py``):

- TAG-CLIP (``hub/tagclip.py``): the ``text-to-person-retrieval`` pipeline in ``custom_pipelines``,
  ``eval_results.json``, two example crops for the card's snippet, LoRA adapter folders under
  ``adapters/NAME/``, the Inference Endpoints ``handler.py`` and ``--ablation`` tables; card
  ``cards/tagclip_card.md``.
- ViSA (``hub/visa.py``, ``"model_type": "visa"``): ``AutoModel`` → ``ViSAModel``, ``reid_results.json``
  (``tagclip eval --task reid --output FILE``) or the run's ``eval_results.json``, a
  ``model-index`` of every re-ID protocol (R1/R5/R10/mAP/mINP) and two synthetic example crops; card
  ``cards/visa_card.md``.

Results, the training config and plots are found in the checkpoint folder or the training run folder above
it. ``--dry-run`` only stages the files (no network); a push without network says so in one line.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modeling_tagclip.atomic_io import write_json
from modeling_tagclip.hub.card import dataset_facts, render_template
from modeling_tagclip.hub.family import StageOptions, family_for
from modeling_tagclip.hub.run_files import (
    checkpoint_model_type,
    load_training_config,
    model_folder,
    stage_plots,
)

__all__ = ["main", "push_folder", "render_card", "stage_checkpoint"]


def render_card(
    config: Any,
    repo_id: str,
    results: dict | None = None,
    *,
    training: tuple[dict, str] | None = None,
    plots: Sequence[str] = (),
    dataset_name: str | None = None,
    template: str | Path | None = None,
    results_source: str | None = None,
    **family_fields: Any,
):
    """The model card (``huggingface_hub.ModelCard``) of a checkpoint with ``config``.

    ``config.model_type`` picks the family; ``family_fields`` are its own (TAG-CLIP: ``examples``,
    ``adapters``, ``ablations``; ViSA: ``examples``). ``template`` None: the family's card template.
    """
    family = family_for(config.model_type)
    facts = dataset_facts(results, dataset_name, family.synthetic_type)
    metadata, fields = family.card(config, repo_id, results, facts, **family_fields)
    common = {"plots": list(plots), "results_source": results_source}
    return render_template(
        Path(template or family.template), repo_id, facts, training, metadata, {**common, **fields}
    )


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
    """Write everything the Hub repository should hold into ``out`` (model, results, plots, the family's
    files, ``README.md``) and return it. ``template`` None picks the card template of the checkpoint's family."""
    checkpoint, out = Path(checkpoint), Path(out)
    family = family_for(checkpoint_model_type(checkpoint))
    config, size = family.save_model(checkpoint, out)
    results, source = family.load_results(checkpoint, eval_results) or (None, None)
    if results is not None:
        write_json(out / family.results_file, results, indent=2)
    plots = stage_plots(checkpoint, out)
    options = StageOptions(adapters=tuple(adapters), with_handler=with_handler, ablation=ablation)
    fields = family.stage_files(checkpoint, out, results, size, options)
    card = render_card(
        config,
        repo_id,
        results,
        training=load_training_config(checkpoint, training_config),
        plots=plots,
        dataset_name=dataset_name,
        template=template,
        results_source=source,
        **fields,
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


def _network_errors() -> tuple[type[BaseException], ...]:
    """What an unreachable Hub raises: offline mode (a ConnectionError) and the transport errors of the HTTP
    client huggingface_hub uses (httpx or httpx2)."""
    errors: list[type[BaseException]] = [ConnectionError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _offline_message(error: BaseException) -> str:
    """One line: why nothing was pushed, and how to stage without network."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(error, OfflineModeIsEnabled):
        why = "the Hub is offline here (HF_HUB_OFFLINE is set)"
    else:
        why = f"cannot reach the Hub at {constants.ENDPOINT} ({type(error).__name__}: {error})"
    return f"tagclip push: {why}; nothing was pushed. Use --dry-run [--stage-dir DIR] to stage the files without network"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tagclip push``."""
    p.description = "Push a trained model (with its card and code) to the Hugging Face Hub."
    p.add_argument(
        "--model",
        required=True,
        help="saved model folder or training run, e.g. outputs/tagclip-synthetic/best",
    )
    p.add_argument("--repo-id", required=True, help="ORG/NAME of the model repository")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--token", default=None, help="default: HF_TOKEN / the stored login")
    p.add_argument(
        "--eval-results",
        default=None,
        help="default: eval_results.json (ViSA: reid_results.json, else eval_results.json) in the checkpoint or its parent",
    )
    p.add_argument(
        "--training-config", default=None, help="default: the run's config file next to the checkpoint"
    )
    p.add_argument("--adapter", action="append", default=[], help="extra LoRA adapter folder (repeatable)")
    p.add_argument("--dataset-name", default=None, help="pretty dataset name for the card")
    p.add_argument(
        "--template",
        default=None,
        help="Jinja model card template (default: tagclip_card.md, visa_card.md for ViSA)",
    )
    p.add_argument(
        "--no-handler", action="store_true", help="do not upload the Inference Endpoints handler.py"
    )
    p.add_argument(
        "--ablation",
        default=None,
        help="tagclip ablate results folder (e.g. outputs/ablation): tables in the card",
    )
    p.add_argument("--commit-message", default="Upload TAG-CLIP checkpoint", help="message of the Hub commit")
    p.add_argument("--stage-dir", default=None, help="keep the staged files here (default: a temp dir)")
    p.add_argument(
        "--dry-run", action="store_true", help="stage the files and render the card, upload nothing"
    )


def main(argv: Sequence[str] | None = None) -> str:
    """``tagclip push ARGV`` from Python; returns the commit URL (or the staging folder for --dry-run)."""
    from modeling_tagclip.cli import parse

    return push(parse("push", argv))


def run(args: argparse.Namespace) -> int:
    """``tagclip push`` with its parsed flags; the exit status."""
    push(args)
    return 0


def push(args: argparse.Namespace) -> str:
    """Stage and push (or only stage, ``--dry-run``); the commit URL or the staging folder."""
    checkpoint = model_folder(args.model)
    keep = args.stage_dir or (tempfile.mkdtemp(prefix="tagclip-push-") if args.dry_run else None)
    with tempfile.TemporaryDirectory(prefix="tagclip-push-") as tmp:
        out = Path(keep) if keep else Path(tmp) / "repo"
        stage_checkpoint(
            checkpoint,
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
        try:
            url = push_folder(out, args.repo_id, args.private, args.token, args.commit_message)
        except _network_errors() as error:
            raise SystemExit(_offline_message(error)) from None
    print(f"pushed to {args.repo_id}: {url}")
    return url
