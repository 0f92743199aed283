"""One flag vocabulary for every command: each long flag is spelled with dashes (``--batch-size``) and names one
idea in every verb (``VOCABULARY``); the underscore spelling (``--batch_size``, transformers' ``TrainingArguments``
style) and the old names of renamed flags (``RENAMED``) stay as hidden aliases. Also the argparse types every
command uses (one behaviour: ``positive_int`` reads "+3" and " 3 " as 3 in every command, and refuses "3.0",
"0x3", "3_000")."""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Sequence

# every visible long flag of every verb -> the one idea it names (tests/e2e/test_flag_vocabulary.py checks each
# verb's --help against it: a flag missing here, an underscore or a second name for an idea fails)
VOCABULARY: dict[str, str] = {
    "--help": "show the help and exit",
    # what a command reads and writes
    "--model": "a saved model folder (or Hub id) to use",
    "--data": "a dataset folder",
    "--dataset": "which dataset: a re-ID dataset name, or dtg's TAG-PEDES JSON list",
    "--image-dir": "the image root of a dataset",
    "--images": "a folder of person images to process",
    "--output": "where the command writes its result (a file or a folder)",
    "--checkpoint": "a checkpoint of another codebase to convert",
    "--vocab": "OpenAI CLIP's BPE vocabulary file",
    "--config": "a recipe or config (a shipped name, YAML or JSON)",
    "--metadata": "a CSV/JSON sidecar of per-image metadata",
    "--index": "an index folder from tagclip index",
    "--milvus-uri": "a Milvus server or Milvus Lite file holding the gallery",
    "--collection": "a Milvus collection",
    "--split": "an annotation split",
    # how the work runs
    "--batch-size": "items per forward pass (training: per process)",
    "--workers": "DataLoader worker processes",
    "--dtype": "the floating-point type of the computation",
    "--device": "the torch device",
    "--seed": "the random seed",
    "--quiet": "no progress bar",
    "--task": "retrieval (TAG-CLIP) or reid (ViSA)",
    "--trust-remote-code": "run the code a foreign model folder ships",
    "--distributed": "split the work over the ranks of torchrun / accelerate launch",
    "--overwrite": "replace an existing result",
    "--dry-run": "stage and check, write nothing remote",
    "--limit": "process only the first N items",
    "--set": "any setting, dotted KEY=VALUE",
    # train
    "--list-configs": "list the shipped recipes with their values",
    "--resume-from-checkpoint": "resume a training run",
    "--eval-only": "evaluate a finished training run",
    "--stop-after-steps": "stop as if interrupted",
    "--lora": "train LoRA adapters",
    "--merge-lora": "also save a merged LoRA model",
    "--render-synthetic": "render the synthetic set into a non-default data folder",
    "--init-from": "a model folder training starts from",
    "--model-config": "model config overrides",
    "--num-train-epochs": "training epochs",
    "--max-steps": "optimizer steps to stop after",
    "--learning-rate": "peak learning rate",
    "--mixed-precision": "accelerate's mixed-precision training mode",
    "--validation-fraction": "identities carved for validation",
    "--model-selection": "how the saved epoch is chosen",
    "--save-steps": "checkpoint interval",
    "--save-total-limit": "checkpoints kept",
    "--eval-every-epochs": "validation interval",
    "--eval-batch-size": "evaluation batch during training",
    "--logging-steps": "loss logging interval",
    "--num-threads": "torch intra-op threads",
    "--pin-memory": "page-locked batches",
    "--persistent-workers": "keep loader processes across epochs",
    "--plots": "write the training plots",
    "--weight-decay": "weight decay",
    "--train-split": "the split training reads",
    "--test-split": "the split a run reports",
    "--synthetic": "settings of the rendered synthetic set",
    "--bad-data": "what to do with missing or corrupt samples",
    "--pretrain-clip": "the plain-CLIP pre-training phase",
    "--image-size": "input height and width",
    "--lr-start": "learning rate at the start of the warm-up",
    "--lr-end": "learning rate at the end of the decay",
    "--warmup-epochs": "epochs of warm-up",
    "--adam-betas": "AdamW betas",
    "--adam-eps": "AdamW epsilon",
    "--tse-lr-ratio": "learning-rate multiplier of the TSE head",
    "--softlabel-ratio": "soft-label weight of the ID loss",
    "--freeze-patch-embedding": "keep the patch embedding fixed",
    "--augment": "training-time augmentation",
    "--text-max-length": "caption tokens",
    "--gather-negatives": "contrast against the all-gathered batch",
    "--grad-cache-chunks": "gradient-caching chunks",
    "--max-grad-norm": "global gradient-norm clip",
    "--eval-routing": "HR-MoE routing at evaluation",
    "--synthetic-identities": "identities of the synthetic re-ID set",
    "--preset": "ViSAConfig preset",
    "--imagenet-vit": "an ImageNet ViT state dict for the trunk",
    "--num-instances": "images per identity in a batch",
    "--optimizer": "sgd or adamw",
    "--momentum": "SGD momentum",
    "--weight-decay-bias": "weight decay of biases",
    "--weight-decay-norm": "weight decay of normalisation layers",
    "--clip-norm": "per-tensor gradient-norm clip",
    "--warmup-iters": "iterations of warm-up",
    "--warmup-factor": "learning-rate factor at the start of the warm-up",
    "--eta-min": "learning rate at the end of the cosine decay",
    "--random-erasing": "probability of random erasing",
    # eval
    "--grid": "a PNG of example queries and their hits",
    "--no-probe": "skip the linear view probe",
    "--rerank": "k-reciprocal re-ranking",
    "--rerank-k1": "k-reciprocal neighbours",
    "--rerank-k2": "query-expansion neighbours",
    "--rerank-lambda": "weight of the original distance",
    # index / search / serve / remove
    "--index-type": "the vector index of a Milvus collection",
    "--index-param": "a Milvus index build parameter",
    "--add": "add to an existing index",
    "--shard-size": "images per resumable shard",
    "--store-dtype": "the type of the stored vectors",
    "--ann": "an approximate faiss index",
    "--ann-param": "an ANN search parameter",
    "--ann-on": "the vectors the ANN searches",
    "--calibration-texts": "captions the ANN calibrates on",
    "--top-k": "hits per query",
    "--image-root": "where indexed images live now",
    "--view": "only crops of this view",
    "--camera": "only crops of these cameras",
    "--after": "only crops at or after this time",
    "--before": "only crops before this time",
    "--tag": "only crops with this tag",
    "--image": "a crop of the person to search with",
    "--like": "a gallery hit to search with, by its id",
    "--track": "a gallery track to search with (CAMERA:TRACK)",
    "--set-rule": "how a set of query crops scores a crop",
    "--text-weight": "weight of the text score in fusion",
    "--reid-model": "a ViSA model for re-identification embeddings",
    "--add-embeddings": "embeddings to add to an existing gallery",
    "--query-view": "the view of the query crops (for ViSA)",
    "--per-crop": "one hit per crop",
    "--group-by": "a per-camera timeline",
    "--min-score": "lowest score on a timeline",
    "--gap": "pause marked on a timeline",
    "--html": "an HTML page of the hits",
    "--png": "a PNG contact sheet of the hits",
    "--json": "JSON output",
    # ingest
    "--crops": "the crops folder of an ingested gallery",
    "--cameras": "a camera file",
    "--detector": "the person detector",
    "--detections": "boxes from elsewhere",
    "--detector-threshold": "detector score threshold",
    "--min-box-size": "smallest box side",
    "--max-boxes": "boxes kept per frame",
    "--fps": "frames taken per second of footage",
    "--frame-rate": "frames per second of a frame folder",
    "--crops-per-track": "best crops kept per track",
    "--min-track-frames": "shortest track kept",
    "--min-track-score": "lowest mean track score kept",
    "--reconnect": "stream reconnect tries",
    "--duration": "seconds read from each source",
    "--max-frames": "frames read from each source",
    "--flush-seconds": "stream gallery flush interval",
    "--stall-timeout": "seconds of silence that drop a stream",
    "--backoff": "first reconnect wait",
    # push
    "--repo-id": "the Hub repository",
    "--private": "a private Hub repository",
    "--token": "a Hub token",
    "--eval-results": "the results file for the card",
    "--training-config": "the training config for the card",
    "--adapter": "an extra LoRA adapter folder",
    "--dataset-name": "the dataset name on the card",
    "--template": "a model card template",
    "--no-handler": "no Inference Endpoints handler",
    "--ablation": "an ablation results folder",
    "--commit-message": "the Hub commit message",
    "--stage-dir": "where the staged files are kept",
    # export / convert
    "--opset": "the ONNX opset",
    "--block-type": "the vision block type",
    "--no-view-token": "no view token",
    "--moe-layers": "the expert blocks",
    "--num-identities": "ID classifier classes",
    "--vision-heads": "vision attention heads",
    "--text-heads": "text attention heads",
    # dtg
    "--id-from": "where an image's person id comes from",
    "--cam-id": "the view of every image",
    "--attributes": "attribute labels per image",
    "--templates": "caption templates",
    "--max-new-tokens": "longest caption",
    "--do-sample": "sample instead of greedy decoding",
    "--temperature": "sampling temperature",
    "--top-p": "nucleus sampling mass",
    "--force-resume": "resume despite changed settings",
    "--quality-check": "label each caption's quality",
    "--qc-model": "the quality-check model",
    "--filter": "keep only matching captions",
    # ablate
    "--study": "which ablation study",
    "--seeds": "seeds per variant",
    "--variants": "which variants",
    "--shard": "this process's share of the runs",
    "--report-only": "only write the report",
    "--launch": "the command prefix that runs tagclip",
}

