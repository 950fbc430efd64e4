"""`lrattn sweep FILE`: the runs of a sweep file (file.py) into one MLflow experiment.

Finished runs are skipped, and a run with a last.ckpt resumes from it (`--ckpt_path last`, into the same MLflow
run). Locally the runs go one after another, or `--parallel N` at once, each its own `lrattn fit` process
(local.py: which runs are finished, claiming a run, the runs' environment, their output); elsewhere,
`--emit commands` writes one shell line per run that runs as written from any folder, and `--emit slurm` an
sbatch array script with one `srun lrattn fit ...` per array task (Lightning reads the SLURM environment; nodes
and tasks per node come from the recipe's trainer.num_nodes and trainer.devices).

Every run's full argument list is parsed by `fit`'s own parser before the first run starts (also for
--dry-run and --emit), so a typo in the sweep's `args` or its recipe is one line, not a failed fit per run;
every external router the sweep names is imported in the runs' environment before the first local run (and
for --dry-run). That check runs in a child forked before the sweep file is read (`FitCheck`): it imports
Lightning and builds fit's parser (about as long as reading and planning 100,000 runs) while this process reads the
file, is handed one run of each configuration, and parses them, in shares over the CPUs where they are many
(`_check_in_shares`), while this process plans the runs; nothing is printed, written or run before the check has
passed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import pickle
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError, one_line
from lrattn_lightning.core.files import load_yaml_strict, read_yaml_text, replacing
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.tools.sweep.file import MAX_ARRAY_SIZE, Sweep, SweepError, SweepRun, load_sweep
from lrattn_lightning.tools.sweep.local import (  # noqa: F401  (finished_runs: part of this module's interface)
    DONE,
    check_routers,
    finished_runs,
    plan,
    run_env,
    run_local,
)
from lrattn_lightning.train.summary import command


# ---- every run's fit arguments, checked before the first run starts ---------------------------------
def configurations(sweep: Sweep) -> dict[str, SweepRun]:
    """The sweep's distinct fit configurations, each with its first run: runs whose arguments differ only in what
    the sweep sets itself from names load_sweep has checked (size, ablation, seed, run name and tags) share one;
    their size's size_args and their own args make another."""
    first: dict[str, SweepRun] = {}
    keys: dict[tuple[str, str], str] = {}  # (size, repr of the run's args) -> key: json once per distinct pair
    for run in sweep.runs:
        pair = (run.size, repr(run.args))
        if pair not in keys:
            keys[pair] = json.dumps([sweep.size_args.get(run.size, {}), run.args], sort_keys=True, default=repr)
        first.setdefault(keys[pair], run)
    return first


def check_fit_args(sweep: Sweep, tracking_uri: str | None, extra: list[str], parser: Any,
                   total: int | None = None, shares: tuple[int, int] | None = None, quiet: bool = False) -> None:
    """Parse the `lrattn fit` arguments of every distinct configuration (`configurations`) with fit's parser
    (`cli/sweep.py fit_parser()`, one for all runs): a full parse takes ~50 ms, so a sweep of 100,000 runs is
    checked in the time of its few configurations. SweepError naming the first bad run, the flag and where it
    comes from, with the closest valid flags for an unknown one. `total`: the sweep's runs, where `sweep` holds
    only one run of each configuration (FitCheck's child), or a share of them (`shares`: the configurations in all
    and the processes checking them at once; `quiet`: no progress line, the first share's says how far it is)."""
    known = set(parser.get_defaults().keys())  # dotted leaf keys: trainer.max_steps, model.lr, run_name, ...
    groups = {".".join(k.split(".")[:i]) for k in known for i in range(1, k.count(".") + 1)}
    recipe = load_yaml_strict(read_yaml_text(Path(sweep.recipe), "recipe"), sweep.recipe) or {}
    recipe_keys = list(_flat_keys(recipe, known, groups)) if isinstance(recipe, dict) else []
    runs = list(configurations(sweep).values())
    configs, at_once = shares or (len(runs), 1)
    what = f"{configs} configurations ({len(sweep.runs) if total is None else total} runs"
    what += f", {at_once} processes at once: the first one's share)" if at_once > 1 else ")"
    progress = Progress(f"[sweep {sweep.name}] checking the fit flags of {what}", len(runs),
                        after=float("inf") if quiet else 10.0)
    for i, run in enumerate(runs):
        progress.update(i)
        given = ([(k, f"recipe {sweep.recipe}") for k in recipe_keys]
                 + [(k, f"the sweep's args ({sweep.path})") for k in sweep.args]
                 + [(k, f"the size_args of {run.size} ({sweep.path})") for k in sweep.size_args.get(run.size, {})]
                 + [(k, f"the args of variant '{run.variant}' ({sweep.path})") for k, _ in run.args])
        for key, origin in given:
            if not _accepted(key, known, groups):
                hint = ", ".join(f"--{k}" for k in closest_names(key, sorted(known)))
                raise SweepError(f"sweep '{sweep.name}', run {run.name}: unknown fit flag --{key} (in {origin}); "
                                 f"closest: {hint}")
        try:
            parser.parse_args(sweep.fit_args(run, tracking_uri)[1:] + extra)  # [1:]: without the subcommand
        except (argparse.ArgumentError, SystemExit, InputError) as err:  # (InputError: a YAML value past the limits)
            raise SweepError(f"sweep '{sweep.name}', run {run.name}: {one_line(err)} (recipe {sweep.recipe}, "
                             f"args of {sweep.path})") from None
    progress.done()


