"""`lrattn sweep` on this machine: which runs are finished, claiming a run, running the rest one after another
or N at once (`--parallel N`).

A run is *finished* when the MLflow experiment holds a FINISHED run of its name tagged with its size, ablation,
variant and seed (whichever sweep file of the experiment ran it). Each unfinished run is its own `lrattn fit`
process in the sweep's environment (`run_env`: the sweep's `env`, its PYTHONPATH appended), started after every
external router the sweep names was imported there (`check_routers`); its whole output goes to its run folder's
fit.log and the terminal shows one line when it starts, its progress lines (not with --parallel N > 1: runs at
once would interleave them) and one result line, and at the end the `lrattn compare` command for the experiment. Two sweeps of one experiment may run at once: each run is
claimed (a lock in its run folder) right before it starts and MLflow asked again.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import one_line
from lrattn_lightning.core.files import PACKAGE_ROOT, append_file
from lrattn_lightning.model.registry import Registry
from lrattn_lightning.tools.sweep.file import Sweep, SweepError, SweepRun
from lrattn_lightning.train.checkpoint.stop import STOP_SIGNALS, detach_hung_up_terminal
from lrattn_lightning.train.schema import Tag


# ---- state -----------------------------------------------------------------------------------------
def finished_runs(sweep: Sweep, tracking_uri: str) -> set[SweepRun]:
    """Runs of this sweep that MLflow holds as FINISHED: a run of the experiment with the run's name (its
    folder) and tags size, ablation, seed (and variant), whichever sweep file ran it: two sweeps of one
    experiment that share a run (a screen's seed-0 runs reused by the study) share its folder and its result."""
    from lrattn_lightning.train.store import sqlite_file, store_lock

    db = sqlite_file(tracking_uri)
    if db is not None and not db.exists():  # nothing has finished there; opening it would create the file
        return set()
    # (~2 s to import MLflow: not for a store that does not exist)
    from lrattn_lightning.tools.compare.runs import search_all
    from lrattn_lightning.train.artifacts import LinkSafeClient

    with store_lock(tracking_uri):  # a new sqlite store is created by the first client, once
        client = LinkSafeClient(tracking_uri)
    exp = client.get_experiment_by_name(sweep.experiment)
    if exp is None:
        return set()
    done = set()
    for run in search_all(client, exp.experiment_id, "attributes.status = 'FINISHED'"):
        tags = run.data.tags
        if run.info.status == "FINISHED" and {Tag.SIZE, Tag.ABLATION, Tag.SEED} <= set(tags):
            with contextlib.suppress(ValueError):
                found = SweepRun(tags[Tag.SIZE], tags[Tag.ABLATION], int(tags[Tag.SEED]), tags.get(Tag.VARIANT, ""))
                if found.name == run.info.run_name:
                    done.add(found)
    return done


def diverged_runs(sweep: Sweep, tracking_uri: str) -> dict[SweepRun, str]:
    """Runs of this sweep whose MLflow run ended FAILED with a non-finite loss (tag lrattn.diverged -> where):
    resuming them repeats the same steps to the same divergence, so a sweep does not."""
    from lrattn_lightning.train.store import DIVERGED_TAG, sqlite_file

    db = sqlite_file(tracking_uri)
    if db is not None and not db.exists():
        return {}
    from lrattn_lightning.tools.compare.runs import search_all
    from lrattn_lightning.train.artifacts import LinkSafeClient

    client = LinkSafeClient(tracking_uri)
    exp = client.get_experiment_by_name(sweep.experiment)
    if exp is None:
        return {}
    out = {}
    for run in search_all(client, exp.experiment_id, f"attributes.status = 'FAILED' and tags.`{DIVERGED_TAG}` != ''"):
        tags = run.data.tags
        with contextlib.suppress(ValueError, KeyError):
            found = SweepRun(tags[Tag.SIZE], tags[Tag.ABLATION], int(tags[Tag.SEED]), tags.get(Tag.VARIANT, ""))
            if found.name == run.info.run_name and DIVERGED_TAG in tags:
                out[found] = tags[DIVERGED_TAG]
    return out


DONE = ("finished", "diverged")  # states a sweep does not run again


def plan(sweep: Sweep, tracking_uri: str) -> list[tuple[SweepRun, str]]:
    """(run, state) in order; state is 'finished', 'diverged' (FAILED on a non-finite loss: not resumed),
    'resume' (has last.ckpt) or 'new'."""
    done, diverged = finished_runs(sweep, tracking_uri), diverged_runs(sweep, tracking_uri)
    folder = sweep.experiment_dir
    try:  # the run folders that exist: one listing, not a lookup per run (a lab's sweep has 100,000 runs)
        present = {entry.name for entry in os.scandir(folder) if entry.is_dir()}
    except OSError:
        present = set()
    if not (done or diverged or present):  # a new sweep: nothing to look up for each of its runs
        return [(run, "new") for run in sweep.runs]
    return [(run, "finished" if run in done else "diverged" if run in diverged
             else "resume" if run.name in present and sweep.checkpoint(run).is_file() else "new")
            for run in sweep.runs]


# ---- claiming a run: two sweeps of one experiment at once -------------------------------------------
@contextlib.contextmanager
def claim(sweep: Sweep, run: SweepRun) -> Iterator[str | None]:
    """Hold RUN_DIR/.sweep.lock while this sweep runs `run`: yields None, or who else holds the run (another
    sweep, or a live `lrattn fit` holding the run folder's own lock) and then this sweep skips it. The fit
    takes RUN_DIR/.lock itself, so the sweep's claim is a lock file of its own; folders made for it and
    left empty are removed again."""
    from lrattn_lightning.train.checkpoint.lock import FileLock, RunFolderError

    run_dir = sweep.checkpoint(run).parent.parent
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    lock = FileLock(run_dir / ".sweep.lock", "the sweep's lock file")
    for attempt in range(3):  # another sweep may remove an empty parent between our mkdir and open
        try:
            lock.acquire(blocking=False, describe=lambda holder: f"another sweep runs it ({holder})")
            break
        except RunFolderError as err:
            yield str(err)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise
    try:
        holder = _held_by(run_dir / ".lock")
        yield f"a live process holds its run folder ({holder})" if holder else None
    finally:
        lock.release()
        for folder in created:  # deepest first; one that is not empty stays, and so do its parents
            try:
                folder.rmdir()
            except OSError:
                break


def _held_by(path: Path) -> str | None:
    """Who holds the flock on `path` (checkpoint/lock.py's FileLock writes 'pid N on HOST since ...'), or None.
    Read-only: a shared lock taken and dropped at once, the file left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # also drops the shared lock
    return None


# ---- running ---------------------------------------------------------------------------------------
def run_local(sweep: Sweep, registry: Registry, tracking_uri: str, stop_on_failure: bool = False,
              extra: list[str] | None = None, again: str | None = None, parallel: int = 1) -> int:
    """Run the unfinished runs, each as its own `lrattn fit` process (`extra`: flags for each; `registry`: the
    sweep's, as load_sweep read it: the command reads it once): one after another, or `parallel` at once (each
    with OMP_NUM_THREADS=1 unless the sweep's env sets it; the terminal shows one line when a run starts and one
    when it ends, no progress lines).
    SIGTERM, SIGINT or SIGHUP stops the sweep: every running fit gets the same signal (it saves and stops), no further
    run starts, and the sweep exits 128 + the signal's number once they have stopped, its last line naming the
    signal and `again` (the command that continues the sweep)."""
    if parallel < 1:
        raise SweepError(f"--parallel {parallel}: the number of fits to run at once, 1 or more")
    with _StopSignals() as stops:
        return _run_all(sweep, registry, tracking_uri, stop_on_failure, extra or [], stops, again, parallel)


def _run_all(sweep: Sweep, registry: Registry, tracking_uri: str, stop_on_failure: bool, extra: list[str],
             stops: _StopSignals, again: str | None, parallel: int = 1) -> int:
    from lrattn_lightning.data.shards import validate_data_dir

    data_dir = sweep.setting("data.data_dir", "data/stdlib-docs-byte")
    seq_len = sweep.setting("data.seq_len")
    for size in sorted({run.size for run in sweep.runs}):  # missing data fails once, before any run
        validate_data_dir(data_dir, registry.size(size), seq_len)
    env = run_env(sweep)
    check_routers(sweep, registry, env)
    if parallel > 1 and "OMP_NUM_THREADS" not in sweep.env:  # N fits share the cores: one intra-op thread each
        env["OMP_NUM_THREADS"] = "1"
    steps = plan(sweep, tracking_uri)
    todo = [run for run, state in steps if state not in DONE]
    diverged = diverged_runs(sweep, tracking_uri)
    print(f"[sweep {sweep.name}] {len(steps)} runs into experiment '{sweep.experiment}' at {tracking_uri}: "
          f"{sum(s == 'finished' for _, s in steps)} finished (skipped), {len(todo)} to run"
          + (f", {parallel} at once (OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')} each)" if parallel > 1 else ""),
          flush=True)
    for run, state in steps:
        if state == "diverged":
            print(f"[sweep {sweep.name}] {run.name}: diverged ({diverged.get(run, 'non-finite loss')}); not resumed, "
                  "which would repeat it: give it another recipe (a variant) or remove its run folder and MLflow run",
                  flush=True)
    job = _Job(sweep, tracking_uri, extra, env, stops, total=len(todo), progress=parallel == 1)
    if parallel == 1:
        results = _run_in_turn(job, todo, stop_on_failure)
    else:
        results = _run_at_once(job, todo, stop_on_failure, parallel)
    not_started = len(todo) - len(results)
    results += [(run, "diverged") for run, state in steps if state == "diverged"]  # (they count as failed)
    _summary(sweep, results, sum(s == "finished" for _, s in steps), not_started)
    print(f"[sweep {sweep.name}] compare the runs: {compare_command(sweep, tracking_uri)}", flush=True)
    if stops.signum:
        name = signal.Signals(stops.signum).name
        print(f"[sweep {sweep.name}] stopped by {name}: no further runs start; "
              + (f"continue with `{again}`" if again else "run the sweep again to continue"), flush=True)
        return 128 + stops.signum
    bad = [s for _, s in results if s not in ("ok", "finished", "held")]
    return 1 if bad or len(results) < len(todo) else 0


def _run_in_turn(job: _Job, todo: list[SweepRun], stop_on_failure: bool) -> list[tuple[SweepRun, str]]:
    results: list[tuple[SweepRun, str]] = []  # (run, "ok" | "finished" | "held" | "stopped by ..." | why it failed)
    for i, run in enumerate(todo, start=1):
        if job.stops.signum:  # it came between runs
            break
        state = job.run(run, i)
        results.append((run, state))
        if stop_on_failure and _failed(state) and not job.stops.signum:
            break
    return results


def _run_at_once(job: _Job, todo: list[SweepRun], stop_on_failure: bool, parallel: int
                 ) -> list[tuple[SweepRun, str]]:
    """`parallel` slots, each a thread taking the next run and waiting on its fit; no run starts after a stop
    signal (or, with stop_on_failure, a failure). The main thread only waits (its signal handler forwards)."""
    lock = threading.Lock()
    queue = iter(enumerate(todo, start=1))
    states: dict[SweepRun, str] = {}
    failed = threading.Event()

    def slot() -> None:
        while True:
            with lock:
                if job.stops.signum or failed.is_set():
                    return
                i, run = next(queue, (0, None))
            if run is None:
                return
            try:
                state = job.run(run, i)
            except Exception as err:  # (in a thread: it would end the slot and leave the run silently not started)
                state = f"failed ({one_line(err)})"
                say(f"[sweep {job.sweep.name}] {run.name}: {state}")
            with lock:
                states[run] = state
            if stop_on_failure and _failed(state):
                failed.set()

    slots = [threading.Thread(target=slot, name=f"sweep-slot-{k}", daemon=True) for k in range(min(parallel, len(todo)))]
    for thread in slots:
        thread.start()
    for thread in slots:
        while thread.is_alive():  # a timed join: the main thread's signal handler runs in between
            thread.join(0.2)
    return [(run, states[run]) for run in todo if run in states]


def _failed(state: str) -> bool:
    """Not trained nor skipped: failed, or stopped by a signal (--stop-on-failure stops on both)."""
    return state not in ("ok", "finished", "held")


class _Job:
    """What every run of one local sweep shares, and running one of them: claimed, asked MLflow again, its fit
    run with its output in its log; the terminal gets a line when it starts and one when it ends."""

    def __init__(self, sweep: Sweep, tracking_uri: str, extra: list[str], env: dict[str, str], stops: _StopSignals,
                 total: int, progress: bool) -> None:
        self.sweep, self.tracking_uri, self.extra, self.env, self.stops = sweep, tracking_uri, extra, env, stops
        self.total, self.progress = total, progress

    def run(self, run: SweepRun, i: int) -> str:
        """'ok', 'finished' or 'held' (skipped), 'stopped by ...', or why it failed."""
        sweep = self.sweep
        head = f"[sweep {sweep.name}] ({i}/{self.total}) {run.name}"
        with claim(sweep, run) as holder:
            if holder or run in finished_runs(sweep, self.tracking_uri):  # asked again: another sweep may have run it
                say(f"{head}: skipped, " + (f"{holder}" if holder else "finished meanwhile by another process"))
                return "held" if holder else "finished"
            resume = sweep.checkpoint(run).is_file()
            log = sweep.checkpoint(run).parent.parent / "fit.log"
            say(head + (" (resuming from last.ckpt)" if resume else "") + f": training; its output goes to {log}")
            args = (sweep.fit_args(run, self.tracking_uri) + LOCAL_ARGS + self.extra
                    + (["--ckpt_path", "last"] if resume else []))
            start = time.time()
            rc, result, tail = _run_forwarding_signals(
                [sys.executable, "-m", "lrattn_lightning.cli", *args], self.env, log, head, self.stops, self.progress)
        state = "ok" if rc == 0 else _stopped(rc, tail, self.stops.signum) or f"failed (exit {rc})"
        say(f"[sweep {sweep.name}] {run.name}: {state} after {time.time() - start:.0f} s"
            + (f", {result}" if rc == 0 and result else "")
            + ("" if rc == 0 or state.startswith("stopped by")
               else "\n" + "".join(f"    {line}" for line in tail) + f"    (the whole output: {log})"))
        return state


_SAY = threading.Lock()


def say(line: str) -> None:
    """One whole line (or block) on the terminal: runs at once never interleave inside one."""
    with _SAY:
        print(line, flush=True)


def _stopped(rc: int, tail: list[str], signum: int) -> str | None:
    """'stopped by SIGINT at step 3' when a signal stopped the fit (its own stop line says at which step), else None."""
    named = rc in (128 + s for s in STOP_SIGNALS) or rc in (-s for s in STOP_SIGNALS)
    if not (named or signum):
        return None
    said = next((line.strip()[len(STOP_LINE):].split(";")[0] for line in reversed(tail) if line.startswith(STOP_LINE)),
                None)
    return "stopped by " + (said or signal.Signals(signum or (rc - 128 if rc > 0 else -rc)).name)


def _summary(sweep: Sweep, results: list[tuple[SweepRun, str]], finished_before: int, not_started: int) -> None:
    count = {s: sum(r == s for _, r in results) for s in ("ok", "finished", "held")}
    stopped = [(run, s) for run, s in results if s.startswith("stopped by")]
    failed = [(run, s) for run, s in results if s not in count and (run, s) not in stopped]
    print(f"[sweep {sweep.name}] done: {count['ok']} ran, {len(failed)} failed, "
          + (f"{len(stopped)} stopped, " if stopped else "")
          + f"{finished_before + count['finished']} skipped as finished"
          + (f", {count['held']} skipped as running in another process" if count["held"] else "")
          + (f", {not_started} not started" if not_started else "")
          + "".join(f"\n  {run.name}: {s}" for run, s in failed + stopped), flush=True)


class _StopSignals:
    """The stop signal this sweep got (SIGTERM, SIGINT, SIGHUP: the highest, 0 if none), passed on as it came to
    every fit that runs (`procs`). A SIGINT or SIGHUP ignored at launch (nohup) stays ignored, as in `lrattn fit`.
    (A fit given one twice notes it once: a signal that reaches a fit both ways, say Ctrl-C's process group and
    this forwarding, is one stop.)"""

    def __init__(self) -> None:
        self.signum = 0
        self.procs: set[Any] = set()
        self._before: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            for signum, handler in self._before.items():
                if signum == signal.SIGTERM or handler is not signal.SIG_IGN:
                    signal.signal(signum, self.note)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._before.items():
            signal.signal(signum, handler)

    def note(self, signum: int, _frame: Any = None) -> None:
        if signum == signal.SIGHUP:
            detach_hung_up_terminal()
        self.signum = max(self.signum, signum)
        self.forward(signum)

    def forward(self, signum: int, procs: Any = None) -> None:
        for proc in list(self.procs) if procs is None else procs:  # (a copy: a slot's thread may add one meanwhile)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)


# Locally a fit's output goes to its run folder's fit.log; the sweep's terminal shows its progress lines.
LOCAL_ARGS = ["--trainer.enable_progress_bar", "false"]
PROGRESS, RESULT = "[lrattn fit] step ", "[lrattn fit] finished at step "
STOP_LINE = "lrattn: stopped by "  # a fit's line when a signal stopped it


def run_env(sweep: Sweep) -> dict[str, str]:
    """The environment of a local run: this one, the sweep's `env` over it, and PYTHONPATH = this package's
    root (the runs import the same package as this process, wherever the command is started from), this
    environment's PYTHONPATH, the sweep's (appended, not replacing: an own router's folder stays on it)."""
    env = {**os.environ, **{k: v for k, v in sweep.env.items() if k != "PYTHONPATH"}, "PYTHONUNBUFFERED": "1"}
    parts = (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH"), sweep.env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env


# imports every external router a sweep names, as its runs will (their environment, their registry): on
# failure one line per entry, exit 2; the meta device builds it, so its options and protocol are checked too
_ROUTER_CHECK = """
import sys
from lrattn_lightning.core.errors import InputError, one_line
from lrattn_lightning.model.accounting import count_params
from lrattn_lightning.model.registry import load_registry
reg = load_registry(sys.argv[1] or None)
failed = False
for pair in sys.argv[2:]:
    size, ablation = pair.split(" ")
    try:
        count_params(reg.model(size, ablation))
    except InputError as err:
        print(f"{ablation}: {one_line(err)}")
        failed = True
sys.exit(2 if failed else 0)
"""


def check_routers(sweep: Sweep, registry: Registry, env: dict[str, str]) -> None:
    """Every external router of the sweep imported (and built on the meta device) in the runs' environment
    before the first run starts: a missing module is one line, not a failed run after the others trained."""
    pairs = sorted(pair for pair in {(run.size, run.ablation) for run in sweep.runs}  # each pair once
                   if (abl := registry.ablation(pair[1])).kind.code_paths(abl.options))
    if not pairs:
        return
    done = subprocess.run([sys.executable, "-c", _ROUTER_CHECK, sweep.registry or "", *[f"{a} {b}" for a, b in pairs]],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        why = done.stdout.strip().splitlines() or [one_line(done.stderr.strip().splitlines()[-1:] or ["failed"])]
        raise SweepError(f"sweep '{sweep.name}': {why[0]} (the runs' PYTHONPATH: {env.get('PYTHONPATH', '')}; the "
                         "sweep's env: PYTHONPATH is appended to it, relative to the sweep file)")


def compare_command(sweep: Sweep, tracking_uri: str) -> str:
    from lrattn_lightning.train.summary import command, store_flags

    return f"{command('lrattn')} {shlex.join(['compare', '--experiment', sweep.experiment, *store_flags(tracking_uri)])}"


def _run_forwarding_signals(cmd: list[str], env: dict[str, str], log: Path, head: str, stops: _StopSignals,
                            progress: bool = True) -> tuple[int, str | None, list[str]]:
    """Run one fit, its output appended to `log`; its progress lines shown under `head` (`progress`). A stop signal
    to the sweep goes on to it as it came (it checkpoints and stops; `stops`). (exit code, its result line, its last
    lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    stops.procs.add(proc)
    if stops.signum:  # it came while the fit was being started
        stops.forward(stops.signum, [proc])
    result, tail = None, collections.deque(maxlen=12)
    try:
        with append_file(log, "fit log") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                tail.append(line)
                if progress and line.startswith(PROGRESS):
                    say(f"{head}: {line[len('[lrattn fit] '):].rstrip()}")
                elif line.startswith(RESULT):
                    result = line[len("[lrattn fit] "):].strip()
        return proc.wait(), result, list(tail)
    finally:
        stops.procs.discard(proc)
