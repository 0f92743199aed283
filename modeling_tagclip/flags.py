"""One flag spelling for every command: each long flag answers to `--a_b` (the training commands' spelling,
as transformers' `TrainingArguments`) and to `--a-b`; and the argparse types every command uses (one
behaviour: ``positive_int`` reads "+3" and " 3 " as 3 in every command, and refuses "3.0", "0x3", "3_000")."""

from __future__ import annotations

import argparse
import math


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


EVAL_TASK_HELP = "retrieval (TAG-CLIP, text -> person; default) or reid (ViSA, image -> person)"


def add_task_flag(parser: argparse.ArgumentParser, task: str) -> None:
    """``tagclip eval``'s ``--task`` flag as each evaluator's ``--help`` shows it (the evaluator is chosen by then)."""
    parser.add_argument("--task", choices=("retrieval", "reid"), default=task, help=EVAL_TASK_HELP)
