"""`lrattn compare` names every run it leaves out (issue 52, item 4): after a sweep whose fits failed, diverged,
were killed (marked KILLED, or `kill -9` and left RUNNING), the terminal says in one line which runs are not counted
and why, the report's appendix lists them, and a row that lost seeds says so in its seeds cell; a method all of
whose runs were left out is named although its row is gone. A real sqlite MLflow store."""

from __future__ import annotations

import pytest
from helpers.tracking import seed_store, sqlite_experiment

from lrattn_lightning.cli import main
from lrattn_lightning.tools.compare.left_out import MAX_NAMED, LeftOut, terminal_line


def _run(client, exp, name, abl, seed, loss=None, status="FINISHED", tags=None):
    run = client.create_run(exp, run_name=name, tags={"seed": str(seed), "control": "none" if abl == "baseline"
                                                      else "baseline", **(tags or {})})
    rid = run.info.run_id
    for key, value in {"size": "tiny", "ablation": abl, "params": "1000", "train_max_steps": "4",
                       "added_flops_pct": 0.0 if abl == "baseline" else 0.5}.items():
        client.log_param(rid, key, value)
    for step in range(4):
        client.log_metric(rid, "train/loss", 4.0 - 0.1 * step, step=step)
    if loss is not None:
        client.log_metric(rid, "val/loss", loss, step=4)
    if status != "RUNNING":  # a fit killed by SIGKILL never ends its run: it stays RUNNING
        client.set_terminated(rid, status)
    return rid


@pytest.fixture(scope="module")
def report(tmp_path_factory, store_template):
    root = tmp_path_factory.mktemp("left-out")
    seed_store(root, store_template)
    uri, client, exp = sqlite_experiment(root, "sweep")
    for seed in range(3):
        _run(client, exp, f"baseline-s{seed}", "baseline", seed, 3.0 + 0.01 * seed)
    _run(client, exp, "a-s0", "method-a", 0, 2.9)
    _run(client, exp, "a-s1", "method-a", 1, 2.91)
    _run(client, exp, "a-s2", "method-a", 2, status="KILLED", tags={"lrattn.killed_reason": "SIGTERM from the sweep"})
    _run(client, exp, "b-s0", "method-b", 0, status="FAILED", tags={"lrattn.diverged": "non-finite loss at step 3"})
    _run(client, exp, "b-s1", "method-b", 1, status="RUNNING")
    _run(client, exp, "b-s2", "method-b", 2, status="FAILED")
    out = root / "report"
    return {"root": root, "uri": uri, "out": out,
            "run": lambda capsys: (main(["compare", "--experiment", "sweep", "--tracking_uri", uri, "--out", str(out),
                                         "--no-summary-run"]), capsys.readouterr())}


def test_every_left_out_run_is_named_with_its_reason_in_one_terminal_line(report, capsys):
    code, captured = report["run"](capsys)
    assert code == 0
    lines = [line for line in captured.err.splitlines() if "left out" in line]
    assert len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith("[lrattn compare] left out 4 runs: ")
    for name, why in (("a-s2", "KILLED"), ("b-s0", "FAILED, diverged"), ("b-s1", "RUNNING"), ("b-s2", "FAILED")):
        assert f"{name} ({why}" in line, line
    assert "baseline" not in line and "a-s0" not in line


def test_the_report_appendix_lists_them_and_a_row_that_lost_seeds_says_so(report, capsys):
    report["run"](capsys)
    text = (report["out"] / "report.md").read_text()
    appendix = text[text.index("## Appendix: runs left out"):]
    for name, why in (("a-s2", "KILLED: SIGTERM from the sweep"), ("b-s0", "FAILED, diverged: non-finite loss at step 3"),
                      ("b-s1", "RUNNING: still training, or killed by a signal"), ("b-s2", "| FAILED |")):
        row = next(line for line in appendix.splitlines() if line.startswith(f"| {name} |"))
        assert why in row, row
    table = (report["out"] / "table.md").read_text().split("## Pairwise")[0]
    a_row = next(line for line in table.splitlines() if line.startswith(("| method-a |", "| **method-a** |")))
    assert "2 of 3 (0,1; lost 2: KILLED)" in a_row, a_row
    base = next(line for line in table.splitlines() if line.startswith(("| baseline |", "| **baseline** |")))
    assert "| 3 (0,1,2) |" in base and " of " not in base.split("|")[2]
    assert "method-b" not in table  # every run of it left out: no row, but named above and in the appendix


def test_the_terminal_line_stays_one_line_past_ten_runs():
    left = [LeftOut(f"run-{i}", f"id{i}", "tiny", "m", i, None, "FAILED") for i in range(MAX_NAMED + 5)]
    line = terminal_line(left)
    assert "\n" not in line and line.count("(FAILED)") == MAX_NAMED
    assert line.startswith(f"[lrattn compare] left out {MAX_NAMED + 5} runs:") and "and 5 more" in line
    assert terminal_line([]) is None


@pytest.mark.usefixtures("mlflow_store")
def test_a_failed_attempt_that_a_later_run_retried_is_named_as_replaced_and_loses_no_seed(tmp_path, capsys):
    """A sweep re-run after a failure: the FAILED attempt is named as replaced by the finished run of its size,
    ablation and seed (not a bare "FAILED"), and the row keeps every seed (nothing was lost)."""
    uri, client, exp = sqlite_experiment(tmp_path, "retried")
    for seed in range(2):
        _run(client, exp, f"baseline-s{seed}", "baseline", seed, 3.0 + 0.01 * seed)
    _run(client, exp, "a-s0", "method-a", 0, 2.9)
    _run(client, exp, "a-s1-try1", "method-a", 1, status="FAILED", tags={"lrattn.diverged": "non-finite loss at step 3"})
    _run(client, exp, "a-s1", "method-a", 1, 2.91)  # started after the failed attempt
    _run(client, exp, "b-s0", "method-b", 0, status="FAILED")  # no retry: still FAILED
    out = tmp_path / "report"
    assert main(["compare", "--experiment", "retried", "--tracking_uri", uri, "--out", str(out), "--no-summary-run"]) == 0
    line = next(line for line in capsys.readouterr().err.splitlines() if "left out" in line)
    assert line.startswith("[lrattn compare] left out 2 runs: "), line
    assert "a-s1-try1 (replaced by `a-s1`, a later finished run of its size, ablation, seed and recipe; this attempt " \
           "FAILED, diverged)" in line, line
    assert "b-s0 (FAILED)" in line, line
    appendix = (out / "report.md").read_text().split("## Appendix: runs left out")[1]
    row = next(r for r in appendix.splitlines() if r.startswith("| a-s1-try1 |"))
    assert "this attempt FAILED, diverged: non-finite loss at step 3" in row, row
    table = (out / "table.md").read_text().split("## Pairwise")[0]
    a_row = next(r for r in table.splitlines() if r.startswith(("| method-a |", "| **method-a** |")))
    assert "| 2 (0,1) |" in a_row and "lost" not in a_row, a_row