# verb -> {old name: the name it now has}: each old name (both spellings) stays a hidden alias, so documented
# commands, training/train.py and scripts keep working (eval's --amp maps its values: none -> fp32)
RENAMED: dict[str, dict[str, str]] = {
    "train": {
        "--output-dir": "--output",
        "--data-dir": "--data",
        "--per-device-batch-size": "--batch-size",
        "--num-workers": "--workers",
        "--model": "--model-config",
    },
    "eval": {"--num-workers": "--workers", "--amp": "--dtype"},
    "index": {"--out": "--output"},
    "ingest": {"--out": "--output"},
    "dtg": {"--out": "--output", "--no-progress": "--quiet"},
    "ablate": {"--out": "--output"},
    "push": {"--checkpoint": "--model"},  # --checkpoint is a foreign checkpoint to convert
}


def alias(parser: argparse.ArgumentParser, flag: str, *old: str) -> argparse.ArgumentParser:
    """Make each ``old`` name (both spellings) a hidden alias of ``flag``: it parses to the same action and
    destination, and neither ``--help`` nor errors show it."""
    action = parser._option_string_actions[flag]
    for name in old:
        for spelling in (name, "--" + name[2:].replace("-", "_")):
            parser._option_string_actions.setdefault(spelling, action)
    return parser


