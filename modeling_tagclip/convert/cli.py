"""``tagclip convert hf-clip|tagpr|visa|vocab ...``: the converters' command (``tagclip.py``, ``visa.py``,
``vocab.py``); ``tagclip convert --help`` lists the kinds, ``tagclip convert KIND --help`` their flags."""

from __future__ import annotations

import argparse
import importlib

from modeling_tagclip.convert.arguments import add_arguments

__all__ = ["add_arguments", "run"]

CONVERTERS = {"hf-clip": "tagclip", "tagpr": "tagclip", "visa": "visa", "vocab": "vocab"}


def run(args: argparse.Namespace) -> int:
    """Run the converter of the chosen kind (imported only now); the exit status."""
    importlib.import_module(f"modeling_tagclip.convert.{CONVERTERS[args.command]}").run(args)
    return 0
