"""`lrattn sweep FILE`: the runs of a sweep file (tools/sweep_file.py) into one MLflow experiment.

A run is *finished* when the MLflow experiment holds a FINISHED run of its name tagged with its size,
ablation, variant and seed (whichever sweep file of the experiment ran it); finished runs are skipped, and a run with a last.ckpt resumes from it
(`--ckpt_path last`, into the same MLflow run). Locally the runs go one after another, each its own
`lrattn fit` process; for a cluster, `--emit commands` writes the launch commands and `--emit slurm` an
sbatch array script with one `srun lrattn fit ...` per array task (Lightning reads the SLURM environment;
nodes and tasks per node come from the recipe's trainer.num_nodes and trainer.devices).

Every run's full argument list is parsed by `fit`'s own parser before the first run starts (also for
--dry-run and --emit), so a typo in the sweep's `args` or its recipe is one line, not a failed fit per run.
Two sweeps of one experiment may run at once: each run is claimed (a lock in its run folder) right before
it starts and MLflow asked again, so a run another live process holds, or one finished meanwhile, is
skipped with a line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lrattn_lightning.errors import Parser, one_line
from lrattn_lightning.model.registry import closest_names, load_registry, load_yaml_strict, read_yaml_text
from lrattn_lightning.tools.sweep_file import Sweep, SweepError, SweepRun, load_sweep

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# ---- state -----------------------------------------------------------------------------------------
def finished_runs(sweep: Sweep, tracking_uri: str) -> set[SweepRun]:
    """Runs of this sweep that MLflow holds as FINISHED: a run of the experiment with the run's name (its
    folder) and tags size, ablation, seed (and variant), whichever sweep file ran it: two sweeps of one
    experiment that share a run (a screen's seed-0 runs reused by the study) share its folder and its result."""
    from mlflow.tracking import MlflowClient

    from lrattn_lightning.tools.runs import search_all
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


def plan(sweep: Sweep, tracking_uri: str) -> list[tuple[SweepRun, str]]:
    """(run, state) in order; state is 'finished', 'resume' (has last.ckpt) or 'new'."""
    done = finished_runs(sweep, tracking_uri)
    return [(run, "finished" if run in done else "resume" if sweep.checkpoint(run).is_file() else "new")
            for run in sweep.runs]


# ---- every run's fit arguments, checked before the first run starts ---------------------------------
def check_fit_args(sweep: Sweep, tracking_uri: str | None, extra: list[str], parser: Any) -> None:
    """Parse every run's `lrattn fit` arguments with fit's parser (`lightning_cli.fit_parser()`, one for all
    runs); SweepError naming the first bad run, the flag and where it comes from, with the closest valid flags
    for an unknown one."""
    known = set(parser.get_defaults().keys())  # dotted leaf keys: trainer.max_steps, model.lr, run_name, ...
    groups = {".".join(k.split(".")[:i]) for k in known for i in range(1, k.count(".") + 1)}
    recipe = load_yaml_strict(read_yaml_text(Path(sweep.recipe), "recipe"), sweep.recipe) or {}
    recipe_keys = list(_flat_keys(recipe, known, groups)) if isinstance(recipe, dict) else []
    for run in sweep.runs:
        given = ([(k, f"recipe {sweep.recipe}") for k in recipe_keys]
                 + [(k, f"the sweep's args ({sweep.path})") for k in sweep.args]
                 + [(k, f"the args of variant '{run.variant}' ({sweep.path})") for k, _ in run.args])
        for key, origin in given:
            if not _accepted(key, known, groups):
                hint = ", ".join(f"--{k}" for k in closest_names(key, sorted(known)))
                raise SweepError(f"sweep '{sweep.name}', run {run.name}: unknown fit flag --{key} (in {origin}); "
                                 f"closest: {hint}")
        try:
            parser.parse_args(sweep.fit_args(run, tracking_uri)[1:] + extra)  # [1:]: without the subcommand
        except (argparse.ArgumentError, SystemExit) as err:
            raise SweepError(f"sweep '{sweep.name}', run {run.name}: {one_line(err)} (recipe {sweep.recipe}, "
                             f"args of {sweep.path})") from None


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


# ---- claiming a run: two sweeps of one experiment at once -------------------------------------------
@contextlib.contextmanager
def claim(sweep: Sweep, run: SweepRun) -> Iterator[str | None]:
    """Hold RUN_DIR/.sweep.lock while this sweep runs `run`: yields None, or who else holds the run (another
    sweep, or a live `lrattn fit` holding the run folder's own lock) and then this sweep skips it. The fit
    takes RUN_DIR/.lock itself, so the sweep's claim is a lock file of its own; folders made for it and
    left empty are removed again."""
    from lrattn_lightning.train.checkpointing import FileLock, RunFolderError

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
    """Who holds the flock on `path` (checkpointing.FileLock writes 'pid N on HOST since ...'), or None.
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
    from lrattn_lightning.train.checkpointing import PREEMPTED_EXIT_CODE

    registry = load_registry(sweep.registry)
    data_dir = sweep.setting("data.data_dir", "data/stdlib-docs-byte")
    seq_len = sweep.setting("data.seq_len")
    for size in sorted({run.size for run in sweep.runs}):  # missing data fails once, before any run
        validate_data_dir(data_dir, registry.size(size), seq_len)
    env = run_env(sweep)
    check_routers(sweep, registry, env)
    steps = plan(sweep, tracking_uri)
    todo = [run for run, state in steps if state != "finished"]
    print(f"[sweep {sweep.name}] {len(steps)} runs into experiment '{sweep.experiment}' at {tracking_uri}: "
          f"{len(steps) - len(todo)} finished (skipped), {len(todo)} to run", flush=True)
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
    _summary(sweep, results, len(steps) - len(todo), len(todo) - len(results))
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
from lrattn_lightning.errors import InputError, one_line
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


def _env_words(sweep: Sweep) -> list[str]:
    """The sweep's env as NAME=value shell words; PYTHONPATH appended to the environment's own."""
    return [f'{k}="${{PYTHONPATH:+$PYTHONPATH:}}"{shlex.quote(v)}' if k == "PYTHONPATH" else f"{k}={shlex.quote(v)}"
            for k, v in sweep.env.items()]


def emit_commands(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
                  extra: list[str] | None = None) -> str:
    env = " ".join(_env_words(sweep))
    lines = [f"# lrattn sweep {sweep.path} --emit commands: {sum(s != 'finished' for _, s in steps)} runs "
             f"({sum(s == 'finished' for _, s in steps)} finished runs skipped). Run from the repository root;",
             "# for several GPUs or nodes prefix each with srun/torchrun, or set the recipe's trainer.devices/num_nodes."]
    for run, state in steps:
        if state == "finished":
            continue
        args = sweep.fit_args(run, tracking_uri) + (extra or []) + (["--ckpt_path", "last"] if state == "resume" else [])
        lines.append((f"env {env} " if env else "") + shlex.join(["lrattn", *args]))
    return "\n".join(lines) + "\n"


def emit_slurm(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None,
               extra: list[str] | None = None) -> str:
    """An sbatch array script: one array task per unfinished run, each `srun lrattn fit ...`."""
    todo = [run for run, state in steps if state != "finished"]
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
    log_dir = Path(sweep.setting("runs_dir", "runs")) / sweep.experiment / "slurm"
    head = [
        "#!/bin/bash",
        f"# Generated by `lrattn sweep {sweep.path} --emit slurm`: {len(todo)} runs of sweep '{sweep.name}' "
        f"({len(steps) - len(todo)} finished runs skipped).",
        "# Submit from the repository root with `sbatch` (create the log folder first: "
        f"mkdir -p {log_dir}).",
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
    body = ['case "$SLURM_ARRAY_TASK_ID" in']
    for i, run in enumerate(todo):
        ckpt = sweep.checkpoint(run)
        body.append(f"  {i}) CKPT={shlex.quote(str(ckpt))}; "
                    f"ARGS=({' '.join(shlex.quote(a) for a in sweep.fit_args(run, tracking_uri) + (extra or []))}) ;;")
    body += ['  *) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac",
             'if [[ -f "$CKPT" ]]; then ARGS+=(--ckpt_path last); fi',
             'srun lrattn "${ARGS[@]}"']
    return "\n".join(head + body) + "\n"


# ---- command line ----------------------------------------------------------------------------------
def _bool(text: str) -> bool:
    """`--mlflow_fallback_local true`, spelt as `lrattn fit` takes it."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give true or false")
    return value