def accept_both_spellings(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the other spelling (`_` <-> `-`) of every long option of `parser` and its subcommands."""
    for action in list(parser._actions):
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                accept_both_spellings(sub)
            continue
        for flag in list(action.option_strings):
            if not flag.startswith("--"):
                continue
            body = flag[2:]
            for other in ("--" + body.replace("-", "_"), "--" + body.replace("_", "-")):
                if other not in parser._option_string_actions:  # a silent alias: help and errors keep the
                    parser._option_string_actions[other] = action  # spelling the command documents
    return parser


class _PositionalAlias(argparse.Action):
    """A hidden positional that fills a flag's destination when the flag is not given (``MODEL`` for ``--model``)."""

    def __init__(self, option_strings, dest, target: str = "", **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.target = target

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.target, None) is None:
            setattr(namespace, self.target, values)


def path_flag(
    parser: argparse.ArgumentParser, flag: str, positional: str, help: str, required: bool = True, **kwargs
) -> argparse.Action:
    """``flag`` (e.g. ``--output``), also accepted as the hidden positional ``positional`` at this place on the
    command line; ``required``: one of the two must be given (checked by ``check_required``)."""
    action = parser.add_argument(flag, default=None, help=help, **kwargs)
    action.required_flag = required
    parser.add_argument(
        positional,
        nargs="?",
        default=argparse.SUPPRESS,
        action=_PositionalAlias,
        target=action.dest,
        help=argparse.SUPPRESS,
    )
    return action


def check_required(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error when a ``path_flag`` that must be given (as a flag or a positional) is missing,
    in ``parser`` or the subcommand ``args`` chose."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                check_required(chosen, args)
        elif getattr(action, "required_flag", False) and getattr(args, action.dest, None) is None:
            parser.error(f"the following arguments are required: {action.option_strings[0]}")


def unknown_option(parser: argparse.ArgumentParser, word: str) -> str:
    """``unknown option '--x'; did you mean '--y'?``: the closest flag of ``parser`` and its subcommands."""
    flag = word.split("=")[0]
    options = [name for name in _option_names(parser) if name.startswith("--")]
    spelled = [name for name in options if ("_" in name) == ("_" in flag)]  # answer in the spelling typed
    match = difflib.get_close_matches(flag, spelled, n=1, cutoff=0.6) or difflib.get_close_matches(
        flag, options, n=1, cutoff=0.6
    )
    if not flag.startswith("-"):
        return f"unexpected argument {word!r}"
    return f"unknown option {flag!r}" + (f"; did you mean {match[0]!r}?" if match else "")


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    names = list(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names += _option_names(sub)
    return names


def visible_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long flag ``--help`` shows, in ``parser`` and its subcommands: flag -> its action."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.update(visible_flags(sub))
        elif action.help is not argparse.SUPPRESS:
            found.update({flag: action for flag in action.option_strings if flag.startswith("--")})
    return found


def finish(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    """What every verb's parser gets once its arguments are added: defaults in ``--help``, the old names of
    renamed flags and the underscore spellings as hidden aliases."""
    for old, new in RENAMED.get(verb, {}).items():
        alias(parser, new, old)
    return accept_both_spellings(show_defaults(parser))


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s reading of ``argv``: an unknown option is one usage line naming the closest flag, and a
    flag that may also be given as a positional is checked."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.exit(2, f"{parser.prog}: error: {unknown_option(parser, extra[0])}\n")
    check_required(parser, args)
    return args


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Append ``(default: V)`` to the help of every argument of ``parser`` and its subcommands that has a default
    its help does not already give (none for flags that are off, or unset, by default)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
        elif has_default(action) and "default" not in (action.help or "").lower():
            action.help = f"{action.help} (default: %(default)s)"
    return parser


def has_default(action: argparse.Action) -> bool:
    """Whether ``action`` has a default worth showing: not None, False, [] or suppressed."""
    default = action.default
    return not (default is None or default is False or default is argparse.SUPPRESS or default == [])


def _integer(text: str) -> int | None:
    """``text`` as a decimal integer (surrounding spaces and a leading ``+`` allowed), else None."""
    body = text.strip()
    digits = body[1:] if body[:1] in "+-" and len(body) > 1 else body
    return int(body) if digits.isascii() and digits.isdigit() else None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a batch size, a count)."""
    value = _integer(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (e.g. DataLoader worker processes)."""
    value = _integer(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def integer(text: str) -> int:
    """argparse type: any integer (a seed)."""
    value = _integer(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1] (a share of the data, a probability)."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text!r}")
    return value


def torch_device(text: str) -> str:
    """argparse type: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ...)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from error
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if device.type != "cpu" and (device.index or 0) >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} {device.type} device(s)")
    return text


EVAL_TASK_HELP = "retrieval (TAG-CLIP, text -> person) or reid (ViSA, image -> person)"


def usage_error(prog: str, message: str) -> None:
    """A usage mistake found after parsing: one ``PROG: error: MESSAGE`` line, exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _RenamedValues(argparse.Action):
    """A hidden old flag whose values are spelled differently: each is stored, translated, in the new flag's
    destination (``--amp none`` -> ``dtype = "fp32"``)."""

    def __init__(
        self, option_strings, dest, target: str = "", mapping: dict[str, str] | None = None, **kwargs
    ):
        super().__init__(option_strings, dest, **kwargs)
        self.target, self.mapping = target, dict(mapping or {})

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.target, self.mapping[values])


def renamed_values(parser, old: str, dest: str, mapping: dict[str, str]) -> None:
    """Keep ``old`` as a hidden flag that sets ``dest`` through ``mapping`` (old value -> new value)."""
    parser.add_argument(
        old,
        choices=list(mapping),
        action=_RenamedValues,
        target=dest,
        mapping=mapping,
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
