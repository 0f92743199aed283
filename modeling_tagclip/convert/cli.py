"""``tagclip convert hf-clip|tagpr|visa|vocab ...``: the converters' commands (``tagclip.py``, ``visa.py``,
``vocab.py``); ``tagclip convert --help`` lists them, ``tagclip convert KIND --help`` their options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def main(argv: Sequence[str] | None = None) -> Any:
    """Run the converter named by the first argument (its arguments parsed before the converter is imported)."""
    from modeling_tagclip.convert import arguments

    argv = list(argv or [])
    if argv[:1] == ["visa"]:
        args = arguments.parse_visa_args(argv[1:])
        from modeling_tagclip.convert.visa import run
    elif argv[:1] == ["vocab"]:
        args = arguments.parse_vocab_args(argv[1:])
        from modeling_tagclip.convert.vocab import run
    else:  # hf-clip, tagpr; its parser also lists visa and vocab in --help
        args = arguments.convert_parser().parse_args(argv)
        from modeling_tagclip.convert.tagclip import run
    return run(args)