def broken_check(err: BaseException) -> RuntimeError:
    """A check of fit's flags that failed inside (not a bad flag), as wait() says it, forked or in place."""
    return RuntimeError(f"checking the sweep's fit flags failed: {type(err).__name__}: {one_line(err)}")


class FitCheck:
    """check_fit_args for a sweep in a child forked at once, before the sweep file is read: the child imports
    Lightning and builds fit's parser (the slow part) while this process reads the sweep file, then `start` hands it
    the sweep's configurations (one run each, `configurations`) over a pipe and this process plans the runs;
    `wait()` (before anything is printed, written or run) raises its SweepError here. Without os.fork, or with
    threads running in this process (a fork copies only the calling one, and whatever lock another held), `start`
    checks at once, here, and keeps the verdict for `wait()` (the same errors either way). `first()`: an error
    meanwhile waits for the check, so a bad fit flag is still the one line said (as when the check came first); an
    error before `start` (a bad sweep file) ends the child unheard."""

    def __init__(self, fit_parser: Callable[[], Any] | None) -> None:
        self.pid: int | None = None
        self.job: int | None = None  # the pipe `start` writes the sweep to; None once written
        self.verdict: Exception | None = None  # the in-place check's error, said at wait()
        self.fit_parser = fit_parser
        if fit_parser is None or not hasattr(os, "fork") or threading.active_count() > 1:
            return  # nothing to check, or checked in place by start()
        job_read, job_write = os.pipe()
        read, write = os.pipe()
        with contextlib.suppress(AttributeError, OSError):  # room for a sweep of many configurations at once
            import fcntl

            fcntl.fcntl(job_write, fcntl.F_SETPIPE_SZ, 1 << 20)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: build fit's parser, take the sweep, check, say how it went, leave unheard
            os.close(job_write)
            os.close(read)
            os._exit(_check_in_child(fit_parser, job_read, write))
        os.close(job_read)
        os.close(write)
        self.pid, self.job, self.read = pid, job_write, read

    def start(self, sweep: Sweep, tracking_uri: str | None, extra: list[str]) -> None:
        """Check `sweep`'s fit flags: the forked child is handed its configurations, or they are checked here."""
        if self.fit_parser is None:
            return
        if self.pid is None:
            try:
                check_fit_args(sweep, tracking_uri, extra, self.fit_parser())
            except InputError as err:
                self.verdict = SweepError(str(err))
            except Exception as err:  # noqa: BLE001 - as the forked check's exit 1: said at wait()
                self.verdict = broken_check(err)
            return
        few = dataclasses.replace(sweep, runs=tuple(configurations(sweep).values()))
        job = pickle.dumps((few, len(sweep.runs), tracking_uri, extra))
        try:
            with os.fdopen(self.job, "wb") as pipe:
                pipe.write(job)
        except BrokenPipeError:  # the child is gone: wait() says how it ended
            pass
        self.job = None

    def wait(self) -> None:
        """The check's verdict: nothing, its SweepError, or a RuntimeError for a check that failed inside."""
        if self.verdict is not None:
            verdict, self.verdict = self.verdict, None
            raise verdict
        if self.pid is None:
            return
        chunks = []
        while chunk := os.read(self.read, 65536):
            chunks.append(chunk)
        os.close(self.read)
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        said, code = b"".join(chunks).decode(errors="replace"), os.waitstatus_to_exitcode(status)
        if code == 2:
            raise SweepError(said)
        if code != 0:
            raise RuntimeError(said or f"checking the sweep's fit flags failed: exit {code}")

    def stop(self) -> None:
        """End the check unheard (this process is stopping, or the sweep never reached `start`)."""
        if self.job is not None:
            os.close(self.job)
            self.job = None
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            os.waitpid(self.pid, 0)
            os.close(self.read)
            self.pid = None

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        try:
            yield
        except Exception:
            if self.job is not None:  # no sweep to check (its file is bad): this error is the line
                self.stop()
                raise
            self.wait()  # a bad fit flag is the line said
            raise
        except BaseException:
            self.stop()
            raise


