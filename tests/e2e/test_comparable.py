"""Comparisons that cannot mislead (issue 30): one row is one recipe, every kind shows its routing, sweeps and
own routers work as documented, a sweep's terminal shows one line per run start, progress and result.

One study per module, in a real sqlite MLflow store: the README's own router (its two files taken from the README
as they stand) and the baseline run as a real `lrattn sweep` process started from another folder (registry and
PYTHONPATH relative to the sweep file); every other routing kind, an upcycled run, a rerun and a run of another
schedule length are fits in this process with the sweep's own arguments. The tests read that one study back.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers.paths import REPO_ROOT
from helpers.prepare import prepared_corpus
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main
from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops_percent, core_flops, count_params, sources_per_site
from lrattn_lightning.model.registry import load_registry, parse_registry
from lrattn_lightning.tools.sweep.file import SweepRun, load_sweep

REPO = REPO_ROOT
EXTENDING = REPO / "docs" / "extending.md"
LRATTN = str(Path(sys.executable).with_name("lrattn"))
KINDS = ["denseformer", "mhc-n4", "delta-attnres-null", "gated-residual", "s-lr-grid-n4-r16"]  # fitted in process
SWEPT = ["baseline", "my-router"]  # by the sweep process
UPCYCLED, LONG, RERUN = "tiny-denseformer-upcycled", "tiny-baseline-6steps", "tiny-baseline-seed0-rerun"


def readme_files() -> dict[str, str]:
    """docs/extending.md's own-router example: the code blocks of 'Writing your own router' that open with a file
    name."""
    text = EXTENDING.read_text()
    section = text[text.index("## Writing your own router"):]
    files = {}
    for body in re.findall(r"```(?:python|yaml)\n(.*?)```", section, re.S):
        first = body.splitlines()[0]
        if first.startswith("# ") and first.split()[1].endswith((".py", ".yaml")):
            files[first.split()[1]] = body
    return files


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    data = prepared_corpus(tmp_path_factory, 80, cloze_items=8, perplexity_documents=4)
    root = tmp_path_factory.mktemp("study")
    proj, work = root / "proj", root / "work"
    (proj / "my_pkg").mkdir(parents=True)
    work.mkdir()
    (proj / "my_pkg" / "__init__.py").write_text("")
    files = readme_files()
    for name, body in files.items():
        (proj / name).write_text(body)
    (proj / "recipe.yaml").write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 4, "val_check_interval": 4, "limit_val_batches": 2,
                    "num_sanity_val_steps": 0, "log_every_n_steps": 1, "enable_progress_bar": False},
        "model": {"warmup_steps": 1}, "data": {"data_dir": str(data), "batch_size": 2}, "checkpoint_every": 4,
        "progress_every": 2}))
    sweep = {"name": "kinds", "doc": "every kind once", "recipe": "recipe.yaml", "registry": "my-registry.yaml",
             "experiment": "kinds", "sizes": ["tiny"], "ablations": SWEPT, "seeds": [0],
             "env": {"PYTHONPATH": ".", "OMP_NUM_THREADS": "1"}}
    (proj / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    swept = subprocess.run([LRATTN, "sweep", "../proj/sweep.yaml"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=600)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    uri = f"sqlite:///{work / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        loaded, _ = load_sweep("../proj/sweep.yaml")
        args = {abl: loaded.fit_args(SweepRun("tiny", abl, 0), uri) for abl in ["baseline", *KINDS]}
        base_ckpt = work / "runs/kinds/tiny-baseline-seed0/checkpoints/last.ckpt"
        for extra in ([*args[a]] for a in KINDS):
            assert main(extra) == 0
        assert main([*args["denseformer"], "--init_from", str(base_ckpt), "--run_name", UPCYCLED]) == 0
        assert main([*args["baseline"], "--trainer.max_steps", "6", "--run_name", LONG]) == 0
        assert main([*args["baseline"], "--run_name", RERUN]) == 0
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kinds")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    return {"root": root, "proj": proj, "work": work, "uri": uri, "client": client, "runs": runs, "data": data,
            "sweep_out": swept.stdout, "sweep_err": swept.stderr, "files": files}


def _artifact(client, run, path: str, tmp: Path):
    return json.loads(Path(client.download_artifacts(run.info.run_id, path, str(tmp))).read_text())


# ---- sweeps: env, a relative registry, a quiet terminal, the compare command -------------------------------
def test_a_sweep_from_another_folder_honours_env_and_its_registry_and_shows_one_line_per_event(study):
    out, work = study["sweep_out"], study["work"]
    lines = out.splitlines()
    assert all(line.startswith("[sweep kinds]") for line in lines), out  # no model summary, GPU lines, MLflow links
    assert not re.search(r"GPU available|TPU available|┏|View run|LOCAL_RANK", out + study["sweep_err"])
    for i, name in enumerate(["tiny-baseline-seed0", "tiny-my-router-seed0"], start=1):
        head = f"[sweep kinds] ({i}/2) {name}"
        mine = [line for line in lines if line.startswith(head + ":") or line.startswith(f"[sweep kinds] {name}:")]
        assert mine[0] == f"{head}: training; its output goes to runs/kinds/{name}/fit.log", out
        assert [line.split(": ", 1)[1].split(":")[0] for line in mine[1:3]] == ["step 2/4 (50 %)", "step 4/4 (100 %)"]
        assert re.fullmatch(rf"\[sweep kinds\] {name}: ok after \d+ s, finished at step 4: val/bpb [\d.]+, "
                            r"val/loss [\d.]+", mine[3]), mine
        assert len(mine) == 4, mine
        log = (work / f"runs/kinds/{name}/fit.log").read_text()
        assert "[lrattn fit] finished at step 4" in log and "Total params" in log  # the fit's whole output is kept
    assert lines[-1] == "[sweep kinds] compare the runs: lrattn compare --experiment kinds" or \
        lines[-1].endswith("lrattn compare --experiment kinds"), lines[-1]
    run = study["runs"]["tiny-my-router-seed0"]
    assert run.info.status == "FINISHED" and run.data.params["router"] == "my_pkg.routers:MyRouter"


def test_dry_run_imports_every_external_router_in_the_runs_environment(study, monkeypatch, capsys):
    proj = study["proj"]
    raw = yaml.safe_load((proj / "sweep.yaml").read_text())
    raw["env"] = {"OMP_NUM_THREADS": "1"}  # no PYTHONPATH: the router's folder is not importable
    (proj / "sweep-noenv.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(study["work"])
    capsys.readouterr()
    assert main(["sweep", "../proj/sweep-noenv.yaml", "--dry-run", "--tracking_uri", study["uri"]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "my-router: " in err and "cannot import module 'my_pkg.routers'" in err, err
    assert "PYTHONPATH" in err
    assert not (study["work"] / "runs/kinds-noenv").exists()
    assert main(["sweep", "../proj/sweep.yaml", "--dry-run", "--tracking_uri", study["uri"]]) == 0
    assert "finished  tiny-my-router-seed0" in capsys.readouterr().out


# ---- the README's own router, literally ----------------------------------------------------------------------
def test_the_readme_router_example_runs_as_written(study):
    assert set(study["files"]) == {"my_pkg/routers.py", "my-registry.yaml"}
    reg = load_registry(study["proj"] / "my-registry.yaml")
    assert "baseline" in reg.ablations and "tiny" in reg.sizes  # the shipped entries, included
    params = study["runs"]["tiny-my-router-seed0"].data.params
    base = count_params(reg.model("tiny", "baseline"))
    size = reg.size("tiny")
    assert int(params["params"]) == base + size.n_sublayers * 2  # the mix: 2L read sites x width 2
    assert float(params["added_flops_pct"]) == pytest.approx(
        100 * 2 * size.d_model * 2 * size.n_sublayers / core_flops(size), rel=1e-5)


def test_a_user_registry_includes_the_shipped_one_strictly(tmp_path):
    shipped = load_registry(REPO / "registry.yaml")
    path = tmp_path / "mine.yaml"
    path.write_text("include: builtin\nablations:\n  wide-dense:\n    extends: denseformer\n    doc: d\n    dilation: 2\n")
    mine = load_registry(path)
    assert list(mine.ablations)[: len(shipped.ablations) - 1] != [] and set(shipped.ablations) < set(mine.ablations)
    assert mine.ablation("wide-dense").control == shipped.ablation("denseformer").control
    assert mine.sha256 != shipped.sha256 and mine.path == str(path)
    for text, says in (("include: builtin\nablations:\n  baseline: {doc: d, control: null}\n",
                        "ablations.baseline: field 'baseline': already in the builtin registry"),
                       ("include: mine.yaml\n", "field 'include': only 'builtin'"),
                       ("include: builtin\nablation: {}\n", "field 'ablation': unknown section")):
        path.write_text(text)
        with pytest.raises(InputError) as err:
            load_registry(path)
        assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(InputError, match="include"):
        parse_registry({"include": "builtin"})


def test_list_says_why_an_external_entry_is_na(study, monkeypatch, capsys):
    monkeypatch.chdir(study["proj"].parent)
    assert main(["list", "--registry", str(study["proj"] / "my-registry.yaml"), "--size", "tiny"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^my-router +n/a +n/a  baseline$", out, re.M), out
    reason = next(line for line in out.splitlines() if line.startswith("  my-router: "))
    assert "cannot import module 'my_pkg.routers'" in reason and "PYTHONPATH" in reason


# ---- every kind logs its routing, in one format --------------------------------------------------------------
def test_every_kind_logs_its_mixing_weights_per_validation(study, tmp_path):
    client, runs = study["client"], study["runs"]
    reg = load_registry(study["proj"] / "my-registry.yaml")
    found = {}
    for name in ["my-router", *KINDS]:
        run = runs[f"tiny-{name}-seed0"]
        table = _artifact(client, run, "routing/weights.json", tmp_path / name)
        assert table["step"] == 4 and table["sites_by_sources"], name
        assert {"routing/heatmap.png"} <= {a.path for a in client.list_artifacts(run.info.run_id, "routing")}
        found[name] = table
    ckpt = {n: torch.load(study["work"] / f"runs/kinds/tiny-{n}-seed0/checkpoints/last.ckpt",
                          weights_only=True)["state_dict"] for n in ("denseformer", "my-router")}
    # DenseFormer's alpha: the checkpoint's weights at step 4, one row per DWA over x_0..x_t
    assert found["denseformer"]["kind"] == "denseformer"
    for t, row in zip((1, 2), found["denseformer"]["sites_by_sources"], strict=True):
        assert row == pytest.approx(ckpt["denseformer"][f"model.router.dwa.{t}"].tolist(), abs=1e-7)
    # the own router's mix: what its state.weights held, its parameters
    torch.testing.assert_close(torch.tensor(found["my-router"]["sites_by_sources"]), ckpt["my-router"]["model.router.mix"],
                               atol=1e-7, rtol=0)
    # softmax reads: every row sums to 1, one entry per source
    cfg = reg.model("tiny", "s-lr-grid-n4-r16")
    assert [len(r) for r in found["s-lr-grid-n4-r16"]["sites_by_sources"]] == sources_per_site(cfg)
    delta = found["delta-attnres-null"]
    assert [len(r) for r in delta["sites_by_sources"]] == [1, 3, 4, 5] and delta["source_labels"][0] == "null"
    for name in ("s-lr-grid-n4-r16", "delta-attnres-null"):
        for row in found[name]["sites_by_sources"]:
            assert math.fsum(row) == pytest.approx(1.0, abs=1e-5)
        assert "routing/sites.json" in {a.path for a in client.list_artifacts(runs[f"tiny-{name}-seed0"].info.run_id, "routing")}
    # mHC: the width block of every row is doubly stochastic (its mean over tokens too); beta near 1
    n = 4
    for row in found["mhc-n4"]["sites_by_sources"]:
        width = torch.tensor(row[n:n + n * n]).view(n, n)
        torch.testing.assert_close(width.sum(1), torch.ones(n), atol=1e-4, rtol=0)
        torch.testing.assert_close(width.sum(0), torch.ones(n), atol=1e-3, rtol=0)
        assert all(0.0 < a < 1.0 for a in row[:n])  # the read through a sigmoid
    # the gates: [alpha, 1 - alpha] per sublayer, alpha as gates.json has it
    gates = _artifact(client, runs["tiny-gated-residual-seed0"], "routing/gates.json", tmp_path / "gates")
    assert [r[0] for r in found["gated-residual"]["sites_by_sources"]] == pytest.approx(gates["alpha"], abs=1e-6)
    assert all(r[0] + r[1] == pytest.approx(1.0, abs=1e-6) for r in found["gated-residual"]["sites_by_sources"])
    # the plain residual stream routes nothing and logs no weights
    assert client.list_artifacts(runs["tiny-baseline-seed0"].info.run_id, "routing") == []


# ---- the recipe fingerprint ------------------------------------------------------------------------------------
def test_every_run_carries_its_recipe_fingerprint_and_parts(study):
    runs = study["runs"]
    meta = json.loads((study["data"] / "meta.json").read_text())
    checksum = hashlib.sha256(json.dumps(meta["checksums"], sort_keys=True).encode()).hexdigest()[:16]
    prints = {}
    for name, run in runs.items():
        if "lrattn.summary" in run.data.tags:
            continue
        parts = json.loads(run.data.tags["lrattn.recipe_parts"])
        assert run.data.tags["lrattn.recipe"] == hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
        assert parts["data"] == checksum and parts["tokens_per_step"] == 2 * 32 and parts["seq_len"] == 32
        assert parts["max_steps"] == (6 if name == LONG else 4) and parts["precision"] == "32-true"
        base_id = runs["tiny-baseline-seed0"].info.run_id
        assert parts["init_from"] == (f"run {base_id} step 4" if name == UPCYCLED else "none")
        prints[name] = run.data.tags["lrattn.recipe"]
    same = {prints[n] for n in prints if n not in (UPCYCLED, LONG)}
    assert len(same) == 1 and len({*same, prints[UPCYCLED], prints[LONG]}) == 3  # the sweep's runs share one
    assert json.loads(runs["tiny-gated-residual-seed0"].data.tags["lrattn.method"]) == {
        "gate_freeze_steps": 0, "gate_release_loss": None, "gate_grad_normalize": False}


def test_the_run_description_says_which_flops_figure_is_the_papers(study):
    reg = load_registry(study["proj"] / "my-registry.yaml")
    note = study["runs"]["tiny-s-lr-grid-n4-r16-seed0"].data.tags["mlflow.note.content"]
    ours = added_flops_percent(reg.model("tiny", "s-lr-grid-n4-r16"))
    paper = added_flops_percent(reg.size("paper-0.5b"), reg.ablation("s-lr-grid-n4-r16"))
    assert f"Added FLOPs of this run: {ours:.3f} % of its core (size tiny" in note, note
    assert f"The paper's figure for this entry is {paper:.3f} % (at its model, size paper-0.5b" in note, note
    assert "this run's figure is larger" in note


# ---- compare: one row per recipe, what was left apart said ------------------------------------------------------
def test_compare_never_pools_or_pairs_runs_of_different_recipes(study, capsys):
    report, client, runs = study["root"] / "report", study["client"], study["runs"]
    assert main(["compare", "--experiment", "kinds", "--tracking_uri", study["uri"], "--out", str(report),
                 "--no-summary-run"]) == 0
    with (report / "table.csv").open() as f:
        rows = {(r["row"], r["recipe"]): r for r in csv.DictReader(f)}
    loss = {name: run.data.metrics["val/loss"] for name, run in runs.items() if "val/loss" in run.data.metrics}
    upcycled = "denseformer (upcycled from tiny-baseline-seed0, step 4)"
    assert set(rows) == {("baseline", "A"), ("baseline", "B"), (upcycled, "C"), ("my-router", "A"),
                         *((k, "A") for k in KINDS)}, sorted(rows)
    base = rows[("baseline", "A")]
    assert base["n_seeds"] == "1" and base["run_ids"] == runs[RERUN].info.run_id  # the latest of two, not pooled
    assert rows[("baseline", "B")]["run_ids"] == runs[LONG].info.run_id
    assert float(rows[("my-router", "A")]["delta_control"]) == pytest.approx(loss["tiny-my-router-seed0"] - loss[RERUN])
    assert float(rows[("denseformer", "A")]["delta_baseline"]) == pytest.approx(loss["tiny-denseformer-seed0"] - loss[RERUN])
    up = rows[(upcycled, "C")]
    assert up["ablation"] == "denseformer" and up["delta_control"] == up["delta_baseline"] == ""  # no silent pairing
    assert up["run_ids"] == runs[UPCYCLED].info.run_id and up["upcycled_from"] == "tiny-baseline-seed0, step 4"
    table = (report / "table.md").read_text()
    head = table.splitlines()[0]
    assert "| recipe |" in head
    base_id = runs["tiny-baseline-seed0"].info.run_id
    assert "differs from A in max_steps 6 (A: 4)" in table, table
    assert f"differs from A in init_from run {base_id} step 4 (A: none)" in table, table
    assert f"Δ vs control and vs baseline — where `baseline` ran only under recipe A, B, not C: `{upcycled}`" in table, table
    assert f"counted `{RERUN}`" in table and "not counted: `tiny-baseline-seed0`" in table, table
    # the figures: every kind's routing weights drawn, the upcycled row's too
    from lrattn_lightning.tools.compare.heatmaps import routing_matrices
    from lrattn_lightning.tools.compare.table import read_runs, summarise

    drawn = routing_matrices(client, summarise(read_runs(client, "kinds")))
    assert set(drawn) == {f"{k} [A]" for k in ["my-router", *KINDS]} | {f"{upcycled} [C]"}, sorted(drawn)
    assert (report / "routing_heatmaps.png").stat().st_size > 10000


def test_runs_from_before_the_fingerprint_group_among_themselves(study, tmp_path, capsys):
    """Runs without the recipe tags (older lrattn): their recipe is rebuilt from their params, said so."""
    client, runs = study["client"], study["runs"]
    exp = client.create_experiment("legacy")
    for name in ("tiny-baseline-seed0", "tiny-denseformer-seed0"):
        old = runs[name]
        made = client.create_run(exp, run_name=name, tags={k: v for k, v in old.data.tags.items()
                                                            if k.startswith(("ablation", "size", "control", "seed"))})
        for key, value in old.data.params.items():
            client.log_param(made.info.run_id, key, value)
        client.log_metric(made.info.run_id, "val/loss", old.data.metrics["val/loss"], step=4)
        client.set_terminated(made.info.run_id, "FINISHED")
    assert main(["compare", "--experiment", "legacy", "--tracking_uri", study["uri"], "--out", str(tmp_path),
                 "--no-summary-run"]) == 0
    table = (tmp_path / "table.md").read_text()
    assert "fingerprint `legacy-" in table and "predate the recipe fingerprint" in table, table
    with (tmp_path / "table.csv").open() as f:
        dense = next(r for r in csv.DictReader(f) if r["ablation"] == "denseformer")
    assert float(dense["delta_control"]) == pytest.approx(
        runs["tiny-denseformer-seed0"].data.metrics["val/loss"] - runs["tiny-baseline-seed0"].data.metrics["val/loss"])


# ---- figures: nothing covers data, curves show the whole run ------------------------------------------------------
def test_no_legend_or_label_covers_a_point_and_curves_show_the_whole_run(study):
    from lrattn_lightning.tools.compare.figures import curves_figure, loss_vs_flops_figure
    from lrattn_lightning.tools.compare.table import read_runs, summarise

    rows = summarise(read_runs(study["client"], "kinds"))
    fig = loss_vs_flops_figure(rows, "test")
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    points = [ax.transData.transform((r.added_flops_pct, r.mean)) for r in rows if not math.isnan(r.added_flops_pct)]
    covers = [ax.get_legend().get_window_extent(renderer)] + [t.get_window_extent(renderer) for t in ax.texts]
    assert len(ax.texts) == len(points)  # every point named
    for box in covers:
        for x, y in points:
            assert not (box.x0 - 3 <= x <= box.x1 + 3 and box.y0 - 3 <= y <= box.y1 + 3), (box, x, y)
    for i, a in enumerate(ax.texts):  # and labels do not cover one another
        for b in ax.texts[i + 1:]:
            assert not a.get_window_extent(renderer).overlaps(b.get_window_extent(renderer)), (a.get_text(), b.get_text())
    curves = curves_figure(rows, "test")
    whole, zoom, val = curves.axes[:3]
    assert whole.get_xlim()[0] <= 0 and whole.get_xlim()[1] >= 6 and val.get_xlim()[1] >= 6  # the 6-step run, whole
    assert min(min(line.get_xdata()) for line in whole.get_lines()) == 0  # from the first logged step
    assert zoom.get_xlim() == (3, 6) and "zoom" in zoom.get_title()


# ---- eval's terminal -----------------------------------------------------------------------------------------
def test_eval_prints_no_progress_bars(study):
    ckpt = study["work"] / "runs/kinds/tiny-denseformer-seed0/checkpoints/last.ckpt"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    done = subprocess.run([LRATTN, "eval", "--checkpoint", str(ckpt), "--tasks", "local", "--limit", "4",
                           "--tracking_uri", study["uri"]], cwd=study["work"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    both = done.stdout + done.stderr
    assert "it/s" not in both and "examples/s" not in both and "View run" not in both, both[-3000:]
    assert "[lrattn eval] 16/16 loglikelihood requests scored" in both


def test_rows_split_by_recipe_and_method_and_pair_only_within_a_recipe():
    """summarise on records as read_runs makes them: a variant pairs with its plain ablation under one recipe; runs
    of one ablation whose routing's own training options differ (no variant label) are two labelled rows; a run of
    another recipe is its own row and pairs with nothing there."""
    from lrattn_lightning.tools.compare.table import RunRecord, summarise

    def run(ablation, seed, loss, recipe="r1", method="", control="baseline", start=0):
        return RunRecord(run_id=f"{ablation}-{seed}-{recipe}-{method}", name=f"{ablation}-{seed}", size="tiny",
                         ablation=ablation, control=control, seed=seed, start_time=start, val_loss=loss, params=1,
                         added_flops_pct=0.0 if ablation == "baseline" else 1.0, metrics={}, recipe=recipe,
                         parts={"max_steps": 4}, method=method)

    m0, m1 = '{"gate_freeze_steps": 0}', '{"gate_freeze_steps": 50}'
    records = [run("baseline", 0, 3.0, control=None), run("baseline", 1, 3.2, control=None),
               run("gated", 0, 2.9, method=m0), run("gated", 1, 3.0, method=m0),
               run("gated+freeze", 0, 2.7, method=m1, control="gated"), run("gated+freeze", 1, 2.8, method=m1, control="gated"),
               run("gated", 2, 2.5, method=m1),
               run("baseline", 0, 2.0, recipe="r2", control=None), run("gated", 0, 1.9, recipe="r2", method=m0)]
    rows = {(r.label, r.group): r for r in summarise(records)}
    assert set(rows) == {("baseline", "A"), ("gated (gate_freeze_steps=0)", "A"), ("gated (gate_freeze_steps=50)", "A"),
                         ("gated+freeze", "A"), ("baseline", "B"), ("gated", "B")}
    gated = rows[("gated (gate_freeze_steps=0)", "A")]
    assert gated.delta_control == pytest.approx((2.9 + 3.0) / 2 - (3.0 + 3.2) / 2) and gated.p_control is not None
    variant = rows[("gated+freeze", "A")]
    assert variant.delta_control is None and "2 settings" in variant.why_no_control  # which gated? not guessed
    assert variant.delta_baseline == pytest.approx(2.75 - 3.1)
    assert rows[("gated", "B")].delta_control == pytest.approx(1.9 - 2.0)  # within recipe B only
    assert rows[("gated", "B")].p_control is None  # one seed a side


def test_mlflows_own_view_run_links_stay_off_a_servers_terminal(study, tmp_path, monkeypatch, capsys):
    """Against a real MLflow server (where MLflow prints '🏃 View run ... at' when a run ends), compare ends its
    summary run and prints only its own lines."""
    from helpers.tracking import mlflow_server

    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)  # lrattn sets it; not the user
    source = study["runs"]["tiny-baseline-seed0"]
    with mlflow_server(tmp_path) as (_, uri):
        client = MlflowClient(uri)
        made = client.create_run(client.create_experiment("served"), run_name="one")
        for key in ("ablation", "size", "params", "added_flops_pct", "train_max_steps"):
            client.log_param(made.info.run_id, key, source.data.params[key])
        client.log_metric(made.info.run_id, "val/loss", 3.0, step=int(source.data.params["train_max_steps"]))
        client.set_terminated(made.info.run_id, "FINISHED")
        capsys.readouterr()
        assert main(["compare", "--experiment", "served", "--tracking_uri", uri, "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "[lrattn compare] logged as run" in out and "View run" not in out and "View experiment" not in out
    assert f"[lrattn compare] summary run: {uri}/#/experiments/" in out  # the server's own address, no `mlflow ui`
    assert f"[lrattn compare] runs table of 'served': {uri}/#/experiments/" in out and "mlflow ui" not in out
