"""`lrattn sweep` on this machine: which runs are finished, claiming a run, running the rest one after another.

A run is *finished* when the MLflow experiment holds a FINISHED run of its name tagged with its size, ablation,
variant and seed (whichever sweep file of the experiment ran it). Each unfinished run is its own `lrattn fit`
process in the sweep's environment (`run_env`: the sweep's `env`, its PYTHONPATH appended), started after every
external router the sweep names was imported there (`check_routers`); its whole output goes to its run folder's
fit.log and the terminal shows one line when it starts, its progress lines and one result line, and at the end
the `lrattn compare` command for the experiment. Two sweeps of one experiment may run at once: each run is
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import one_line
from lrattn_lightning.core.files import PACKAGE_ROOT
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.sweep.file import Sweep, SweepError, SweepRun


# ---- state -----------------------------------------------------------------------------------------
def finished_runs(sweep: Sweep, tracking_uri: str) -> set[SweepRun]:
    """Runs of this sweep that MLflow holds as FINISHED: a run of the experiment with the run's name (its
    folder) and tags size, ablation, seed (and variant), whichever sweep file ran it: two sweeps of one
    experiment that share a run (a screen's seed-0 runs reused by the study) share its folder and its result."""
    from mlflow.tracking import MlflowClient

    from lrattn_lightning.tools.compare.runs import search_all
    from lrattn_lightning.train.tracking import sqlite_file, store_lock

    db = sqlite_file(tracking_uri)
    if db is not None and not db.exists():  # nothing has finished there; opening it would create the file
        return set()
    with store_lock(tracking_uri):  # a new sqlite store is created by the first client, once
        client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(sweep.experiment)
    if exp is None:
        return set()
    done = set()
    for run in search_all(client, exp.experiment_id, "attributes.status = 'FINISHED'"):
        tags = run.data.tags
        if run.info.status == "FINISHED" and {"size", "ablation", "seed"} <= set(tags):
            with contextlib.suppress(ValueError):
                found = SweepRun(tags["size"], tags["ablation"], int(tags["seed"]), tags.get("variant", ""))
                if found.name == run.info.run_name:
                    done.add(found)
    return done


def diverged_runs(sweep: Sweep, tracking_uri: str) -> dict[SweepRun, str]:
    """Runs of this sweep whose MLflow run ended FAILED with a non-finite loss (tag lrattn.diverged -> where):
    resuming them repeats the same steps to the same divergence, so a sweep does not."""
    from mlflow.tracking import MlflowClient

    from lrattn_lightning.tools.compare.runs import search_all
    from lrattn_lightning.train.tracking import DIVERGED_TAG, sqlite_file

    db = sqlite_file(tracking_uri)
    if db is not None and not db.exists():
        return {}
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(sweep.experiment)
    if exp is None:
        return {}
    out = {}
    for run in search_all(client, exp.experiment_id, f"attributes.status = 'FAILED' and tags.`{DIVERGED_TAG}` != ''"):
        tags = run.data.tags
        with contextlib.suppress(ValueError, KeyError):
            found = SweepRun(tags["size"], tags["ablation"], int(tags["seed"]), tags.get("variant", ""))
            if found.name == run.info.run_name and DIVERGED_TAG in tags:
                out[found] = tags[DIVERGED_TAG]
    return out


DONE = ("finished", "diverged")  # states a sweep does not run again


def plan(sweep: Sweep, tracking_uri: str) -> list[tuple[SweepRun, str]]:
    """(run, state) in order; state is 'finished', 'diverged' (FAILED on a non-finite loss: not resumed),
    'resume' (has last.ckpt) or 'new'."""
    done, diverged = finished_runs(sweep, tracking_uri), diverged_runs(sweep, tracking_uri)
    return [(run, "finished" if run in done else "diverged" if run in diverged
             else "resume" if sweep.checkpoint(run).is_file() else "new") for run in sweep.runs]


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
    lock = FileLock(run_dir / ".sweep.lock")
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
def run_local(sweep: Sweep, tracking_uri: str, stop_on_failure: bool = False, extra: list[str] | None = None) -> int:
    """Run the unfinished runs one after another, each as its own `lrattn fit` process (`extra`: flags for each)."""
    from lrattn_lightning.data.shards import validate_data_dir
    from lrattn_lightning.train.checkpoint.stop import PREEMPTED_EXIT_CODE

    registry = load_registry(sweep.registry)
    data_dir = sweep.setting("data.data_dir", "data/stdlib-docs-byte")
    seq_len = sweep.setting("data.seq_len")
    for size in sorted({run.size for run in sweep.runs}):  # missing data fails once, before any run
        validate_data_dir(data_dir, registry.size(size), seq_len)
    env = run_env(sweep)
    check_routers(sweep, registry, env)
    steps = plan(sweep, tracking_uri)
    todo = [run for run, state in steps if state not in DONE]
    diverged = diverged_runs(sweep, tracking_uri)
    print(f"[sweep {sweep.name}] {len(steps)} runs into experiment '{sweep.experiment}' at {tracking_uri}: "
          f"{sum(s == 'finished' for _, s in steps)} finished (skipped), {len(todo)} to run", flush=True)
    for run, state in steps:
        if state == "diverged":
            print(f"[sweep {sweep.name}] {run.name}: diverged ({diverged.get(run, 'non-finite loss')}); not resumed, "
                  "which would repeat it: give it another recipe (a variant) or remove its run folder and MLflow run",
                  flush=True)
    results: list[tuple[SweepRun, str]] = []  # (run, "ok" | "finished" | "held" | why it failed)
    stopped = False
    for i, run in enumerate(todo, start=1):
        head = f"[sweep {sweep.name}] ({i}/{len(todo)}) {run.name}"
        with claim(sweep, run) as holder:
            if holder or run in finished_runs(sweep, tracking_uri):  # asked again: another sweep may have run it
                results.append((run, "held" if holder else "finished"))
                print(f"{head}: skipped, " + (f"{holder}" if holder else "finished meanwhile by another process"),
                      flush=True)
                continue
            resume = sweep.checkpoint(run).is_file()
            log = sweep.checkpoint(run).parent.parent / "fit.log"
            print(head + (" (resuming from last.ckpt)" if resume else "") + f": training; its output goes to {log}",
                  flush=True)
            args = (sweep.fit_args(run, tracking_uri) + LOCAL_ARGS + (extra or [])
                    + (["--ckpt_path", "last"] if resume else []))
            start = time.time()
            rc, stopped, result, tail = _run_forwarding_signals(
                [sys.executable, "-m", "lrattn_lightning.cli", *args], env, log, head)
        state = "ok" if rc == 0 else ("stopped by SIGTERM" if rc == PREEMPTED_EXIT_CODE else f"failed (exit {rc})")
        results.append((run, state))
        print(f"[sweep {sweep.name}] {run.name}: {state} after {time.time() - start:.0f} s"
              + (f", {result}" if rc == 0 and result else ""), flush=True)
        if rc not in (0, PREEMPTED_EXIT_CODE):
            print("".join(f"    {line}" for line in tail) + f"    (the whole output: {log})", flush=True)
        if stopped:
            print(f"[sweep {sweep.name}] stopped by a signal: no further runs start; run the sweep again to resume",
                  flush=True)
            break
        if rc != 0 and stop_on_failure:
            break
    not_started = len(todo) - len(results)
    results += [(run, "diverged") for run, state in steps if state == "diverged"]  # (they count as failed)
    _summary(sweep, results, sum(s == "finished" for _, s in steps), not_started)
    print(f"[sweep {sweep.name}] compare the runs: {compare_command(sweep, tracking_uri)}", flush=True)
    if stopped:
        return PREEMPTED_EXIT_CODE
    return 1 if any(s not in ("ok", "finished", "held") for _, s in results) or len(results) < len(todo) else 0


def _summary(sweep: Sweep, results: list[tuple[SweepRun, str]], finished_before: int, not_started: int) -> None:
    count = {s: sum(r == s for _, r in results) for s in ("ok", "finished", "held")}
    failed = [(run, s) for run, s in results if s not in count]
    print(f"[sweep {sweep.name}] done: {count['ok']} ran, {len(failed)} failed, "
          f"{finished_before + count['finished']} skipped as finished"
          + (f", {count['held']} skipped as running in another process" if count["held"] else "")
          + (f", {not_started} not started" if not_started else "")
          + "".join(f"\n  {run.name}: {s}" for run, s in failed), flush=True)


# Locally a fit's output goes to its run folder's fit.log; the sweep's terminal shows its progress lines.
LOCAL_ARGS = ["--trainer.enable_progress_bar", "false"]
PROGRESS, RESULT = "[lrattn fit] step ", "[lrattn fit] finished at step "


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


def check_routers(sweep: Sweep, registry: Any, env: dict[str, str]) -> None:
    """Every external router of the sweep imported (and built on the meta device) in the runs' environment
    before the first run starts: a missing module is one line, not a failed run after the others trained."""
    pairs = sorted({(run.size, run.ablation) for run in sweep.runs
                    if registry.ablation(run.ablation).kind.user_code})
    if not pairs:
        return
    done = subprocess.run([sys.executable, "-c", _ROUTER_CHECK, sweep.registry or "", *[f"{a} {b}" for a, b in pairs]],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        why = done.stdout.strip().splitlines() or [one_line(done.stderr.strip().splitlines()[-1:] or ["failed"])]
        raise SweepError(f"sweep '{sweep.name}': {why[0]} (the runs' PYTHONPATH: {env.get('PYTHONPATH', '')}; the "
                         "sweep's env: PYTHONPATH is appended to it, relative to the sweep file)")


def compare_command(sweep: Sweep, tracking_uri: str) -> str:
    from lrattn_lightning.train.summary import command
    from lrattn_lightning.train.tracking import LOCAL_TRACKING_URI, absolute_sqlite

    store = "" if tracking_uri == absolute_sqlite(LOCAL_TRACKING_URI) else f" --tracking_uri {shlex.quote(tracking_uri)}"
    return f"{command('lrattn')} compare --experiment {shlex.quote(sweep.experiment)}{store}"


def _run_forwarding_signals(cmd: list[str], env: dict[str, str], log: Path, head: str
                            ) -> tuple[int, bool, str | None, list[str]]:
    """Run one fit, its output appended to `log`; its progress lines shown under `head`. A SIGTERM/SIGINT to the
    sweep goes on to it (it checkpoints and stops). (exit code, stopped, its result line, its last lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    stopped, result, tail = False, None, collections.deque(maxlen=12)

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopped
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with log.open("a", encoding="utf-8") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                tail.append(line)
                if line.startswith(PROGRESS):
                    print(f"{head}: {line[len('[lrattn fit] '):].rstrip()}", flush=True)
                elif line.startswith(RESULT):
                    result = line[len("[lrattn fit] "):].strip()
        return proc.wait(), stopped, result, list(tail)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
