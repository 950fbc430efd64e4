"""`lrattn sweep FILE`: the runs of a sweep file (tools/sweep_file.py) into one MLflow experiment.

A run is *finished* when the MLflow experiment holds a FINISHED run tagged with this sweep, size,
ablation, variant and seed; finished runs are skipped, and a run with a last.ckpt resumes from it
(`--ckpt_path last`, into the same MLflow run). Locally the runs go one after another, each its own
`lrattn fit` process; for a cluster, `--emit commands` writes the launch commands and `--emit slurm` an
sbatch array script with one `srun lrattn fit ...` per array task (Lightning reads the SLURM environment;
nodes and tasks per node come from the recipe's trainer.num_nodes and trainer.devices).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lrattn_lightning.errors import Parser
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.sweep_file import Sweep, SweepError, SweepRun, load_sweep

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# ---- state -----------------------------------------------------------------------------------------
def finished_runs(sweep: Sweep, tracking_uri: str) -> set[SweepRun]:
    """Runs of this sweep that MLflow holds as FINISHED (tags sweep, size, ablation, seed)."""
    from mlflow.tracking import MlflowClient

    from lrattn_lightning.tools.runs import search_all
    from lrattn_lightning.train.tracking import store_lock

    with store_lock(tracking_uri):  # a new sqlite store is created by the first client, once
        client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(sweep.experiment)
    if exp is None:
        return set()
    done = set()
    for run in search_all(client, exp.experiment_id, f"tags.sweep = '{sweep.name}'"):
        tags = run.data.tags
        if run.info.status == "FINISHED" and {"size", "ablation", "seed"} <= set(tags):
            with contextlib.suppress(ValueError):
                done.add(SweepRun(tags["size"], tags["ablation"], int(tags["seed"]), tags.get("variant", "")))
    return done


def plan(sweep: Sweep, tracking_uri: str) -> list[tuple[SweepRun, str]]:
    """(run, state) in order; state is 'finished', 'resume' (has last.ckpt) or 'new'."""
    done = finished_runs(sweep, tracking_uri)
    return [(run, "finished" if run in done else "resume" if sweep.checkpoint(run).is_file() else "new")
            for run in sweep.runs]


# ---- running ---------------------------------------------------------------------------------------
def run_local(sweep: Sweep, tracking_uri: str, stop_on_failure: bool = False) -> int:
    """Run the unfinished runs one after another, each as its own `lrattn fit` process."""
    from lrattn_lightning.data.shards import validate_data_dir
    from lrattn_lightning.train.checkpointing import PREEMPTED_EXIT_CODE

    registry = load_registry(sweep.registry)
    data_dir = sweep.setting("data.data_dir", "data/stdlib-docs-byte")
    seq_len = sweep.setting("data.seq_len")
    for size in sorted({run.size for run in sweep.runs}):  # missing data fails once, before any run
        validate_data_dir(data_dir, registry.size(size), seq_len)
    env = {**os.environ, **sweep.env}
    # the runs import the same package as this process, wherever the command is started from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
    steps = plan(sweep, tracking_uri)
    todo = [(run, state) for run, state in steps if state != "finished"]
    print(f"[sweep {sweep.name}] {len(steps)} runs into experiment '{sweep.experiment}' at {tracking_uri}: "
          f"{len(steps) - len(todo)} finished (skipped), {len(todo)} to run", flush=True)
    results: list[tuple[SweepRun, str, float]] = []
    stopped = False
    for i, (run, state) in enumerate(todo, start=1):
        args = sweep.fit_args(run, tracking_uri) + (["--ckpt_path", "last"] if state == "resume" else [])
        print(f"[sweep {sweep.name}] ({i}/{len(todo)}) {run.name}" + (" (resuming from last.ckpt)" if state == "resume" else ""),
              flush=True)
        start = time.time()
        rc, stopped = _run_forwarding_signals([sys.executable, "-m", "lrattn_lightning.cli", *args], env)
        state = "ok" if rc == 0 else ("stopped by SIGTERM" if rc == PREEMPTED_EXIT_CODE else f"failed (exit {rc})")
        results.append((run, state, time.time() - start))
        print(f"[sweep {sweep.name}] {run.name}: {results[-1][1]} after {results[-1][2]:.0f} s", flush=True)
        if stopped:
            print(f"[sweep {sweep.name}] stopped by a signal: no further runs start; run the sweep again to resume",
                  flush=True)
            break
        if rc != 0 and stop_on_failure:
            break
    failed = [r for r in results if r[1] != "ok"]
    not_started = len(todo) - len(results)
    print(f"[sweep {sweep.name}] done: {len(results) - len(failed)} ran, {len(failed)} failed, "
          f"{len(steps) - len(todo)} skipped as finished" + (f", {not_started} not started" if not_started else "")
          + "".join(f"\n  {r.name}: {s}" for r, s, _ in failed), flush=True)
    if stopped:
        return PREEMPTED_EXIT_CODE
    return 1 if failed or not_started else 0


def _run_forwarding_signals(cmd: list[str], env: dict[str, str]) -> tuple[int, bool]:
    """Run one fit; a SIGTERM/SIGINT to the sweep goes on to it (it checkpoints and stops). (exit code, stopped)."""
    proc = subprocess.Popen(cmd, env=env)
    stopped = False

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopped
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait(), stopped
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def emit_commands(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sweep.env.items())
    lines = [f"# lrattn sweep {sweep.path} --emit commands: {sum(s != 'finished' for _, s in steps)} runs "
             f"({sum(s == 'finished' for _, s in steps)} finished runs skipped). Run from the repository root;",
             "# for several GPUs or nodes prefix each with srun/torchrun, or set the recipe's trainer.devices/num_nodes."]
    for run, state in steps:
        if state == "finished":
            continue
        args = sweep.fit_args(run, tracking_uri) + (["--ckpt_path", "last"] if state == "resume" else [])
        lines.append((f"env {env} " if env else "") + shlex.join(["lrattn", *args]))
    return "\n".join(lines) + "\n"


def emit_slurm(sweep: Sweep, steps: list[tuple[SweepRun, str]], tracking_uri: str | None) -> str:
    """An sbatch array script: one array task per unfinished run, each `srun lrattn fit ...`."""
    todo = [run for run, state in steps if state != "finished"]
    if not todo:
        raise SweepError(f"sweep '{sweep.name}': every run is finished; nothing to emit")
    nodes = int(sweep.setting("trainer.num_nodes", 1) or 1)
    devices = sweep.setting("trainer.devices", 1)
    if not isinstance(devices, int):
        raise SweepError(f"{sweep.recipe}: trainer.devices must be an integer for SLURM (tasks per node), got {devices!r}")
    accelerator = sweep.setting("trainer.accelerator", "auto")
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
        f"# turns them into the DDP world: {nodes} node(s) x {devices} task(s) per node = the recipe's",
        "# trainer.num_nodes x trainer.devices. A resubmitted task resumes its run from last.ckpt.",
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
    head += [f"export {k}={shlex.quote(v)}" for k, v in sweep.env.items()]
    body = ['case "$SLURM_ARRAY_TASK_ID" in']
    for i, run in enumerate(todo):
        ckpt = sweep.checkpoint(run)
        body.append(f"  {i}) CKPT={shlex.quote(str(ckpt))}; "
                    f"ARGS=({' '.join(shlex.quote(a) for a in sweep.fit_args(run, tracking_uri))}) ;;")
    body += ['  *) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac",
             'if [[ -f "$CKPT" ]]; then ARGS+=(--ckpt_path last); fi',
             'srun lrattn "${ARGS[@]}"']
    return "\n".join(head + body) + "\n"


# ---- command line ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from lrattn_lightning.train.tracking import resolve_tracking_uri

    parser = Parser(prog="lrattn sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a sweep file, e.g. experiments/sweeps/cpu-study.yaml")
    parser.add_argument("--tracking_uri", "--tracking-uri", default=None,
                        help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--emit", choices=("commands", "slurm"), default=None,
                        help="write launch commands / an sbatch array script instead of running locally")
    parser.add_argument("--out", default=None, help="where --emit writes (default: RUNS_DIR/EXPERIMENT/sweep-NAME.*; '-' = stdout)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop at the first failed run")
    args = parser.parse_args(argv)

    sweep, _ = load_sweep(args.file)
    uri = resolve_tracking_uri(args.tracking_uri, fallback_local=False)
    if args.dry_run:
        steps = plan(sweep, uri)
        print(f"sweep '{sweep.name}' ({sweep.path}): {len(steps)} runs, experiment '{sweep.experiment}', recipe {sweep.recipe}")
        for run, state in steps:
            print(f"  {state:9s} {run.name}")
        return 0
    if args.emit:
        steps = plan(sweep, uri)
        # a local sqlite store is this machine's; launched elsewhere the runs resolve their own store
        emit_uri = args.tracking_uri
        text = (emit_commands if args.emit == "commands" else emit_slurm)(sweep, steps, emit_uri)
        suffix = "sh" if args.emit == "commands" else "sbatch"
        out = args.out or str(Path(sweep.setting("runs_dir", "runs")) / sweep.experiment / f"sweep-{sweep.name}.{suffix}")
        if out == "-":
            sys.stdout.write(text)
        else:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(text)
            if args.emit == "slurm":  # sbatch does not create the folder of --output
                (Path(sweep.setting("runs_dir", "runs")) / sweep.experiment / "slurm").mkdir(parents=True, exist_ok=True)
            print(f"[sweep {sweep.name}] wrote {out} ({sum(s != 'finished' for _, s in steps)} runs)")
        return 0
    return run_local(sweep, uri, stop_on_failure=args.stop_on_failure)


if __name__ == "__main__":
    sys.exit(main())
