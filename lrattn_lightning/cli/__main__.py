"""`python -m lrattn_lightning.cli`: the `lrattn` command (what tests and DDP's re-executed ranks call)."""

import sys

from lrattn_lightning.cli import main

sys.exit(main())
