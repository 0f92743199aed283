"""`python -m training.dtg`: DTG caption generation (the code lives in `modeling_tagclip.dtg`; `tagclip dtg`)."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_tagclip.dtg.cli import main

if __name__ == "__main__":
    main()
