"""`lrattn demo`: the README's main job (prepare the embedded corpus, train `small` briefly, point at MLflow).

Its fit ends as `lrattn fit` does (cli/lightning.py `run_with_stops`): Ctrl-C, SIGTERM or SIGHUP saves last.ckpt,
marks the MLflow run KILLED and exits 128 + the signal's number with one line naming the signal and the command
that continues the run (the demo names each run by the time it started, so that command names it).
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from lrattn_lightning.core.files import packaged
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.core.names import check_name
from lrattn_lightning.train.summary import command

DEMO_SOURCE = "stdlib-docs"  # the corpus the demo prepares: the bundled Python documentation


def demo_main(argv: list[str]) -> int:
    """The README's main job: prepare the embedded corpus, train `small` briefly, point at MLflow."""
    parser = Parser(prog="lrattn demo", description=demo_main.__doc__)
    parser.add_argument("--ablation", default="s-lr-block-n8-r64")
    parser.add_argument("--size", default="small")
    parser.add_argument("--data", default="data/stdlib-docs-byte")
    parser.add_argument("--run_name", default=None, help="default: SIZE-ABLATION-DATE-TIME (each demo a new run)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment name (fit's default)")
    args, fit_flags = parser.parse_known_args(argv)
    for flag, value in (("--experiment", args.experiment), ("--run_name", args.run_name)):
        if value is not None:  # checked before the corpus is prepared; fit checks them again
            check_name(value, flag)
    if not Path(args.data, "meta.json").exists():
        from lrattn_lightning.data.prepare import prepare_main

        code = prepare_main(["--source", DEMO_SOURCE, "--tokenizer", "byte", "--out", args.data])
        if code:  # stopped by a signal, or a worker failed: it said why; no fit on a half-prepared folder
            return code
    recipe = Path("experiments/cpu-demo.yaml")
    recipe = recipe if recipe.is_file() else packaged(str(recipe))
    run_name = args.run_name or f"{args.size}-{args.ablation}-{time.strftime('%Y%m%d-%H%M%S')}"  # each demo a new run
    experiment = ["--experiment", args.experiment] if args.experiment is not None else []
    fit = ["fit", "--config", str(recipe), "--size", args.size, "--ablation", args.ablation,
           "--data.data_dir", args.data, *experiment, "--run_name", run_name, *fit_flags]
    # how to continue this very run from the folder it was started in: its name, the user's flags and paths
    again = ["demo", "--size", args.size, "--ablation", args.ablation, "--data", args.data, *experiment,
             "--run_name", run_name, *_without(fit_flags, "--ckpt_path"), "--ckpt_path", "last"]
    resume = f"continue with `{command('lrattn')} {shlex.join(again)}`"
    from lrattn_lightning.cli.lightning import (  # (after --help: Lightning takes seconds)
        run_lightning,
        run_with_stops,
    )

    return run_with_stops(lambda: run_lightning(fit), fit=True, prefix="[lrattn demo]", resume=resume,
                          data_notes=not own_corpus(args.data))


def own_corpus(data_dir: str) -> bool:
    """Whether `data_dir` holds the demo's own set-up (the bundled corpus, byte-tokenised: what it prepares), whose
    fit to the size (e.g. embedding rows a byte tokenizer never uses) is the demo's choice, not the user's."""
    from lrattn_lightning.core.errors import InputError
    from lrattn_lightning.data.shards import read_meta

    try:
        meta = read_meta(data_dir)
    except InputError:  # not a prepared folder: fit says so in its own line
        return False
    return meta.get("source") == DEMO_SOURCE and meta.get("tokenizer", {}).get("kind") == "byte"


def _without(flags: list[str], name: str) -> list[str]:
    """`flags` without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == name:
            skip = True
        elif not flag.startswith(name + "="):
            out.append(flag)
    return out