def main(argv: list[str] | None = None, fit_parser: Callable[[], Any] | None = None) -> int:
    """`lrattn sweep` (`lightning_cli.sweep_main` hands in fit's parser: the cli layer owns it)."""
    from lrattn_lightning.train.tracking import resolve_tracking_uri

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
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop at the first failed run")
    args = parser.parse_args(argv)

    sweep, _ = load_sweep(args.file)
    extra = ["--mlflow_fallback_local", "true"] if args.mlflow_fallback_local else []
    if fit_parser is not None:  # every run's arguments, before any store is opened
        check_fit_args(sweep, args.tracking_uri, extra, fit_parser())
    uri = resolve_tracking_uri(args.tracking_uri, fallback_local=args.mlflow_fallback_local)
    if args.dry_run:
        check_routers(sweep, load_registry(sweep.registry), run_env(sweep))
        steps = plan(sweep, uri)
        print(f"sweep '{sweep.name}' ({sweep.path}): {len(steps)} runs, experiment '{sweep.experiment}', recipe {sweep.recipe}")
        for run, state in steps:
            print(f"  {state:9s} {run.name}")
        return 0
    if args.emit:
        return _emit(sweep, plan(sweep, uri), args, extra)
    return run_local(sweep, uri, stop_on_failure=args.stop_on_failure, extra=extra)


def _emit(sweep: Sweep, steps: list[tuple[SweepRun, str]], args: argparse.Namespace, extra: list[str]) -> int:
    # a local sqlite store is this machine's; launched elsewhere the runs resolve their own store
    text = (emit_commands if args.emit == "commands" else emit_slurm)(sweep, steps, args.tracking_uri, extra)
    suffix = "sh" if args.emit == "commands" else "sbatch"
    out = args.out or str(Path(sweep.setting("runs_dir", "runs")) / sweep.experiment / f"sweep-{sweep.name}.{suffix}")
    if out == "-":
        sys.stdout.write(text)
        return 0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    if args.emit == "slurm":  # sbatch does not create the folder of --output
        (Path(sweep.setting("runs_dir", "runs")) / sweep.experiment / "slurm").mkdir(parents=True, exist_ok=True)
    print(f"[sweep {sweep.name}] wrote {out} ({sum(s != 'finished' for _, s in steps)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
