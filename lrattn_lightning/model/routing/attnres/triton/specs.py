"""Moved: the launch specs and their compile check are tools (lrattn_lightning/tools/kernels/), since the kernels
never import the modules that use them. Running this module says so in one line (exit 2); importing it fails
with the same line."""

import sys

MOVED = ("lrattn_lightning.model.routing.attnres.triton.specs moved to lrattn_lightning.tools.kernels.specs: "
         "run python -m lrattn_lightning.tools.kernels.specs with the same flags")

if __name__ == "__main__":
    print(MOVED, file=sys.stderr)
    sys.exit(2)
raise ImportError(MOVED)
