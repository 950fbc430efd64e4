"""Commands that do not train start without Lightning: their --help (and list) import neither Lightning, torchmetrics
nor Dynamo (benchmarks/startup prints the times against a bare `import torch`)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("lightning", "torchmetrics", "torch._dynamo", "lm_eval", "matplotlib")
# each command of argv (one per argument, split at spaces) in turn, in one process: what of HEAVY is imported after it
PROBE = """
import contextlib, io, json, sys
from lrattn_lightning.cli import main
seen = {{}}
for command in sys.argv[1:]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(command.split())
        except SystemExit:
            pass
    seen[command] = sorted(m for m in {heavy!r} if m in sys.modules)
print(json.dumps(seen))
"""
LIGHT = ["--help", "list", "prepare --help", "eval --help", "generate --help", "chat --help", "export --help",
         "sweep --help", "compare --help", "bench --help", "fidelity --help", "demo --help"]


def imported(*commands: str) -> dict[str, list[str]]:
    """Command -> the heavy modules imported once it has run (in a new process, after the commands before it)."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *commands], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_command_that_does_not_train_imports_no_lightning():
    """Every command of LIGHT in turn in one new process (a heavy module a command imports shows right after it;
    one process instead of one a command: the imports are what each costs)."""
    seen = imported(*LIGHT)
    assert list(seen) == LIGHT
    assert {command: heavy for command, heavy in seen.items() if heavy} == {}


def test_the_probe_sees_lightning_where_it_is_imported():
    """fit's --help is LightningCLI's own: the probe must see Lightning there (it can tell), and after a command that
    imported none of it."""
    assert imported("list", "fit --help") == {"list": [], "fit --help": sorted(m for m in HEAVY if m != "lm_eval")}
