"""One flag spelling for every command: each long flag answers to `--a_b` (the training commands' spelling,
as transformers' `TrainingArguments`) and to `--a-b`; and the argparse types the commands share."""

from __future__ import annotations

import argparse


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


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a batch size, a count)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (e.g. DataLoader worker processes)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return int(text)


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
