"""A sweep file is checked whole before any run starts (issue 19, item 7): bad fields, unknown names (with the
closest ones), missing data, and every run's fit arguments parsed by fit's own parser, in one line and exit 2 with
nothing run or written; the fallback store's flag reaches every fit. The sweeps that run are test_sweep.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.prepare import prepared_corpus
from helpers.runs import write_sweep
from helpers.tracking import free_port

from lrattn_lightning.cli import main
from lrattn_lightning.tools.sweep.file import load_sweep


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepared_corpus(tmp_path_factory, 80)


# ---- bad sweep files fail before any run starts ---------------------------------------------------------
def _fails(folder: Path, monkeypatch, capsys, sweep_file: Path, *needles: str) -> None:
    monkeypatch.chdir(folder)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["sweep", str(sweep_file)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert not (folder / "runs").exists() and not (folder / "mlflow.db").exists()


def test_unknown_ablation_fails_before_any_run(data_dir, tmp_path, monkeypatch, capsys):
    path = write_sweep(tmp_path, data_dir, ablations=["baseline", "s-lr-blok-n8-r64"])
    _fails(tmp_path, monkeypatch, capsys, path, "field 'ablations'", "unknown ablation 's-lr-blok-n8-r64'",
           "s-lr-block-n8-r64")


@pytest.mark.parametrize("changes, needles", [
    ({"sizes": ["tyni"]}, ("field 'sizes'", "unknown size 'tyni'", "tiny")),
    ({"seed": [0]}, ("field 'seed'", "unknown field", "seeds")),
    ({"seeds": None}, ("field 'seeds'", "needs sizes, ablations and seeds")),
    ({"ablations": ["s-lr-full-r64"]}, ("s-lr-full-r64", "rank")),  # r=64 > d=32 at size tiny
    ({"recipe": "nope.yaml"}, ("field 'recipe'", "nope.yaml")),
    ({"runs": [{"size": "tiny", "ablation": "baseline", "seed": 0}]}, ("field 'runs[0]'", "appears twice")),
    ({"args": {"--trainer.max_steps": 2}}, ("field 'args'", "without dashes")),
    ({"slurm": {"nodes": 2}}, ("field 'slurm.nodes'", "unknown field")),
    ({"runs": [{"size": "tiny", "ablation": "baseline", "seed": 5, "args": {"model.lr": 1.0}}]},
     ("field 'runs[0].variant'", "needs a variant label")),
    ({"runs": [{"size": "tiny", "ablation": "baseline", "seed": 5, "variant": "Big LR", "args": {"model.lr": 1.0}}]},
     ("field 'runs[0].variant'", "lower-case")),
    ({"runs": [{"size": "tiny", "ablation": "baseline", "seed": 5, "variant": "x", "args": {"run_name": "y"}}]},
     ("field 'runs[0].args'", "set by the sweep itself")),
    ({"runs": [{"size": "tiny", "ablation": "baseline", "seed": 5, "variant": "x", "flags": {}}]},
     ("field 'runs[0]'", "optionally variant")),
])
def test_bad_sweep_files_name_the_field(data_dir, tmp_path, monkeypatch, capsys, changes, needles):
    path = write_sweep(tmp_path, data_dir, **changes)
    _fails(tmp_path, monkeypatch, capsys, path, *needles)


def test_missing_data_fails_before_any_run(tmp_path, monkeypatch, capsys):
    path = write_sweep(tmp_path, tmp_path / "no-data")
    _fails(tmp_path, monkeypatch, capsys, path, "lrattn prepare")


# ---- every run's fit arguments are parsed before the first run (issue 19, item 7) ----------------------
def _sweep_fails(folder: Path, monkeypatch, capsys, argv: list[str], *needles: str) -> None:
    """`lrattn sweep ARGV` exits 2 with ONE line holding `needles`, and nothing was run or written."""
    monkeypatch.chdir(folder)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["sweep", *argv]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and err.startswith("lrattn: error: "), err
    for needle in needles:
        assert needle in err, err
    assert "usage" not in err and "(1/" not in out
    assert not (folder / "runs").exists() and not (folder / "mlflow.db").exists()


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("where", ["args", "recipe", "variant"])
def test_a_flag_typo_in_args_or_recipe_fails_before_any_run(data_dir, tmp_path, monkeypatch, capsys, where, dry_run):
    runs = [{"size": "tiny", "ablation": "baseline", "seed": 7, "variant": "long",
             "args": {"trainer.max_stpes" if where == "variant" else "trainer.max_steps": 4}}]
    path = write_sweep(tmp_path, data_dir, runs=runs, **({"args": {"trainer.max_stpes": 4}} if where == "args" else {}))
    if where == "recipe":  # the typo inside the recipe's trainer mapping
        recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
        recipe["trainer"]["max_stpes"] = 4
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    origin = {"args": "the sweep's args", "recipe": "recipe recipe.yaml", "variant": "the args of variant 'long'"}[where]
    first = "tiny-baseline-long-seed7" if where == "variant" else "tiny-baseline-seed0"
    _sweep_fails(tmp_path, monkeypatch, capsys, [str(path), *(["--dry-run"] if dry_run else [])],
                 f"run {first}:", "unknown fit flag --trainer.max_stpes", origin, "closest: --trainer.max_steps")


def test_a_bad_value_and_an_unknown_top_level_key_fail_before_any_run(data_dir, tmp_path, monkeypatch, capsys):
    path = write_sweep(tmp_path, data_dir, args={"trainer.max_steps": "many"})
    _sweep_fails(tmp_path, monkeypatch, capsys, [str(path), "--dry-run"], "run tiny-baseline-seed0:",
                 "trainer.max_steps", "many")
    path = write_sweep(tmp_path, data_dir)
    recipe = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "chekpoint_every": 2}))
    _sweep_fails(tmp_path, monkeypatch, capsys, [str(path), "--emit", "commands", "--out", "-"],
                 "unknown fit flag --chekpoint_every", "closest: --checkpoint_every")


def test_fit_parser_accepts_what_fit_accepts(data_dir, tmp_path):
    """No false alarms: callbacks with their own arguments and the sweep's own flags parse."""
    from lrattn_lightning.cli.sweep import fit_parser
    from lrattn_lightning.tools.sweep.sweep import check_fit_args

    args = {"trainer.callbacks+": "lrattn_lightning.eval.callback.EvalCallback", "trainer.callbacks.tasks": "local",
            "model.lr": 0.01, "data.seq_len": 16, "runs_dir": "elsewhere"}
    sweep, _ = load_sweep(write_sweep(tmp_path, data_dir, args=args))
    check_fit_args(sweep, "sqlite:///x.db", ["--mlflow_fallback_local", "true"], fit_parser())
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "elsewhere").exists()


