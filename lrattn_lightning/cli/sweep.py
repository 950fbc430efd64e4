"""`lrattn sweep` with `lrattn fit`'s own parser: every run's arguments are checked with it before the first run
(tools/sweep/ does the rest)."""

from __future__ import annotations


class _ParserBuilt(Exception):
    pass


class _FitParserOnly:
    """Stands in for LRAttnCLI's `parse_arguments` hook: LightningCLI calls it right after building the parser,
    so raising there hands the parser over before anything is parsed, instantiated or written."""

    def parse_arguments(self, parser, args) -> None:
        raise _ParserBuilt(parser)


def fit_parser():
    """`lrattn fit`'s parser for `lrattn sweep` to check every run's arguments with: the same LRAttnCLI classes
    and arguments, built without subcommands (`run=False`), so it lacks only Trainer.fit's own arguments
    (--ckpt_path, which the sweep sets itself). Lightning is imported here, once the sweep's own flags are read
    (`lrattn sweep --help` does not pay for it)."""
    from lrattn_lightning.cli.lightning import LRAttnCLI, bound_yaml_values
    from lrattn_lightning.data.datamodule import TokenDataModule
    from lrattn_lightning.train.lit_module import LRAttnModule

    bound_yaml_values()  # a run's args are YAML values too, read as `lrattn fit` reads them
    cli = type("SweepFitParser", (_FitParserOnly, LRAttnCLI), {})
    try:  # exit_on_error=False: a bad argument raises ArgumentError instead of printing usage and exiting
        cli(LRAttnModule, TokenDataModule, run=False, parser_kwargs={"exit_on_error": False})
    except _ParserBuilt as built:
        return built.args[0]
    raise RuntimeError("LightningCLI did not call parse_arguments")  # pragma: no cover


def sweep_main(argv: list[str]) -> int:
    """`lrattn sweep` with fit's parser (tools/sweep/sweep.py)."""
    from lrattn_lightning.tools.sweep.sweep import main

    return main(argv, fit_parser=fit_parser)
