"""`python -m training.push_to_hub`: push a trained folder to the Hub with its model card (the code lives in `modeling_tagclip.hub.push_to_hub`)."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_tagclip.hub.push_to_hub import main

if __name__ == "__main__":
    main()
