"""`lrattn prepare` as a process (issues 28 and 29): killed, stopped, run twice at once, run on a corpus 10x
larger; what it leaves and what the next run does.

Real processes and real signals: a prepare tokenising a 4 MB JSONL corpus with a BPE tokenizer in two worker
processes, its parts made small (80 kB) so that a kill lands between parts. A SIGKILL or a SIGTERM leaves no
folder that `fit` accepts and no worker process; the same command continues from the finished parts (one
line), interrupted again in each way in turn, to shards byte-identical to an uninterrupted run. A second prepare
of the same --out is one line while the first runs. Leftovers nobody holds are removed with one line; one a live
process holds is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.prepare import (
    JSONL_ARGS,
    PART_BYTES,
    gone,
    prepare_env,
    prepare_in_parts,
    processes_naming,
    wait_for_part,
)

from lrattn_lightning.data import pipeline
from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.data.shards import read_meta, validate_data_dir
from lrattn_lightning.model.registry import load_registry


def start(args: list[str], cwd: Path, session: bool = False) -> subprocess.Popen:
    """The prepare as a process (in a session of its own: its own process group), SIGINT at its default as in a
    terminal (a test process may ignore it)."""
    return subprocess.Popen(prepare_in_parts(*args), cwd=cwd, env=prepare_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=session,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.fixture(scope="module")
def uninterrupted(jsonl_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "data"
    saved = pipeline.PART_BYTES
    pipeline.PART_BYTES = PART_BYTES
    try:
        prepare(str(jsonl_corpus / "corpus.jsonl"), out, tokenizer=f"hf:{jsonl_corpus / 'tok.json'}")
    finally:
        pipeline.PART_BYTES = saved
    return out


def chunks(out: Path) -> dict[str, str]:
    meta = read_meta(out)
    return {f"{s}/{n}": r["sha256"] for s in ("train", "val") for n, r in meta["checksums"][s].items() if n != "index.json"}


# the ways a prepare is interrupted, in the order one prepare meets them (each once a part of its own is finished:
# a signal before its handlers are set would say nothing)
INTERRUPTIONS = ["SIGKILL", "SIGTERM", "SIGINT", "SIGTERM to its process group", "SIGINT to its process group",
                 "a worker SIGKILLed"]


def finished_parts(staging: Path) -> list[int]:
    parts = staging / ".prepare" / "parts"
    return sorted(int(p.stem) for p in parts.glob("*.json")) if parts.is_dir() else []


def test_an_interrupted_prepare_continues_to_the_same_shards(jsonl_corpus, uninterrupted, tmp_path):
    """One prepare interrupted six times, each run of the same command continuing from the parts the last one
    finished, then run to its end: SIGKILL (nothing runs after it), SIGTERM (exit 143, one line naming it), SIGINT
    (Ctrl-C: exit 130, its line), SIGTERM to the process group as SLURM sends it and SIGINT to it as a terminal's
    Ctrl-C does (the two tokenizer workers get it too: still the exit and the line of the signal), a worker killed
    under it (the OOM killer's way: one line, exit 1; multiprocessing.Pool would have waited for the lost batch
    forever). After each: no worker left, nothing `fit` accepts. The end: shards byte-identical to an uninterrupted
    run's."""
    out = "out-interrupted-six-ways"  # unique: processes_naming finds its processes by it
    args = [*JSONL_ARGS, "--out", out]
    (tmp_path / "corpus.jsonl").symlink_to(jsonl_corpus / "corpus.jsonl")
    (tmp_path / "tok.json").symlink_to(jsonl_corpus / "tok.json")
    staging = tmp_path / f".{out}.tmp-prepare"
    kept = 0  # parts the previous run finished, at least

    def continued(err: str) -> None:
        resumed = [line for line in err.splitlines() if "continuing" in line]
        assert len(resumed) == 1 and f".{out}.tmp-prepare" in resumed[0], (how, err)
        assert int(resumed[0].split(": ")[1].split(" part")[0]) >= kept  # parts 0..n at least were kept

    for how in INTERRUPTIONS:
        first_new = max(finished_parts(staging), default=-1) + 1
        proc = start(args, tmp_path, session=how.endswith("group"))
        wait_for_part(staging, first_new, proc)
        signum = getattr(signal, how.split()[0], None)
        if how.endswith("group"):
            os.killpg(proc.pid, signum)
        elif how == "a worker SIGKILLed":
            workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            assert len(workers) == 2
            os.kill(int(workers[0]), signal.SIGKILL)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        if kept:
            continued(err)
        lines = [line for line in err.splitlines() if line.strip()]
        if how == "SIGKILL":
            assert proc.returncode == -signal.SIGKILL, err
        if how.startswith(("SIGTERM", "SIGINT")):
            name = how.split()[0]
            assert proc.returncode == 128 + signum, (how, err)
            assert [line for line in lines if line.startswith("[lrattn prepare] stopped")] == [lines[-1]], (how, err)
            assert lines[-1] == (f"[lrattn prepare] stopped by {name}: the finished parts are kept; run the same "
                                 "command to continue from them") and "Traceback" not in err, (how, err)
        if how == "a worker SIGKILLed":
            assert proc.returncode == 1 and "Traceback" not in err, err
            assert lines[-1] == ("lrattn: error: a tokenizer process died (killed by the system: out of memory? see "
                                 "`dmesg`); the finished parts are kept: run the same command to continue from them")
        assert gone(out), (how, processes_naming(out))  # the workers go with their parent
        # nothing `fit` accepts: no --out folder, and the staging folder has no meta.json
        assert not (tmp_path / out).exists() and not (staging / "meta.json").exists(), how
        with pytest.raises(ValueError, match="meta.json is missing"):
            validate_data_dir(staging, load_registry().size("tiny"))
        kept = len(finished_parts(staging))
    again = subprocess.run(prepare_in_parts(*args), cwd=tmp_path, env=prepare_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    continued(again.stderr)
    assert chunks(tmp_path / out) == chunks(uninterrupted)
    assert read_meta(tmp_path / out)["splits"] == read_meta(uninterrupted)["splits"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", out, "tok.json"]


def test_a_second_prepare_of_the_same_out_is_one_line_while_the_first_runs(jsonl_corpus, uninterrupted, tmp_path):
    (tmp_path / "corpus.jsonl").symlink_to(jsonl_corpus / "corpus.jsonl")
    (tmp_path / "tok.json").symlink_to(jsonl_corpus / "tok.json")
    first = start([*JSONL_ARGS, "--out", "data"], tmp_path)
    wait_for_part(tmp_path / ".data.tmp-prepare", 0, first)
    second = subprocess.run([sys.executable, "-m", "lrattn_lightning.cli", "prepare", *JSONL_ARGS, "--out", "data"],
                            cwd=tmp_path, env=prepare_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lrattn: error: --out data is being written by another `lrattn "
                                                   f"prepare` (pid {first.pid} on "), lines
    assert "wait for it to finish, or choose another --out" in lines[0]
    assert first.wait(timeout=300) == 0, first.communicate()
    assert chunks(tmp_path / "data") == chunks(uninterrupted)


def test_leftovers_nobody_holds_are_removed_and_a_live_one_is_not(tmp_path, capsys):
    """Issue 28: a SIGKILLed prepare left `.NAME.tmp-*` folders that nothing removed."""
    import fcntl

    (tmp_path / "a.txt").write_text("one document of text\n")
    (tmp_path / "b.txt").write_text("another document of text\n")
    for name in (".data.tmp-k2j4h1", ".data.old-x8x8x8", ".data.tmp-live"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "chunk-0-0.bin").write_bytes(b"partial")
    held = os.open(tmp_path / ".data.tmp-live", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a live prepare holds its folder
    (tmp_path / ".data.tmp-prepare" / ".prepare").mkdir(parents=True)  # a dead prepare's, of other arguments
    (tmp_path / ".data.tmp-prepare" / ".prepare" / "recipe.json").write_text('{"source": ["elsewhere"]}')
    try:
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path / "data", val_fraction=0.5, cloze_items=0,
                perplexity_documents=0)
    finally:
        os.close(held)
    err = capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.tmp-live", "a.txt", "b.txt", "data"]
    assert f"[lrattn prepare] emptied {tmp_path / '.data.tmp-prepare'}, left by an interrupted prepare of other " \
           "arguments or inputs; starting afresh" in err
    for name in (".data.tmp-k2j4h1", ".data.old-x8x8x8"):
        assert f"[lrattn prepare] removed {tmp_path / name}, left by an interrupted `lrattn prepare`" in err
    assert (tmp_path / ".data.tmp-live" / "chunk-0-0.bin").read_bytes() == b"partial"


# ---------------------------------------------------------------------------------------------- memory


def write_corpus(path: Path, n_bytes: int, seed: int) -> None:
    """JSONL documents of 150 random words from a 5000-word vocabulary (different text throughout)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)])
    with open(path, "w") as f:
        size = 0
        while size < n_bytes:
            line = json.dumps({"text": " ".join(vocab[rng.integers(0, len(vocab), size=150)])}) + "\n"
            f.write(line)
            size += len(line)


PEAK = ("import resource, sys; from lrattn_lightning.cli import main; code = main(['prepare', *sys.argv[1:]]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")


@pytest.mark.slow
def test_a_corpus_ten_times_larger_prepares_in_about_the_same_memory(tmp_path):
    """Peak RSS of `lrattn prepare` on 3 MB and on 30 MB of JSONL (1 MB chunks; 20 % held out, so both keep as
    many held-out documents for the eval tasks as they may): the larger corpus may not need more than a few MB
    more, while holding its text in memory would take 27 MB more (and its token ids 54 MB)."""
    peaks = {}
    for name, size in (("small", 3_000_000), ("large", 30_000_000)):
        write_corpus(tmp_path / f"{name}.jsonl", size, seed=1)
        done = subprocess.run([sys.executable, "-c", PEAK, "--source", f"{name}.jsonl", "--out", f"out-{name}",
                               "--chunk_bytes", "1MB", "--val_fraction", "0.2"], cwd=tmp_path, env=prepare_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        peaks[name] = int(done.stdout.strip().splitlines()[-1])  # kB
        assert read_meta(tmp_path / f"out-{name}")["splits"]["train"]["bytes"] > 0.7 * size
    assert peaks["large"] - peaks["small"] < 12_000, peaks


def test_an_out_that_appears_while_preparing_is_one_line_and_left_alone(tmp_path, monkeypatch, capsys):
    """Two prepares of one --out, the first finished between the second's start and its end: the second says so
    in one line (it was a FileExistsError traceback) and leaves the first's folder as it is."""
    from lrattn_lightning.cli import main
    from lrattn_lightning.data import prepare as prepare_module

    real = prepare_module.publish

    def first_finished(staging, out, overwrite):
        out.mkdir()
        (out / "meta.json").write_text("{}")
        return real(staging, out, overwrite)

    monkeypatch.setattr(prepare_module, "publish", first_finished)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "--max_documents", "5", "--out", "data"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lrattn:")]
    assert lines == ["lrattn: error: --out data appeared while this prepare ran (another one finished it first); it is "
                     "left as it is: pass --overwrite to replace it, or choose another --out"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"] and (tmp_path / "data" / "meta.json").read_text() == "{}"


def test_a_signal_inside_a_finaliser_still_stops_prepare():
    """CI at stop 37: SIGTERM landed inside litdata's TokensLoader.__del__, where Python prints and drops an
    exception, and prepare published its folder with exit 0. The handler now only records the signal; the next
    check_stop() raises, wherever the signal landed."""
    import gc

    from lrattn_lightning.data.staging import Interrupted, check_stop, stop_on_signals

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here: an exception would be dropped

    with stop_on_signals():
        check_stop()  # nothing received yet
        Finalised()
        gc.collect()
        with pytest.raises(Interrupted, match="SIGTERM"):
            check_stop()
    with stop_on_signals():
        check_stop()  # a new command line starts clean


def test_a_signal_waits_for_a_safe_point_and_a_second_one_does_not():
    """The first signal raises nothing where it lands (inside a pool's pipe write or a lock it would break
    things); check_stop() raises it. A second signal while the first waits raises at once. While a finished
    folder is published, signals wait and are then dropped (what they would stop is done)."""
    from lrattn_lightning.data import staging
    from lrattn_lightning.data.staging import Interrupted, check_stop, holding_signals, stop_on_signals

    with stop_on_signals():
        os.kill(os.getpid(), signal.SIGHUP)
        total = sum(range(100_000))  # work goes on after the handler ran
        with pytest.raises(Interrupted, match="SIGHUP"):
            check_stop()
        with pytest.raises(Interrupted, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)  # asked twice: now
            sum(range(100_000))
    assert total == 4999950000
    check_stop()  # outside stop_on_signals nothing is pending
    with stop_on_signals():
        with holding_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # not even a second one interrupts a publish
            sum(range(100_000))
            check_stop()
        check_stop()  # dropped: what it would have stopped is done
        assert staging._SIGNALS["pending"] is None


def test_a_workers_answer_is_a_message_the_pipe_writes_whole(jsonl_corpus, tmp_path):
    """ProcessPoolExecutor's reading thread waits forever on half a message, and a worker killed while writing a
    long answer leaves half of one (prepare hung after SIGTERM: once in a suite, once in 43 looped runs). The ids go
    through a file; the pipe's message, the file's name, is shorter than PIPE_BUF, so Linux writes it whole."""
    import pickle
    import select
    from concurrent.futures.process import _ResultItem

    from lrattn_lightning.data.tokenizer import encode_texts, load_tokenizer

    texts = [json.loads(line)["text"] for line in (jsonl_corpus / "corpus.jsonl").read_text().splitlines()]
    batch = []
    while sum(map(len, batch)) < pipeline.BATCH_BYTES and len(batch) < pipeline.BATCH_DOCUMENTS:
        batch.append(texts[len(batch)])
    kwargs = {"spec_json": json.dumps(load_tokenizer(f"hf:{jsonl_corpus / 'tok.json'}").spec()), "base_dir": str(jsonl_corpus),
              "dtype": "uint16"}
    whole = encode_texts(batch, **kwargs)
    assert len(pickle.dumps(_ResultItem(10**9, result=whole))) > 16 * select.PIPE_BUF  # what it used to send
    deep = tmp_path / ("a-long-folder-name-" * 8) / ".prepare" / "batches"
    deep.mkdir(parents=True)
    path = pipeline.encode_to_file(batch, [True] * len(batch), str(deep / "123456789.npy"), **kwargs)
    assert len(pickle.dumps(_ResultItem(10**9, result=path))) < select.PIPE_BUF
    answer = pipeline.load_answer(path)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(answer, whole, strict=True))
    assert list(deep.iterdir()) == []
