"""Deprecated: ViSA training is ``training/train.py --task reid`` (same flags as TAG-CLIP; see ``--help``).

``python -m training.train_reid ARGS`` runs ``training/train.py --task reid ARGS``; the former flag spellings
(``--output-dir``, ``--epochs``, ``--lr``, ``--recipe``, ``--resume`` ...) are accepted with a warning.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    from training.train import main as train_main

    warnings.warn(
        "training.train_reid is deprecated: use training/train.py --task reid", FutureWarning, stacklevel=2
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    return train_main(["--task", "reid", *argv])


if __name__ == "__main__":
    main()
