"""`lrattn prepare` at full size in real processes (issue 38): a document of tens of megabytes costs memory that does
not grow with it (the child's peak RSS measured) and stops at once on a signal; a disk too small is said before
writing, and one that fills while writing is one line and leaves nothing (a mount namespace with a small tmpfs).
The in-process tests at shrunk thresholds are ../data/test_data_scale.py.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT
from helpers.prepare import read_back

from lrattn_lightning.data.shards import read_meta

REPO = REPO_ROOT

MEASURE = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
           "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}


def _prepare_rss(args: list[str], cwd: Path) -> tuple[int, int, str]:
    """(exit status, the prepare process's peak RSS in MB, its stderr)."""
    done = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "lrattn_lightning.cli", "prepare",
                           *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    rss = int(done.stdout.split("maxrss")[-1]) // 1024
    return done.returncode, rss, done.stderr


@pytest.fixture(scope="module")
def huge(tmp_path_factory) -> tuple[Path, str]:
    """One document of 48 MB (words, escapes, non-ASCII) as a one-line JSONL and as a gzipped text file."""
    root = tmp_path_factory.mktemp("huge")
    rng = random.Random(2)
    words = "the of and to in \"quoted\" naïve café 日本語 😀 line\nbreak tab\tstop back\\slash".split(" ")
    text = " ".join(rng.choices(words, k=5_200_000))
    (root / "one.jsonl").write_text(json.dumps({"id": 7, "text": text, "meta": {"n": [1, 2]}}) + "\n")
    (root / "one.txt.gz").write_bytes(gzip.compress(text.encode(), compresslevel=1))
    (root / "val.jsonl").write_text("".join(json.dumps({"text": f"held out {i}"}) + "\n" for i in range(20)))
    (root / "tiny.jsonl").write_text(json.dumps({"text": "a tiny document"}) + "\n")
    return root, text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one.jsonl", "one.txt.gz"])
def test_memory_does_not_grow_with_a_document(huge, name):
    """The 48 MB document costs under 100 MB over a one-line corpus (as a whole it would be 48 MB of line, as much
    again of text, 96 MB of token ids and the tokenizer's copies: it peaked at 2 GB for 200 MB), and it is kept
    whole, byte for byte."""
    root, text = huge
    code, base, err = _prepare_rss(["--source", "tiny.jsonl", "--val_source", "val.jsonl", "--out", "base",
                                    "--overwrite"], root)
    assert code == 0, err[-2000:]
    code, peak, err = _prepare_rss(["--source", name, "--val_source", "val.jsonl", "--out", f"out-{name}"], root)
    assert code == 0, err[-2000:]
    assert peak - base < 100, f"{name}: peak RSS {peak} MB against {base} MB for a one-line corpus"
    train = read_back(root / f"out-{name}") - collections.Counter(f"held out {i}" for i in range(20))
    assert list(train.elements()) == [text]


@pytest.mark.slow
def test_a_signal_stops_the_reading_of_a_long_line_at_once(huge):
    """SIGTERM while a 48 MB line streams: exit 143 and its line within seconds (the old first-line check read such
    a line quadratically, ignoring signals for minutes); the same command then finishes it."""
    root, _ = huge
    args = [sys.executable, "-m", "lrattn_lightning.cli", "prepare", "--source", "one.jsonl", "--val_source",
            "val.jsonl", "--out", "stopped"]
    proc = subprocess.Popen(args, cwd=root, env=_env(), stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().startswith("[lrattn prepare] reading one.jsonl")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 143 and time.monotonic() - sent < 5, err
    assert "[lrattn prepare] stopped by SIGTERM" in err and not (root / "stopped").exists()
    done = subprocess.run(args, cwd=root, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and read_meta(root / "stopped")["splits"]["train"]["documents"] == 1, done.stderr


def _in_a_small_disk(script: str, cwd: Path, megabytes: int) -> subprocess.CompletedProcess:
    """`script` (sh) in a mount namespace whose ./disk is a tmpfs of `megabytes` (a real ENOSPC)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=1m tmpfs \"$0\"", str(cwd)], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here ({probe.stderr.decode().strip()[:200]})")
    (cwd / "disk").mkdir(exist_ok=True)
    full = f"mount -t tmpfs -o size={megabytes}m tmpfs disk && {script}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", full], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=600)


PREPARE = f"{sys.executable} -m lrattn_lightning.cli prepare"


@pytest.mark.slow
def test_a_disk_too_small_is_said_before_writing(tmp_path):
    text = "".join(f"line {i} of a corpus that needs more room than the disk has\n" for i in range(80_000))
    (tmp_path / "c.txt").write_text(text)  # 4.8 MB of text: 9.7 MB of uint16 ids
    done = _in_a_small_disk(f"{PREPARE} --source c.txt --document_separator '\\n' --out disk/out; "
                            "echo exit=$?; ls -A disk", tmp_path, 4)
    lines = done.stderr.strip().splitlines()
    assert "exit=2" in done.stdout and done.stdout.strip().endswith("exit=2"), (done.stdout, done.stderr)
    assert re.match(r"lrattn: error: the shards need about 11\.\d MB \(4\.9 MB of text, a token per 1 byte\(s\) of "
                    r"it, 2 bytes an id\) and disk has 4\.2 MB free; free space, choose another --out", lines[-1]), lines
    assert len(
        [line for line in lines if line.startswith("lrattn")]) == 1


@pytest.mark.slow
def test_a_disk_that_fills_while_writing_is_one_line_and_leaves_nothing(tmp_path):
    """The estimate holds (the first megabyte of the gzip is random letters, compressing 1.3:1), the rest does
    not (4 MB of one repeated line, 1000:1): ENOSPC midway is one line, and the unfinished folder is removed."""
    rng = random.Random(3)
    head = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz \n") for _ in range(1_200_000))
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress((head + "the same line again\n" * 200_000).encode()))
    done = _in_a_small_disk(f"{PREPARE} --source c.txt.gz --document_separator '\\n' --out disk/out; "
                            "echo exit=$?; ls -A disk", tmp_path, 5)
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("[lrattn prepare]")]
    assert done.stdout.strip() == "exit=2", (done.stdout, done.stderr[-3000:])  # and `ls -A disk` printed nothing
    assert len(lines) == 1 and lines[0].startswith("lrattn: error: no space left on the device of ") and \
        "the unfinished folder is removed" in lines[0], done.stderr[-3000:]