def _check_in_child(fit_parser: Callable[[], Any], job: int, write: int) -> int:
    """FitCheck's child: fit's parser built, then the sweep `start` wrote on `job` checked (`_check_in_shares`);
    the verdict's words on `write` and the exit status (`_verdict`; 0 unheard when no sweep came)."""

    def check() -> tuple[int, str] | None:
        parser = fit_parser()
        with os.fdopen(job, "rb") as pipe:
            given = pipe.read()
        if not given:
            return None
        sweep, total, tracking_uri, extra = pickle.loads(given)  # noqa: S301 (this process's parent wrote it)
        return _check_in_shares(sweep, tracking_uri, extra, parser, total)

    return _say(write, *_verdict(check))


def _verdict(check: Callable[[], tuple[int, str] | None]) -> tuple[int, str]:
    """(exit status, words) of a check as FitCheck says it: 0 good, 2 a bad flag, 1 a check that broke."""
    try:
        return check() or (0, "")
    except InputError as err:
        return 2, str(err)
    except BaseException as err:  # noqa: B036 (anything: the parent says it; a child only exits)
        traceback.print_exc()
        return 1, str(broken_check(err))


def _say(write: int, status: int, said: str) -> int:
    with contextlib.suppress(BaseException):
        os.write(write, said.encode())
        os.close(write)
        sys.stdout.flush()
        sys.stderr.flush()
    return status


SHARE = 16  # configurations a process checks at least (~50 ms each) before another one is forked to share them