def test_help_lists_each_flag_once_and_offers_the_fallback(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert out.count("--tracking_uri") == 2  # the usage line and the options list (was 3: listed twice)
    assert "--mlflow_fallback_local" in out


def test_fallback_local_reaches_every_fit_when_the_server_is_down(data_dir, tmp_path, monkeypatch, capsys):
    """The unreachable-server message advises --mlflow_fallback_local true: sweep takes it and passes it on."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, data_dir)
    down = f"http://127.0.0.1:{free_port()}"
    assert main(["sweep", str(path), "--tracking_uri", down, "--dry-run"]) == 2
    assert "--mlflow_fallback_local true" in capsys.readouterr().err
    assert main(["sweep", str(path), "--tracking_uri", down, "--mlflow_fallback_local", "true",
                 "--emit", "commands", "--out", "-"]) == 0
    out, err = capsys.readouterr()
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(commands) == 4 and all(c.endswith("--mlflow_fallback_local true") for c in commands)
    assert f"{down} unreachable" in err and "logging to sqlite:///mlflow.db instead" in err


@pytest.mark.parametrize("variant, seed, too_long", [("v" * 80, 0, None), ("v" * 80, 10, 101), ("v" * 79, -10, 101),
                                                     ("v" * 79, 1, None)])
def test_a_run_name_too_long_by_its_seed_alone_is_refused(data_dir, tmp_path, variant, seed, too_long):
    """A run's name is checked once per (size, ablation, variant) and whole only where its length needs it: the
    seed's digits alone can make `tiny-baseline-VARIANT-seedN` one character too long (at most 100)."""
    from lrattn_lightning.tools.sweep.file import SweepError

    runs = [{"size": "tiny", "ablation": "baseline", "seed": 5, "variant": "a", "args": {"model.lr": 0.01}},
            {"size": "tiny", "ablation": "baseline", "seed": seed, "variant": variant, "args": {"model.lr": 0.01}}]
    path = write_sweep(tmp_path, data_dir, runs=runs)
    if too_long is None:
        assert len(load_sweep(path)[0].runs[-1].name) <= 100
        return
    with pytest.raises(SweepError, match=rf"field 'runs\[1\] \(the run name\)': value .* is too long \({too_long} "):
        load_sweep(path)
