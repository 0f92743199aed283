"""``accelerate launch training/train.py [FLAGS]``: the training command as a file (``tagclip train`` is the same
code; ``modeling_tagclip.engine.cli``). ``--help`` lists every setting, ``--list-configs`` the shipped recipes.

Examples::

    accelerate launch training/train.py
    accelerate launch training/train.py --config tag-pedes --init-from models/clip-init
    accelerate launch training/train.py --resume-from-checkpoint latest
    accelerate launch training/train.py --set model.vision_config.num_hidden_layers=4 --learning-rate 2e-3
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 training/train.py   # 2 gloo ranks
    accelerate launch training/train.py --task reid --output outputs/visa-synthetic           # ViSA re-ID
    accelerate launch training/train.py --config visa-cargo --data datasets/CARGO
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file from a checkout: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_tagclip.engine.cli import command, load_config, main, make_task  # noqa: E402

__all__ = ["load_config", "main", "make_task"]

if __name__ == "__main__":
    sys.exit(command(prog="train.py"))
