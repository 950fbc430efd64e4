"""Hostile tokenizer files (issue 53): one line for a tokenizer that fails, a signal honoured while a slow one
runs, and a vocabulary bound checked before the file is loaded.

The files are built here with `tokenizers`: a WordLevel model whose `Split` pre-tokenizer regex backtracks
catastrophically on a long run of 'a' (`(a+)+$`: Oniguruma's retry limit, a Rust panic), or merely slowly
(`\\w*\\d`: quadratic, about 100 s for 80,000 characters); a vocabulary one entry above the registry's largest.
Failures and signals are checked on real `lrattn prepare` processes.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.data.tokenizer import EOS_TOKEN, HFTokenizer, TokenizerFailed, check_vocabulary
from lrattn_lightning.model.registry import load_registry

CATASTROPHIC = r"(a+)+$"  # on 'a' * 30 + 'c': Onig: Regex search error: retry-limit-in-match over (a panic)
SLOW = r"\w*\d"  # on 'a' * n: every start scans to the end; n = 200,000 takes minutes, and never panics


def hostile(path: Path, pattern: str, words: int = 0) -> Path:
    """A tokenizer.json: WordLevel over a few words (+ `words` more), its pre-tokenizer a Split on `pattern`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {EOS_TOKEN: 0, "[UNK]": 1, "a": 2, "c": 3, **{f"w{i}": 4 + i for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.add_special_tokens([EOS_TOKEN])
    tok.save(str(path))
    return path


def corpus(path: Path, text: str, copies: int = 20) -> Path:
    with open(path, "w") as f:
        for i in range(copies):
            f.write(json.dumps({"text": f"{text} {i}"}) + "\n")
    return path


def lrattn(*args: str, cwd: Path) -> subprocess.Popen:
    """`lrattn ARGS` in its own session (its workers with it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_BACKTRACE": "1",  # the backtrace the fix must not print
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "lrattn_lightning.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finished(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s: {err[-2000:]}")
    return proc.returncode, err


# ------------------------------------------------------------------------------------ a tokenizer that fails
def test_a_panic_inside_the_tokenizer_is_one_picklable_error(tmp_path, capfd):
    tok = HFTokenizer(hostile(tmp_path / "evil.json", CATASTROPHIC))
    assert tok.encode_batch(["c aaa"]) == [[1, 1]]  # a short text: fine ("c " and "aaa", unknown words)
    with pytest.raises(TokenizerFailed, match="retry-limit-in-match") as failed:
        tok.encode_batch(["a" * 30 + "c"])
    with pytest.raises(TokenizerFailed, match="retry-limit-in-match"):
        tok.encode("a" * 30 + "c")
    assert "backtrace" not in capfd.readouterr().err  # Rust's panic hook wrote into the held descriptor
    again = pickle.loads(pickle.dumps(failed.value))  # a worker sends it to the parent
    assert isinstance(again, InputError) and str(again) == str(failed.value)


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_with_a_panicking_tokenizer_is_one_line(tmp_path, workers):
    """It was a 120-line Rust backtrace and pyo3's PanicException (with two workers a PicklingError)."""
    hostile(tmp_path / "evil.json", CATASTROPHIC)
    corpus(tmp_path / "docs.jsonl", "a" * 30 + "c")
    code, err = finished(lrattn("prepare", "--source", "docs.jsonl", "--tokenizer", "hf:evil.json", "--out", "out",
                                "--num_workers", str(workers), cwd=tmp_path))
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("lrattn: error: tokenizer "), err[-3000:]
    assert "retry-limit-in-match" in lines[-1] and "fix the tokenizer file" in lines[-1], err[-3000:]
    assert all(line.startswith("[lrattn prepare]") for line in lines[:-1]), err[-3000:]  # no backtrace, no traceback
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*")), list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------ a signal while it runs
@pytest.mark.parametrize("signum, workers", [(signal.SIGTERM, 1), (signal.SIGINT, 2)])
def test_a_signal_stops_prepare_inside_a_slow_tokenizer_at_once(tmp_path, signum, workers):
    """A slow pre-tokenizer regex held the process in Rust, where Python runs no signal handler: SIGTERM waited
    37-92 s. Now the parent waits for its workers a fraction of a second at a time and ends them."""
    hostile(tmp_path / "slow.json", SLOW)
    corpus(tmp_path / "docs.jsonl", "a" * 200_000, copies=4)  # minutes for each document
    proc = lrattn("prepare", "--source", "docs.jsonl", "--tokenizer", "hf:slow.json", "--out", "out",
                  "--num_workers", str(workers), cwd=tmp_path)
    try:
        staging = tmp_path / ".out.tmp-prepare"
        batch = staging / ".prepare" / "batches" / "0.npy"  # a worker makes it as it starts the first batch
        for wanted, seconds in ((staging / "tokenizer.json", 240), (batch, 5)):  # (no batch file in one process)
            deadline = time.monotonic() + seconds
            while not wanted.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        assert proc.poll() is None and (staging / "tokenizer.json").exists(), proc.communicate()[1][-3000:]
        time.sleep(1.0)  # well inside the regex
        sent = time.monotonic()
        os.kill(proc.pid, signum)
        code, err = finished(proc, timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert code == 128 + signum and f"stopped by {signal.Signals(signum).name}" in err, err[-3000:]
    assert took < 5, f"{took:.1f} s from the signal to the exit"  # about 0.3 s on an idle machine
    assert "Traceback" not in err and "backtrace" not in err, err[-3000:]
    assert not (tmp_path / "out").exists()  # nothing published; the staging folder is kept for the same command
    with pytest.raises(ProcessLookupError):  # no worker outlives it (the session's processes are gone)
        for _ in range(50):
            os.killpg(proc.pid, 0)
            time.sleep(0.1)


# ------------------------------------------------------------------------------------ a vocabulary too large
def test_the_vocabulary_is_counted_before_the_file_is_loaded(tmp_path):
    largest = max(size.vocab_size for size in load_registry().sizes.values())
    path = hostile(tmp_path / "big.json", r"\s+", words=largest - 3)  # 4 + largest - 3 = largest + 1 ids
    with pytest.raises(InputError, match=rf"{largest + 1:,} vocabulary entries, more than {largest:,}; pass --max_vocab"):
        check_vocabulary("hf", path, largest)
    assert check_vocabulary("hf", path, largest + 1) == largest + 1
    # past the size bound the file is not even parsed: 17 MB of zeros, refused by its size
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(17 << 20)
    with pytest.raises(InputError, match=r"is 18 MB: more than a vocabulary of at most 100 entries .*--max_vocab"):
        check_vocabulary("hf", huge, 100)
    ranks = tmp_path / "big.tiktoken"
    ranks.write_text("".join(f"YQ== {i}\n" for i in range(12)))
    with pytest.raises(InputError, match="12 vocabulary entries, more than 11"):
        check_vocabulary("tiktoken", ranks, 11)


def test_prepare_refuses_a_vocabulary_larger_than_the_registry_before_any_work(tmp_path):
    largest = max(size.vocab_size for size in load_registry().sizes.values())
    hostile(tmp_path / "big.json", r"\s+", words=largest - 3)
    corpus(tmp_path / "docs.jsonl", "a c")
    code, err = finished(lrattn("prepare", "--source", "docs.jsonl", "--tokenizer", "hf:big.json", "--out", "out",
                                cwd=tmp_path))
    assert code == 2 and err.strip().count("\n") == 0, err[-3000:]
    assert f"{largest + 1:,} vocabulary entries, more than {largest:,}" in err and "--max_vocab" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json", "docs.jsonl"]  # nothing written


def test_a_file_the_library_cannot_read_is_one_line(tmp_path):
    """Not JSON, no vocabulary: refused while it is counted; a regex Oniguruma cannot compile: when it is loaded."""
    (tmp_path / "notes.json").write_text("not json at all\n")
    with pytest.raises(InputError, match="is not a tokenizer.json with a model vocabulary: JSONDecodeError"):
        check_vocabulary("hf", tmp_path / "notes.json", 1000)
    broken = json.loads(hostile(tmp_path / "broken.json", "a+").read_text())
    broken["pre_tokenizer"]["pattern"]["Regex"] = "(a"
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert check_vocabulary("hf", tmp_path / "broken.json", 1000) == 4
    with pytest.raises(InputError, match=r"^tokenizer \S+broken.json: not a tokenizer.json the tokenizers library reads"):
        HFTokenizer(tmp_path / "broken.json")


def test_a_bpe_larger_than_the_registry_is_refused_before_it_is_trained(tmp_path):
    from lrattn_lightning.data.prepare import prepare

    largest = max(size.vocab_size for size in load_registry().sizes.values())
    with pytest.raises(InputError, match=rf"bpe:{largest + 1}'.* more than {largest:,} .*--max_vocab N"):
        prepare(tmp_path / "docs.jsonl", tmp_path / "out", tokenizer=f"bpe:{largest + 1}")
    assert not list(tmp_path.iterdir())
