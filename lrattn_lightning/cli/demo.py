"""`lrattn demo`: the README's main job (prepare the embedded corpus, train `small` briefly, point at MLflow)."""

from __future__ import annotations

import time
from pathlib import Path

from lrattn_lightning.cli.lightning import run_lightning
from lrattn_lightning.core.files import packaged
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.core.names import check_name
from lrattn_lightning.train.checkpoint import lock
from lrattn_lightning.train.summary import fit_summary


def demo_main(argv: list[str]) -> int:
    """The README's main job: prepare the embedded corpus, train `small` briefly, point at MLflow."""
    parser = Parser(prog="lrattn demo", description=demo_main.__doc__)
    parser.add_argument("--ablation", default="s-lr-block-n8-r64")
    parser.add_argument("--size", default="small")
    parser.add_argument("--data", default="data/stdlib-docs-byte")
    parser.add_argument("--run_name", default=None, help="default: SIZE-ABLATION-DATE-TIME (each demo a new run)")
    parser.add_argument("--experiment", default=None, help="MLflow experiment name (fit's default)")
    args, rest = parser.parse_known_args(argv)
    for flag, value in (("--experiment", args.experiment), ("--run_name", args.run_name)):
        if value is not None:  # checked before the corpus is prepared; fit checks them again
            rest = [flag, check_name(value, flag), *rest]
    if not Path(args.data, "meta.json").exists():
        from lrattn_lightning.data.prepare import prepare_main

        code = prepare_main(["--source", "stdlib-docs", "--tokenizer", "byte", "--out", args.data])
        if code:  # stopped by a signal, or a worker failed: it said why; no fit on a half-prepared folder
            return code
    recipe = Path("experiments/cpu-demo.yaml")
    recipe = recipe if recipe.is_file() else packaged(str(recipe))
    if args.run_name is None:  # each demo is a new run
        rest = ["--run_name", f"{args.size}-{args.ablation}-{time.strftime('%Y%m%d-%H%M%S')}", *rest]
    try:
        cli = run_lightning(["fit", "--config", str(recipe), "--size", args.size,
                             "--ablation", args.ablation, "--data.data_dir", args.data, *rest])
    finally:
        lock.release_run_locks()
    print("\n" + "\n".join(fit_summary(cli, "[lrattn demo]")))
    return 0
