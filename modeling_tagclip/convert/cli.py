"""``tagclip convert hf-clip|tagpr|visa|vocab ...``: the converters' commands (``tagclip.py``, ``visa.py``,
``vocab.py``); ``tagclip convert --help`` lists them, ``tagclip convert KIND --help`` their options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def main(argv: Sequence[str] | None = None) -> Any:
    """Run the converter named by the first argument."""
    argv = list(argv or [])
    if argv[:1] == ["visa"]:
        from modeling_tagclip.convert.visa import main as convert_visa

        return convert_visa(argv[1:])
    if argv[:1] == ["vocab"]:
        from modeling_tagclip.convert.vocab import main as convert_vocab

        return convert_vocab(argv[1:])
    from modeling_tagclip.convert.tagclip import main as convert_tagclip

    return convert_tagclip(argv)  # hf-clip, tagpr; its parser also lists visa and vocab in --help