def _check_in_shares(sweep: Sweep, tracking_uri: str | None, extra: list[str], parser: Any,
                     total: int) -> tuple[int, str] | None:
    """check_fit_args with fit's parser built once and its configurations cut in contiguous shares, one per process
    (forked from this one, up to the CPUs this process may use): the first share's error that has one is the
    error, the first bad run as one process would find it."""
    runs = list(configurations(sweep).values())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = max(1, min(cpus, len(runs) // SHARE))
    bounds = [len(runs) * k // n for k in range(n + 1)]

    def share(k: int) -> Callable[[], None]:
        part = dataclasses.replace(sweep, runs=tuple(runs[bounds[k]:bounds[k + 1]]))
        return lambda: check_fit_args(part, tracking_uri, extra, parser, total=total, shares=(len(runs), n), quiet=k > 0)

    kids: list[tuple[int, int]] = []

    def end(*_: Any) -> None:  # FitCheck.stop() ends this process: its shares end with it, not after
        for pid, _read in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)

    if n > 1:
        signal.signal(signal.SIGTERM, end)
    for k in range(1, n):
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.close(read)
            os._exit(_say(write, *_verdict(share(k))))
        os.close(write)
        kids.append((pid, read))
    verdicts = [_verdict(share(0))]
    for pid, read in kids:
        if verdicts[-1][0] != 0:  # an earlier share's error is the one said
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if verdicts[-1][0] == 0:
            code = os.waitstatus_to_exitcode(status)
            said = b"".join(chunks).decode(errors="replace")
            verdicts.append((code, said or f"checking the sweep's fit flags failed: exit {code}") if code else (0, ""))
    return verdicts[-1]


class Progress:
    """A line on stderr for work that turns out slow: nothing for work done within `after` seconds, then the
    count every `every` seconds, and a closing line."""

    def __init__(self, what: str, total: int, after: float = 10.0, every: float = 10.0) -> None:
        self.what, self.total, self.after, self.every = what, total, after, every
        self.start = self.last = time.monotonic()
        self.said = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.start >= self.after and now - self.last >= (self.every if self.said else self.after):
            print(f"{self.what}: {done}/{self.total}", file=sys.stderr, flush=True)
            self.said, self.last = True, now

    def done(self) -> None:
        if self.said:
            print(f"{self.what}: done in {time.monotonic() - self.start:.0f} s", file=sys.stderr, flush=True)


def _accepted(key: str, known: set[str], groups: set[str]) -> bool:
    """A fit key, a group of them (`trainer` given as a mapping), or inside one's value
    (`trainer.callbacks.tasks`: an argument of a callback given in trainer.callbacks)."""
    key = key.removesuffix("+")  # `trainer.callbacks+`: jsonargparse's append
    parts = key.split(".")
    return key in known or key in groups or any(".".join(parts[:i]) in known for i in range(1, len(parts)))


def _flat_keys(node: dict, known: set[str], groups: set[str], prefix: str = "") -> Iterator[str]:
    """A recipe's keys as fit flags: trainer: {max_steps: 3} is trainer.max_steps; the value of a fit key
    (a callback list, an optimizer's init_args) is the parser's to check."""
    for key, value in node.items():
        dotted = prefix + str(key)
        if isinstance(value, dict) and dotted in groups and dotted not in known:
            yield from _flat_keys(value, known, groups, dotted + ".")
        else:
            yield dotted

def _env_words(sweep: Sweep) -> list[str]:
    """The sweep's env as NAME=value shell words; PYTHONPATH appended to the environment's own."""
    return [f'{k}="${{PYTHONPATH:+$PYTHONPATH:}}"{shlex.quote(v)}' if k == "PYTHONPATH" else f"{k}={shlex.quote(v)}"
            for k, v in sweep.env.items()]


def lrattn_command() -> str:
    """The `lrattn` of this environment by its absolute path, as a shell word (the script beside this interpreter,
    else this interpreter running the package): an emitted line runs it without the venv on PATH."""
    script = Path(sys.executable).parent / "lrattn"
    if script.is_file():
        return shlex.quote(str(script.absolute()))
    return shlex.join([str(Path(sys.executable).absolute()), "-m", "lrattn_lightning.cli"])


# how to run an emitted command file N lines at a time (GNU xargs): -d '\n' passes each line to sh as it is
# written; without it xargs strips the lines' quotes itself and --run_tags' JSON no longer parses
XARGS = "xargs -P 2 -d '\\n' -I{} sh -c '{}'"


def emit_commands(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
                  extra: list[str] | None = None) -> str:
    """One shell line per unfinished run that runs as written from any folder: it changes to the folder the sweep
    was emitted from (where the recipe, its data_dir, runs_dir and the default ./mlflow.db are, as for a local
    sweep) and calls this environment's lrattn by its path."""
    return "".join(line + "\n" for line in command_lines(sweep, steps, tracking_uri, extra))


def command_lines(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
                  extra: list[str] | None = None, progress: Progress | None = None) -> Iterator[str]:
    """emit_commands' lines, each made when it is written (`progress`: counts the runs)."""
    here = shlex.quote(str(Path.cwd().resolve()))
    env = " ".join(_env_words(sweep))
    lrattn = lrattn_command()
    lines = [f"# lrattn sweep {sweep.path} --emit commands: {sum(s not in DONE for _, s in steps)} runs "
             f"({sum(s in DONE for _, s in steps)} finished or diverged runs skipped).",
             f"# Each line runs as written from any folder: it changes to {here}, where the sweep was emitted (the",
             f"# recipe's relative paths, runs_dir and ./mlflow.db are read there), and runs {lrattn}.",
             "# One after another: sh FILE. Two at a time (GNU xargs; -d '\\n' hands sh each line with its quotes):",
             f"#   {XARGS} < FILE",
             f"# `lrattn sweep {sweep.path} --parallel 2` runs them so too, OMP_NUM_THREADS=1 each. For several GPUs",
             "# or nodes put srun/torchrun before a line's lrattn, or set the recipe's trainer.devices/num_nodes."]
    yield from lines
    start = f"cd {here} && " + (f"env {env} " if env else "") + f"{lrattn} "
    for i, (run, state) in enumerate(steps):
        if state in DONE:
            continue
        if progress is not None and i % 1000 == 0:
            progress.update(i)
        args = sweep.fit_args(run, tracking_uri) + (extra or []) + (["--ckpt_path", "last"] if state == "resume" else [])
        yield start + shlex.join(args)


def emit_slurm_parts(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
                     extra: list[str] | None = None, max_array_size: int | None = None) -> list[str]:
    """emit_slurm's scripts: one, or where the unfinished runs are more than the cluster's MaxArraySize
    (`max_array_size`, else the sweep file's slurm.max_array_size, else SLURM's default 1001: indices from 0 to
    MaxArraySize - 1), one script per MaxArraySize runs, each an array from 0."""
    return list(slurm_parts(sweep, steps, tracking_uri, extra, max_array_size))


def slurm_parts(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
                extra: list[str] | None = None, max_array_size: int | None = None,
                progress: Progress | None = None) -> Iterator[str]:
    """emit_slurm_parts' scripts, each made when it is written (`slurm_part_count` of them; `progress` counts
    them)."""
    size = max_array_size or sweep.slurm.get("max_array_size", MAX_ARRAY_SIZE)
    todo = [(run, state) for run, state in steps if state not in DONE]
    if len(todo) <= size:
        yield emit_slurm(sweep, steps, tracking_uri, extra)
        return
    parts = -(-len(todo) // size)
    skipped = len(steps) - len(todo)
    for k in range(1, parts + 1):
        if progress is not None:
            progress.update(k - 1)
        chunk = todo[(k - 1) * size:k * size]
        yield emit_slurm(sweep, chunk, tracking_uri, extra, part=(k, parts, skipped, len(todo)))


def slurm_part_count(steps: list[tuple[SweepRun, str]], size: int) -> int:
    """How many scripts slurm_parts makes at MaxArraySize `size`."""
    return max(1, -(-sum(state not in DONE for _, state in steps) // size))


def emit_slurm(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
               extra: list[str] | None = None, part: tuple[int, int, int, int] | None = None) -> str:
    """An sbatch array script: one array task per unfinished run, each `srun lrattn fit ...`. part: (k, parts,
    runs skipped, runs in all) for the k-th of the scripts of a sweep split at MaxArraySize."""
    todo = [run for run, state in steps if state not in DONE]
    if not todo:
        raise SweepError(f"sweep '{sweep.name}': every run is finished; nothing to emit")
    nodes = int(sweep.setting("trainer.num_nodes", 1) or 1)
    devices = sweep.setting("trainer.devices", 1)
    if not isinstance(devices, int):
        raise SweepError(f"{sweep.recipe}: trainer.devices must be an integer for SLURM (tasks per node), got {devices!r}")
    accelerator = sweep.setting("trainer.accelerator", "auto")
    strategy = str(sweep.setting("trainer.strategy", "auto") or "auto")
    world = {"fsdp": "FSDP2 world (ModelParallelStrategy: every rank holds 1/world of the weights, gradients "
                     "and optimiser state)", "ddp": "DDP world"}.get(strategy, f"world of strategy '{strategy}'")
    s = sweep.slurm
    array = f"0-{len(todo) - 1}" + (f"%{s['max_parallel']}" if s.get("max_parallel") else "")
    here = Path.cwd().resolve()  # each task changes there: the recipe's relative paths, runs_dir, ./mlflow.db
    log_dir = here / Path(sweep.setting("runs_dir", "runs")) / sweep.experiment / "slurm"
    lrattn = lrattn_command()
    k, parts, skipped, total = part or (1, 1, len(steps) - len(todo), len(todo))
    which = f"part {k} of {parts}: {len(todo)} of the {total} runs" if parts > 1 else f"{len(todo)} runs"
    head = [
        "#!/bin/bash",
        f"# Generated by `lrattn sweep {sweep.path} --emit slurm`: {which} of sweep '{sweep.name}' "
        f"({skipped} finished or diverged runs skipped).",
        f"# Submit from any folder with `sbatch` (the log folder {log_dir} must exist: mkdir -p it). Each task",
        f"# changes to {shlex.quote(str(here))}, where the sweep was emitted, and runs {lrattn}.",
        "# Each array task is one run. srun starts one task per GPU on every node and Lightning's SLURM environment",
        f"# turns them into the {world}: {nodes} node(s) x {devices} task(s) per node = the recipe's",
        f"# trainer.num_nodes x trainer.devices, trainer.strategy {strategy}. A resubmitted task resumes its run from "
        "last.ckpt.",
        "# SIGTERM (preemption, or --signal below before the time limit) makes `lrattn fit` save last.ckpt at the",
        "# current step and exit 143; --requeue puts a preempted task back in the queue, where it resumes.",
        f"#SBATCH --job-name={sweep.name}",
        f"#SBATCH --array={array}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={devices}",
        "#SBATCH --requeue",
        "#SBATCH --signal=TERM@120",
    ]
    if accelerator in ("gpu", "cuda", "auto"):
        head.append(f"#SBATCH --gpus-per-node={devices}")
    for key, option in (("cpus_per_task", "cpus-per-task"), ("time", "time"), ("partition", "partition"),
                        ("account", "account")):
        if s.get(key) is not None:
            head.append(f"#SBATCH --{option}={s[key]}")
    head += [f"#SBATCH {opt}" for opt in s.get("extra", [])]
    head += [f"#SBATCH --output={log_dir}/%x-%A_%a.out", "set -euo pipefail"]
    head += [f"export {word}" for word in _env_words(sweep)]
    body = [f"cd {shlex.quote(str(here))}", 'case "$SLURM_ARRAY_TASK_ID" in']
    for i, run in enumerate(todo):
        ckpt = sweep.checkpoint(run)
        body.append(f"  {i}) CKPT={shlex.quote(str(ckpt))}; "
                    f"ARGS=({' '.join(shlex.quote(a) for a in sweep.fit_args(run, tracking_uri) + (extra or []))}) ;;")
    body += ['  *) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac",
             'if [[ -f "$CKPT" ]]; then ARGS+=(--ckpt_path last); fi',
             f'srun {lrattn} "${{ARGS[@]}}"']
    return "\n".join(head + body) + "\n"


# ---- command line ----------------------------------------------------------------------------------
def _bool(text: str) -> bool:
    """`--mlflow_fallback_local true`, spelt as `lrattn fit` takes it."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return value


def main(argv: list[str] | None = None, fit_parser: Callable[[], Any] | None = None) -> int:
    """`lrattn sweep` (`cli/sweep.py sweep_main` hands in fit's parser: the cli layer owns it)."""
    from lrattn_lightning.train.store import resolve_tracking_uri

    parser = Parser(prog="lrattn sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a sweep file, e.g. experiments/sweeps/cpu-study.yaml")
    # one name: Parser reads --tracking-uri as --tracking_uri (declaring both listed it twice in --help)
    parser.add_argument("--tracking_uri", default=None,
                        help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--mlflow_fallback_local", type=_bool, default=False, metavar="{true,false}",
                        help="if the MLflow server is unreachable, use the local sqlite store (also passed to each fit)")
    parser.add_argument("--emit", choices=("commands", "slurm"), default=None,
                        help="write launch commands / an sbatch array script instead of running locally")
    parser.add_argument("--out", default=None, help="where --emit writes (default: RUNS_DIR/EXPERIMENT/sweep-NAME.*; '-' = stdout)")
    parser.add_argument("--max_array_size", type=int, default=None,
                        help="--emit slurm: the cluster's MaxArraySize (default: the sweep file's slurm.max_array_size, "
                        f"else {MAX_ARRAY_SIZE}); more runs are split into one script per that many")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop at the first failed run")
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="run N fits at once on this machine, each with OMP_NUM_THREADS=1 unless the sweep's env "
                        "sets it (default 1: one after another)")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        raise SweepError(f"--parallel {args.parallel}: the number of fits to run at once, 1 or more")
    if args.parallel != 1 and (args.emit or args.dry_run):
        raise SweepError(f"--parallel runs the fits here; with --{'emit' if args.emit else 'dry-run'} it runs none "
                         f"(an emitted command file runs N at a time with: {XARGS} < FILE)")
    if args.max_array_size is not None and args.max_array_size < 1:
        raise SweepError(f"--max_array_size {args.max_array_size}: the cluster's MaxArraySize, a positive integer")

    check = FitCheck(fit_parser)  # every run's arguments, in a child forked now (fit's parser loads meanwhile)
    extra = ["--mlflow_fallback_local", "true"] if args.mlflow_fallback_local else []
    with check.first():
        sweep, registry = load_sweep(args.file)  # the one read of the registry in this command
        check.start(sweep, args.tracking_uri, extra)
        uri = resolve_tracking_uri(args.tracking_uri, fallback_local=args.mlflow_fallback_local)
        if args.dry_run:
            check_routers(sweep, registry, run_env(sweep))
        steps = plan(sweep, uri) if args.dry_run or args.emit else []
    check.wait()  # before anything is printed, written or run
    if args.dry_run:
        print(f"sweep '{sweep.name}' ({sweep.path}): {len(steps)} runs, experiment '{sweep.experiment}', recipe {sweep.recipe}")
        _write_lines(sys.stdout, (f"  {state:9s} {run.name}" for run, state in steps))
        return 0
    if args.emit:
        return _emit(sweep, steps, args, extra)
    again = shlex.join([command("lrattn"), "sweep", *(sys.argv[2:] if argv is None else argv)])  # as it was typed
    return run_local(sweep, registry, uri, stop_on_failure=args.stop_on_failure, extra=extra, again=again,
                     parallel=args.parallel)


def _emit(sweep: Sweep, steps: list[tuple[SweepRun, str]], args: argparse.Namespace, extra: list[str]) -> int:
    # a local sqlite store is this machine's; launched elsewhere the runs resolve their own store
    suffix = "sh" if args.emit == "commands" else "sbatch"
    out = args.out or str(sweep.experiment_dir / f"sweep-{sweep.name}.{suffix}")
    runs = sum(s not in DONE for _, s in steps)
    size = args.max_array_size or sweep.slurm.get("max_array_size", MAX_ARRAY_SIZE)
    # each file's lines, made as they are written (100,000 commands are ~80 MB of text)
    if args.emit == "commands":
        parts = 1
        progress = Progress(f"[sweep {sweep.name}] writing the commands of {len(steps)} runs", len(steps),
                            after=2.0, every=5.0)
        files: Iterator[Iterable[str]] = iter([command_lines(sweep, steps, args.tracking_uri, extra, progress)])
    else:
        parts = slurm_part_count(steps, size)
        progress = Progress(f"[sweep {sweep.name}] writing {parts} sbatch scripts", parts, after=2.0, every=5.0)
        scripts = slurm_parts(sweep, steps, args.tracking_uri, extra, args.max_array_size, progress)
        first = next(scripts)  # every run finished: that error before anything is written
        files = ([text.removesuffix("\n")] for text in itertools.chain([first], scripts))
    if out == "-":
        if parts > 1:
            raise SweepError(f"sweep '{sweep.name}': {runs} runs need {parts} sbatch scripts at MaxArraySize "
                             f"{size}: give --out FILE (the parts are written beside it) or the cluster's larger "
                             "--max_array_size")
        _write_lines(sys.stdout, next(files))
        progress.done()
        return 0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    paths = [out] if parts == 1 else [_part_path(out, k, parts) for k in range(1, parts + 1)]
    for path, lines in zip(paths, files, strict=True):
        with replacing(path, "w", "sweep script") as file:
            _write_lines(file, lines)
    progress.done()
    if args.emit == "slurm":  # sbatch does not create the folder of --output
        (sweep.experiment_dir / "slurm").mkdir(parents=True, exist_ok=True)
    if len(paths) == 1:
        print(f"[sweep {sweep.name}] wrote {out} ({runs} runs)")
    else:
        pattern = _part_path(out, "*", parts)
        print(f"[sweep {sweep.name}] wrote {len(paths)} sbatch scripts, {paths[0]} to {paths[-1]} ({runs} runs, at "
              f"most {size} a script: MaxArraySize {size}, --max_array_size); submit them with: "
              f"for f in {shlex.quote(pattern).replace('*', chr(39) + '*' + chr(39))}; do sbatch \"$f\"; done")
    return 0


def _write_lines(file: Any, lines: Iterable[str], batch: int = 4096) -> None:
    """Each line and a newline, as print() would, `batch` lines a write (100,000 print calls cost ~1 s)."""
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == batch:
            file.write("\n".join(chunk) + "\n")
            chunk.clear()
    if chunk:
        file.write("\n".join(chunk) + "\n")


def _part_path(out: str, k: int | str, parts: int) -> str:
    """sweep-NAME.sbatch -> sweep-NAME.part007.sbatch (zero-padded: a shell glob lists them in order)."""
    path = Path(out)
    label = str(k).zfill(len(str(parts))) if isinstance(k, int) else k
    return str(path.with_name(f"{path.stem}.part{label}{path.suffix}"))


if __name__ == "__main__":
    sys.exit(main())
