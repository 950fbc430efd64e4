"""core/malloc.py: a training process keeps freed memory, so a step's large arrays do not page-fault in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = """
import json, resource, sys, torch
from lrattn_lightning.core.malloc import keep_freed_memory
kept = keep_freed_memory()
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(2048, 4096)  # 32 MiB, as the logits of `small`
    y = x * 2
    del x, y
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = [faults_of_one_step() for _ in range(12)]
print(json.dumps({"kept": kept, "faults": faults[4:]}))  # after the heap has grown to the steps' pattern
"""


def probe(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_training_process_reuses_freed_pages():
    """Two 32 MiB arrays a step are 16,384 pages: page-faulted in every step with glibc's defaults (LRATTN_MALLOC=
    system); with the thresholds raised, once the heap has grown to the steps' pattern (a few steps: torch's
    aligned allocations leave gaps), mostly reused. Steps 5-12, as totals."""
    pages = 2 * 32 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    tuned, system = probe(), probe(LRATTN_MALLOC="system")
    assert tuned["kept"] and not system["kept"]
    assert min(system["faults"]) > pages // 2
    assert sum(tuned["faults"]) < sum(system["faults"]) // 3, (tuned, system)


def test_the_training_commands_set_it():
    from lrattn_lightning.cli import lightning

    assert "keep_freed_memory()" in open(lightning.__file__).read().split("def run_lightning", 1)[1].split("\ndef ", 1)[0]
