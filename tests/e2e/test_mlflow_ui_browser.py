"""What a researcher sees in MLflow's own UI (3.17), in a real browser: headless Chromium over a real `mlflow server`.

Two real tiny fits and a real `lrattn compare` write a sqlite store; the links `fit` and `compare` print are opened
as printed (only the port changed) and the page's DOM is read after its scripts ran: the study's runs table shows
val loss, bits per byte, ablation, size and seed for every run with no click, in the "Model training" view; the
summary run shows the comparison's Δ as metrics, what it compared as params and a short description. Screenshots
are written beside the DOM (`LRATTN_UI_SHOTS=FOLDER` keeps them). Skipped where no Chromium is installed
(Debian: `apt-get install chromium`; `./tasks` does not install it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.runs import fit_args, run_cli
from helpers.tracking import SERVER_ENV, free_port
from mlflow.tracking import MlflowClient

from lrattn_lightning.tools.compare.summary_run import compared, description, headline

BROWSER = next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
               None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium installed (apt-get install chromium)")


def link(lines: list[str], label: str, port: int) -> str:
    (found,) = [line.split(label, 1)[1].strip() for line in lines if label in line]
    return found.replace("http://127.0.0.1:5000/", f"http://127.0.0.1:{port}/")


def browse(url: str, shot: Path, height: int = 1000) -> str:
    """The page's DOM once its scripts ran (a fresh profile: nothing remembered), and its screenshot."""
    common = [BROWSER, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", f"--window-size=1600,{height}",
              "--virtual-time-budget=20000", f"--user-data-dir={shot.parent / ('profile-' + shot.stem)}"]
    subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, timeout=180, check=True)
    return subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180, check=True).stdout


def visible_text(dom: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", dom, flags=re.S)).split())


@pytest.fixture(scope="module")
def study(data, tmp_path_factory):
    """Two fits (baseline, attnres-full) and `lrattn compare` in one folder; `mlflow server` over its store."""
    folder = tmp_path_factory.mktemp("ui")
    fits = [run_cli(fit_args(data, steps=4, every=4, ablation=name), folder) for name in ("baseline", "attnres-full")]
    for proc in fits:
        assert proc.returncode == 0, proc.stderr[-3000:]
    compare = run_cli(["compare", "--experiment", "lrattn", "--out", "report"], folder)
    assert compare.returncode == 0, compare.stderr[-3000:]
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"],
        cwd=folder, env=SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "mlflow server did not come up"
                time.sleep(0.5)
        shots = Path(os.environ.get("LRATTN_UI_SHOTS") or folder / "shots")
        shots.mkdir(parents=True, exist_ok=True)
        yield {"folder": folder, "port": port, "shots": shots, "client": MlflowClient(f"sqlite:///{folder / 'mlflow.db'}"),
               "fit": fits[-1].stdout.splitlines(), "compare": compare.stdout.splitlines()}
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


@needs_browser
def test_the_printed_runs_table_shows_every_runs_figures_without_a_click(study):
    """`fit` and `compare` print one runs-table link; opened in a fresh browser it is the training view's table
    with val/loss, val/bpb, ablation, size and the seed as columns and each run's name and values in its rows."""
    url = link(study["fit"], "runs table:", study["port"])
    assert url == link(study["compare"], "runs table of 'lrattn':", study["port"])
    dom = browse(url, study["shots"] / "runs-table.png")
    text = visible_text(dom)
    assert "You're viewing a shared view" in text and "Model training" in text, text[:2000]
    assert "matching runs" in text and "Traces 0" not in text  # the runs page, not GenAI's Overview / Traces
    # ag-grid's header cells, in the order shown (aria-colindex; the pinned run name and Created stand left of all)
    cells = re.findall(r'<div class="ag-header-cell [^"]*"[^>]*aria-colindex="(\d+)" col-id="([^"]+)"', dom)
    shown = [col for _, col in sorted(cells, key=lambda cell: int(cell[0]))]
    assert shown[1:7] == ["attributes.`Run Name`", "metrics.`val/loss`", "metrics.`val/bpb`", "params.`ablation`",
                          "params.`size`", "params.`train_seed`"], shown
    for column in ("val/loss", "val/bpb", "ablation", "size", "train_seed", "Run Name"):
        assert column in text, column
    runs = study["client"].search_runs([study["client"].get_experiment_by_name("lrattn").experiment_id])
    for run in runs:
        assert run.info.run_name in text
        assert run.data.params["ablation"] in text
        assert f"{run.data.metrics['val/loss']:.4f}"[:5] in text  # the value, however the cell rounds it


@needs_browser
def test_the_summary_run_shows_the_comparisons_numbers_as_metrics(study):
    """`compare` prints the summary run's address; its page holds the Δ as a metric, what was compared as params
    and a short description, in an experiment tagged with the training kind."""
    client = study["client"]
    reports = client.get_experiment_by_name("lrattn-reports")
    assert reports.tags["mlflow.experimentKind"] == "custom_model_development"
    url = link(study["compare"], "summary run:", study["port"])
    (summary,) = client.search_runs([reports.experiment_id])
    assert summary.info.run_id in url and "workflowType=machine_learning" in url
    delta = summary.data.metrics["delta/tiny/attnres-full"]
    assert summary.data.params["report_experiment"] == "lrattn" and summary.data.params["report_runs"] == "2"
    text = visible_text(browse(url, study["shots"] / "summary-run.png", height=1500))
    assert "Comparison of lrattn" in text and "compare/report.md" in text, text[:3000]
    assert "delta/tiny/attnres-full" in text and f"{delta:.4f}"[:6] in text.replace(" ", ""), text[:4000]
    for param in ("report_experiment", "report_sizes", "report_seeds"):
        assert param in text, text[:4000]


def test_the_summary_runs_metrics_hold_each_methods_multiplier_and_interval(tmp_path):
    """Over a size ladder the multipliers and their intervals (scaling.csv, as scaling_report.py writes it) become
    metrics beside each row's Δ; a variant's `+` (no metric name takes it) becomes `_`, another recipe is named."""
    scaling = tmp_path / "scaling.csv"
    scaling.write_text("method,reference,shared_exponent,E,A,alpha,multiplier,median,low,high,level,resamples,at_compute,"
                       "refusal\ns-lr,baseline,True,1,2,0.3,1.25,1.24,1.1,1.4,0.95,200,,\n"
                       "baseline,baseline,True,1,2,0.3,1.0,1.0,1.0,1.0,0.95,200,,\nodd,baseline,True,,,,,,,,0.95,200,,no fit\n")
    rows = [SimpleNamespace(size="small", label="s-lr", ablation="s-lr", group="A", delta_baseline=-0.02),
            SimpleNamespace(size="small", label="s-lr+lr2", ablation="s-lr+lr2", group="B", delta_baseline=0.01),
            SimpleNamespace(size="small", label="baseline", ablation="baseline", group="A", delta_baseline=None)]
    numbers = headline(rows, [tmp_path / "table.md", scaling])
    assert numbers == {"delta/small/s-lr": -0.02, "delta/small/s-lr_lr2 recipe B": 0.01, "multiplier/s-lr": 1.25,
                       "multiplier_lo/s-lr": 1.1, "multiplier_hi/s-lr": 1.4}  # not the reference's own: 1 by definition
    text = description(compared("study", [SimpleNamespace(size="small", label=name, ablation=name, runs=[1, 2])
                                     for name in ("baseline", "s-lr")], "baseline"), numbers)
    assert "- compute multiplier s-lr: 1.25x [1.10, 1.40]" in text and "- Δ small/s-lr: -0.0200" in text
