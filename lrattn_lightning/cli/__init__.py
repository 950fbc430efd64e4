"""The `lrattn` command: one table of subcommands, each imported only when it runs (`lrattn --help` is fast).

Every subcommand takes LightningCLI's flag style (`--max_new_tokens`, `--tracking_uri`); the hyphenated
spelling (`--max-new-tokens`) is accepted as an alias. Bad input is one line, `lrattn: error: ...`, exit 2,
before any work starts. Recipes and sweep files ship inside the package: a path such as
`experiments/cpu-demo.yaml` that does not exist where you run it is read from the installed package.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

from lrattn_lightning.core.errors import InputError, one_line
from lrattn_lightning.core.files import packaged
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.core.names import closest_names
from lrattn_lightning.train.checkpoint import stop
from lrattn_lightning.train.checkpoint.lock import launched_as_rank_zero

# name -> (module:function, one line for `lrattn --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("cli.lightning:run_subcommand", "train a registry entry with a recipe (LightningCLI; --help for its flags)"),
    "validate": ("cli.lightning:run_subcommand", "score a checkpoint on the validation split into its MLflow run"),
    "test": ("cli.lightning:run_subcommand", "score a checkpoint on the test split into its MLflow run"),
    "demo": ("cli.demo:demo_main", "the README's main job: prepare the embedded corpus and train briefly"),
    "list": ("cli:list_main", "the registry's sizes and ablations with parameters and added FLOPs %"),
    "prepare": ("data.prepare:prepare_main", "tokenise a corpus into litdata shards (+ the offline eval tasks)"),
    "eval": ("eval.run:main", "lm-eval tasks on a checkpoint, logged to its training run"),
    "generate": ("tools.generate:generate_main", "continue a prompt from a checkpoint, streaming the text"),
    "chat": ("tools.generate:chat_main", "an interactive loop over a checkpoint"),
    "export": ("tools.export:main", "a checkpoint as a Hugging Face transformers folder"),
    "sweep": ("cli.sweep:sweep_main", "a grid or list of runs from a sweep file (local, commands or SLURM)"),
    "compare": ("tools.compare.compare:main", "the comparison report of an MLflow experiment: table, Figure 1, heatmaps"),
    "bench": ("tools.bench.bench:main", "interleaved step time, memory, MFU and roofline against the baseline"),
    "fidelity": ("tools.fidelity.fidelity:main", "every registry entry against the paper's reference code (docs/fidelity.md)"),
}
LIGHTNING = ("fit", "validate", "test")
# commands with nothing to save when a stop signal comes: it ends them at once with one line and 128 + its number
NOTHING_TO_SAVE = {"eval": "nothing was logged; run the same command again to evaluate"}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: lrattn COMMAND [flags]     (lrattn COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def resolve_shipped_paths(argv: list[str]) -> list[str]:
    """`--config experiments/X.yaml` and `lrattn sweep experiments/sweeps/X.yaml` work from any folder."""
    out = list(argv)
    for i, arg in enumerate(out):
        value = arg.split("=", 1)[1] if arg.startswith("--config=") else arg
        if value.startswith("experiments") and not Path(value).exists():
            found = packaged(value)
            if found is not None:
                out[i] = arg.replace(value, str(found))
    return out


def _function(spec: str) -> Callable[[list[str]], int]:
    module, _, name = spec.partition(":")
    return getattr(import_module(f"lrattn_lightning.{module}"), name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The platform runs offline and writes only where it is told: MLflow 3's usage telemetry (a file under
    # ~/.config/mlflow and calls home) is off unless the user's environment says otherwise.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # our commands print the run's page themselves, in the UI's training view; MLflow's own "View run" links
    # (to a server, without ?workflowType=machine_learning) would stand beside them
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = closest_names(command, list(COMMANDS), cutoff=0.6, fill=False)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        print(f"lrattn: error: unknown command '{command}'{hint} (lrattn --help lists them)", file=sys.stderr)
        return 2
    rest = resolve_shipped_paths(rest)
    if command == "eval":  # lm-eval's and datasets' progress bars: `lrattn eval` reports its own progress
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        if command in LIGHTNING:
            return _function(COMMANDS[command][0])([command, *rest])
        if command in NOTHING_TO_SAVE:  # (from before its module is imported: a Ctrl-C then is no traceback)
            with stop.stop_signals_raise():
                return _function(COMMANDS[command][0])(rest)
        return _function(COMMANDS[command][0])(rest)
    except stop.StopSignal as how:
        if launched_as_rank_zero():  # (the other ranks of `eval --devices N` end with the same code, quietly)
            print(f"lrattn: {command} stopped by {how.name}; {NOTHING_TO_SAVE[command]}", file=sys.stderr)
        else:  # a launched rank gets the group's Ctrl-C and the one rank 0 passes on: the second must not land
            stop.ignore_stop_signals()  # as a KeyboardInterrupt in a finaliser, with its traceback
        return how.exit_code
    except KeyboardInterrupt:  # Ctrl-C where the command does not take it itself (while it is imported, chat, ...)
        print(f"lrattn: {command} stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `lrattn list | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (InputError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as err:
        # bad input (UsageError, CheckpointError, TrackingError, a registry entry, ...) is one line; anything
        # else (a bug, a library failing mid-run) keeps its traceback
        if os.environ.get("LRATTN_DEBUG"):
            raise
        print(f"lrattn: error: {one_line(err)}", file=sys.stderr)
        return 2
    finally:
        stop.await_ranks()  # ranks this process launched and took out of Lightning's watch on a stop end first


# ---- the small subcommands ----------------------------------------------------------------------
def list_main(argv: list[str]) -> int:
    from lrattn_lightning.model.accounting import added_flops_percent, count_params
    from lrattn_lightning.model.registry import load_registry

    parser = Parser(prog="lrattn list", description="List the registry's sizes and ablations.")
    parser.add_argument("--registry", default=None)
    parser.add_argument("--size", default="paper-0.5b", help="size of the parameter/FLOPs columns (default: paper-0.5b)")
    args = parser.parse_args(argv)
    reg = load_registry(args.registry)
    size = reg.size(args.size)
    print(f"registry: {reg.path}")
    print(f"sizes: {', '.join(reg.sizes)}")
    print(f"parameters and added FLOPs at size '{size.name}' (L={size.n_layers}, d={size.d_model}, vocab "
          f"{size.vocab_size}; another with --size NAME)")
    print(f"{'ablation':40s} {'params':>13s} {'added FLOPs %':>13s}  control")
    why: list[str] = []  # the reason of every n/a: the entry does not fit the size, or its router cannot be built
    for name, abl in reg.ablations.items():
        try:
            pct = added_flops_percent(size, abl)
            params, flops = f"{count_params(size, abl):,}", "unknown" if pct is None else f"{pct:.3f}"
        except ValueError as err:
            params, flops = "n/a", "n/a"
            why.append(f"  {name}: {one_line(err)}")
        print(f"{name:40s} {params:>13s} {flops:>13s}  {abl.control or '-'}")
    if why:
        print(f"n/a at size '{size.name}':", *why, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
