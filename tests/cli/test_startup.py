"""Commands that do not train start without Lightning: their --help (and list) import neither Lightning, torchmetrics
nor Dynamo (benchmarks/startup prints the times against a bare `import torch`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("lightning", "torchmetrics", "torch._dynamo", "lm_eval", "matplotlib")
PROBE = """
import json, sys
from lrattn_lightning.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""
LIGHT = ["--help", "list", "prepare --help", "eval --help", "generate --help", "chat --help", "export --help",
         "sweep --help", "compare --help", "bench --help", "fidelity --help", "demo --help"]


def imported(command: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *command.split()], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", LIGHT)
def test_a_command_that_does_not_train_imports_no_lightning(command):
    assert imported(command) == []


def test_the_probe_sees_lightning_where_it_is_imported():
    """fit's --help is LightningCLI's own: the probe must see Lightning there (it can tell)."""
    assert "lightning" in imported("fit --help")
