"""``tagclip <verb>``: the one command line of the package; each verb's parser lives next to the code it drives.

    tagclip train [--config default|tag-pedes|visa-cargo|FILE.yaml] [--task reid] [...]
    tagclip eval --model M --data DIR [--task reid]
    tagclip index | search | serve | remove | ingest ...
    tagclip push | export | convert | dtg | ablate ...

Several processes: ``accelerate launch -m modeling_tagclip.cli train ...`` (or ``torchrun -m
modeling_tagclip.cli index ...``); ``accelerate launch training/train.py`` runs the same ``train``. A bad input
(a value, a file, a folder) ends in one ``tagclip VERB: error: ...`` line; ``TAGCLIP_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from modeling_tagclip.flags import finish
from modeling_tagclip.flags import parse as parse_flags

__all__ = ["MAIN_JOB", "VERBS", "build_parser", "main", "parse"]

# the main job as the README gives it (the demo prints it too): one process, no launcher warnings
MAIN_JOB = "accelerate launch --config_file training/accelerate_config.yaml -q training/train.py"

# verb -> (its module, one-line help); each module has ``add_arguments(parser)`` and ``run(args) -> int`` and is
# light to import (the heavy imports happen in ``run``), so help and argument errors come before torch
VERBS: dict[str, tuple[str, str]] = {
    "train": ("modeling_tagclip.engine.cli", "train TAG-CLIP (text retrieval) or ViSA (--task reid)"),
    "eval": ("modeling_tagclip.evaluation.cli", "evaluate a model: text retrieval, or re-ID (--task reid)"),
    "index": ("modeling_tagclip.cli.index", "encode a folder of person images into a gallery index"),
    "search": ("modeling_tagclip.cli.search", "rank an indexed gallery for a description"),
    "serve": ("modeling_tagclip.cli.serve", "answer one query per stdin line from a loaded index"),
    "remove": ("modeling_tagclip.cli.remove", "remove images from a gallery index"),
    "ingest": (
        "modeling_tagclip.video.cli",
        "find, track and index the people in video files, frame folders and streams",
    ),
    "push": ("modeling_tagclip.hub.push_to_hub", "push a trained model with its card to the Hub"),
    "export": ("modeling_tagclip.cli.export", "export a model to ONNX"),
    "convert": (
        "modeling_tagclip.convert.cli",
        "convert HF CLIP, TAG-PR or ViSA checkpoints, or CLIP's vocabulary",
    ),
    "dtg": ("modeling_tagclip.dtg.cli", "generate captions for person images with a local VLM (DTG)"),
    "ablate": ("modeling_tagclip.ablation.runner", "run an ablation study (paper Tables 4, 5, init)"),
}

EXTRAS = {
    "yaml": "train",
    "accelerate": "train",
    "peft": "train",
    "datasets": "train",
    "evaluate": "train",
    "matplotlib": "train",
    "faiss": "search",
    "av": "video",
    "scipy": "video",
    "onnx": "export",
    "onnxruntime": "export",
}


def usage() -> str:
    """The top-level help: every verb with its one-line description."""
    width = max(map(len, VERBS))
    lines = ["usage: tagclip <command> [options]   (tagclip <command> --help: that command's options)", ""]
    lines += [f"  {verb:<{width}}  {text}" for verb, (_, text) in VERBS.items()]
    return "\n".join(lines)


def verb_module(verb: str) -> ModuleType:
    """The module of ``verb``; a missing optional package is one line naming the extra that installs it."""
    try:
        return importlib.import_module(VERBS[verb][0])
    except ModuleNotFoundError as error:
        extra = EXTRAS.get((error.name or "").split(".")[0])
        hint = f" (pip install 'tag-clip[{extra}]')" if extra else ""
        raise SystemExit(f"tagclip {verb}: needs {error.name!r}, which is not installed{hint}") from None


def build_parser(verb: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``tagclip VERB``: the module's arguments, defaults in ``--help``, hidden aliases."""
    parser = argparse.ArgumentParser(
        prog=prog or f"tagclip {verb}", description=VERBS[verb][1], allow_abbrev=False
    )
    verb_module(verb).add_arguments(parser)
    return finish(parser, verb)


def parse(verb: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``tagclip VERB ARGV`` as the verb's ``run`` receives it (``--help`` and a bad flag exit here)."""
    return parse_flags(build_parser(verb), argv)


def _quiet_loading() -> None:
    """No "Loading weights" progress bar (reading a model takes a moment; the commands show their own progress);
    Hub downloads keep huggingface_hub's bars unless ``HF_HUB_DISABLE_PROGRESS_BARS`` says otherwise. Imports
    neither transformers nor torch: transformers takes its bar's state from huggingface_hub when imported."""
    import huggingface_hub.utils as hub_utils
    from huggingface_hub import constants

    if constants.HF_HUB_DISABLE_PROGRESS_BARS is None:
        hub_utils.disable_progress_bars()
        hub_utils.enable_progress_bars("huggingface_hub")
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:  # already imported (a command run from Python): its state is set directly
        hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tagclip`` console script: run one verb; the exit status of the command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        match = difflib.get_close_matches(verb, list(VERBS), n=1)
        hint = f"; did you mean {match[0]!r}?" if match else f"; choose from {', '.join(VERBS)}"
        print(f"tagclip: error: unknown command {verb!r}{hint}", file=sys.stderr)
        return 2
    args = parse(verb, rest)  # help and bad flags: before any heavy import
    from modeling_tagclip.failures import describe, storage_errors
    from modeling_tagclip.progress import line_buffered_output

    line_buffered_output()

    _quiet_loading()
    try:
        result = verb_module(verb).run(args)
    except (*storage_errors(), ValueError, OSError) as error:  # a disk problem or bad input: one line
        if os.environ.get("TAGCLIP_DEBUG"):
            raise
        print(f"tagclip {verb}: error: {describe(error)}", file=sys.stderr)
        return 1
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
