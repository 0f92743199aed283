"""Convert OpenAI CLIP's ``bpe_simple_vocab_16e6.txt.gz`` into ``vocab.json`` + ``merges.txt`` with TAG-PR's mask.

The vocabulary is built exactly as OpenAI's ``simple_tokenizer.SimpleTokenizer``; then, as in TAG-PR, the
last merge token ``jekyll</w>`` (id 49405) is replaced by ``<|mask|>`` and its merge is dropped, so no text can
produce it. Usage: ``tagclip convert vocab --vocab SRC.txt.gz --output OUT_DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from functools import lru_cache
from pathlib import Path

from modeling_tagclip.convert.arguments import parse_vocab_args

NUM_MERGES = 49152 - 256 - 2
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")


@lru_cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode character table (same order as OpenAI's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def build_vocab(src: str | Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Return (token -> id, merges) with ``<|mask|>`` in place of the last merge token."""
    lines = gzip.open(src, "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
    units = list(bytes_to_unicode().values())
    tokens = units + [u + "</w>" for u in units] + ["".join(m) for m in merges] + list(SPECIAL_TOKENS)
    dropped = merges.pop()  # TAG-PR: the last merge token ("jekyll</w>") becomes <|mask|>
    tokens[-3] = MASK_TOKEN
    if "".join(dropped) != "jekyll</w>" or len(tokens) != 49408:
        raise ValueError(f"unexpected BPE file {src}: last merge {dropped}, {len(tokens)} tokens")
    return {t: i for i, t in enumerate(tokens)}, merges


def convert(src: str | Path, out_dir: str | Path) -> Path:
    """Write ``vocab.json`` and ``merges.txt`` (HF CLIP format) into ``out_dir``."""
    vocab, merges = build_vocab(src)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (out / "merges.txt").write_text(text, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point of ``tagclip convert vocab``."""
    run(parse_vocab_args(argv))


def run(args: argparse.Namespace) -> None:
    """Convert with parsed ``tagclip convert vocab`` arguments."""
    print(f"wrote {convert(args.vocab, args.output)}")
