"""``python -m modeling_tagclip.cli VERB ...`` (what ``accelerate launch -m`` and ``torchrun -m`` run)."""

import sys

from modeling_tagclip.cli import main

sys.exit(main())
