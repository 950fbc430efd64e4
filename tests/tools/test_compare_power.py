"""`lrattn compare` says only what its numbers resolve (issue 40): seeds needed at 80 % power, pairwise tests with
Holm's correction, downstream scores pooled only like with like, figures whose labels cover nothing, and a summary
run kept apart from the training runs.

Stores are real sqlite MLflow stores holding runs made with known answers: three seeds at mean - s, mean, mean + s
have sample std s exactly, so a difference of one s needs 17 seeds a side (the textbook value for Cohen's d = 1).
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.tracking import seed_store
from mlflow.tracking import MlflowClient
from scipy import stats

from lrattn_lightning.cli import main
from lrattn_lightning.tools.compare import labels
from lrattn_lightning.tools.compare.figures import loss_vs_flops_figure
from lrattn_lightning.tools.compare.heatmaps import heatmap_groups, heatmaps_figure
from lrattn_lightning.tools.compare.power import MAX_SEEDS, holm, pooled_std, power, seeds_needed, spreads
from lrattn_lightning.tools.compare.table import RunRecord, summarise

S = 0.01  # the spread of every row: seeds at mean - S, mean, mean + S
CLEAR = {"baseline": 3.0, "method-a": 3.0 - S, "method-b": 3.0 - 10 * S}  # a: d = 1 (unresolved); b: d = 10
CLOSE = {"baseline": 3.0, "method-a": 3.0 - S, "method-b": 3.0 - 1.5 * S}  # nothing resolves with three seeds
ORDERING = re.compile(r"\b(best|better|worse|leads?|wins?|beats?|outperforms?)\b", re.IGNORECASE)


# ---- the numbers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("effect,n", [(0.5, 64), (0.8, 26), (1.0, 17), (2.0, 6)])
def test_seeds_needed_is_the_textbook_sample_size(effect, n):
    """Two-sided α 0.05, power 0.8, equal spreads: from 6 seeds up Welch's test needs what the pooled t-test does
    (Cohen's table, G*Power: 64, 26, 17 per group), above the normal bound."""
    assert seeds_needed(effect * 0.02, 0.02) == n
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert 2 * z**2 / effect**2 <= n <= 2 * z**2 / effect**2 + 3  # the t-test needs a little more than the z-test
    assert power(n, effect, 1.0) >= 0.8 > power(n - 1, effect, 1.0)


def welch_power_by_simulation(n: int, delta: float, std_a: float, std_b: float, reps: int, seed: int) -> float:
    """The share of `reps` simulated studies in which Welch's test (scipy's, on its own) gives p < 0.05."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.0, std_a, (reps, n)), rng.normal(delta, std_b, (reps, n))
    return float(np.mean(stats.ttest_ind(a, b, axis=1, equal_var=False).pvalue < 0.05))


@pytest.mark.parametrize("n,delta,std_a,std_b", [(2, 3.0, 1.0, 1.0), (3, 2.0, 1.0, 1.0), (5, 1.5, 1.0, 0.5),
                                                 (4, 2.0, 0.5, 1.5), (10, 1.0, 1.0, 1.0), (17, 1.0, 1.0, 1.0)])
def test_power_is_welchs_test_by_simulation(n, delta, std_a, std_b):
    """power() is the power of the test whose p the table prints (Welch's): against 40,000 simulated studies."""
    reps = 40_000
    simulated = welch_power_by_simulation(n, delta, std_a, std_b, reps, seed=n)
    assert power(n, delta, std_a, std_b) == pytest.approx(simulated, abs=4 * math.sqrt(0.25 / reps))


@pytest.mark.parametrize("delta,std_a,std_b", [(0.05, 0.01, 0.01), (0.03, 0.01, 0.01), (0.03, 0.005, 0.02),
                                               (0.02, 0.01, 0.01), (0.01, 0.01, 0.01)])
def test_seeds_needed_reach_the_power_in_a_simulated_welch_test(delta, std_a, std_b):
    """At the seeds it states, Welch's test resolves the difference in >= 80 % of simulated studies (less three
    Monte Carlo errors), and at one seed fewer in < 80 % (plus three): the number is Welch's, not the pooled
    t-test's, which at 2-3 seeds promises power Welch's test (one or two degrees of freedom) does not have."""
    n, reps = seeds_needed(delta, std_a, std_b), 20_000
    tolerance = 3 * math.sqrt(0.16 / reps)
    assert welch_power_by_simulation(n, delta, std_a, std_b, reps, seed=1) >= 0.8 - tolerance
    if n > 2:
        assert welch_power_by_simulation(n - 1, delta, std_a, std_b, reps, seed=2) < 0.8 + tolerance


def test_welch_needs_more_seeds_than_the_pooled_t_test_promised_at_two():
    """Δ = 6 s: the pooled t-test (2 degrees of freedom at two seeds) has power 0.84 and said 2 seeds; Welch's test,
    whose p is printed, has 1-2 degrees of freedom there and power 0.5: 3 seeds."""
    crit = stats.t.ppf(0.975, 2)
    assert stats.nct.sf(crit, 2, 6.0) + stats.nct.cdf(-crit, 2, 6.0) >= 0.8 > power(2, 6.0, 1.0)
    assert seeds_needed(0.06, 0.01) == 3


def test_two_seeds_that_failed_to_resolve_a_difference_never_read_as_enough():
    """Issue 52: the report said `≥ 2` seeds for a difference two seeds had just failed to resolve. Taking the
    observed Δ and spreads as true, Welch's test at the same two seeds has the power of a coin at most, so the
    seeds needed exceed the seeds run whenever Welch's p was >= 0.05."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(120):
        a, b = rng.normal(0.0, 0.02, 2), rng.normal(0.03, 0.02, 2)
        if stats.ttest_ind(a, b, equal_var=False).pvalue < 0.05:
            continue
        checked += 1
        assert seeds_needed(float(b.mean() - a.mean()), float(a.std(ddof=1)), float(b.std(ddof=1))) > 2, (a, b)
    assert checked > 80


def test_seeds_needed_edges_and_pooled_std():
    assert seeds_needed(0.0, 0.1) is None and seeds_needed(0.1, None) is None and seeds_needed(None, 0.1) is None
    assert seeds_needed(0.1, 0.0) == 2  # no spread: any two seeds a side resolve it
    assert seeds_needed(1e-6, 1.0) == MAX_SEEDS + 1  # far inside the noise: "more than"
    assert pooled_std([1.0, 2.0, 3.0], [2.0, 4.0]) == pytest.approx(math.sqrt(4 / 3))  # (2 + 2) / (5 - 2)
    assert pooled_std([1.0], [2.0]) is None and pooled_std([1.0], [2.0, 4.0]) == pytest.approx(math.sqrt(2))
    assert spreads([1.0], [2.0]) == (None, None) and spreads([1.0], [2.0, 4.0]) == pytest.approx((math.sqrt(2),) * 2)
    assert seeds_needed(0.1, 0.0, 0.0) == 2 and seeds_needed(0.1, 0.0, 0.05) > 2  # one spread known to be 0


def test_holm_against_a_hand_computed_example():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []


# ---- a real store with known answers -------------------------------------------------------------------
def _run(client, exp, name, abl, seed, loss, tags=None, metrics=None):
    run = client.create_run(exp, run_name=name, tags={"seed": str(seed), "control": "none" if abl == "baseline"
                                                      else "baseline", **(tags or {})})
    rid = run.info.run_id
    params = {"size": "tiny", "ablation": abl, "params": "1000", "train_max_steps": "4",
              "added_flops_pct": {"baseline": 0.0, "method-a": 0.5, "method-b": 1.0}.get(abl, 0.7)}
    for key, value in params.items():
        client.log_param(rid, key, value)
    for step in range(4):
        client.log_metric(rid, "train/loss", 4.0 - 0.1 * step, step=step)
    client.log_metric(rid, "val/loss", loss, step=4)
    for key, value in (metrics or {}).items():
        client.log_metric(rid, key, value, step=4)
    client.set_terminated(rid, "FINISHED")
    return rid


def _study(client, root, name, means, evals=False):
    exp = client.create_experiment(name, artifact_location=(root / "artifacts").as_uri())
    for abl, mean in means.items():
        for seed, offset in enumerate((-S, 0.0, S)):
            tags, metrics = {}, {}
            if evals and abl == "baseline":  # seeds 0, 1 scored 80 items, seed 2 every item
                limit = 80 if seed < 2 else None
                tags = {"lrattn.eval_config/hellaswag": json.dumps({"limit": limit, "num_fewshot": 0, "data": None})}
                metrics = {"eval/hellaswag/acc": 0.25 + 0.01 * seed, "eval/hellaswag/acc_stderr": 0.04,
                           "eval/hellaswag/sample_len": 80.0 if limit else 10042.0}
            if evals and abl == "method-a":  # evaluated the same way, tagged
                tags = {"lrattn.eval_config/hellaswag": json.dumps({"limit": 80, "num_fewshot": 0, "data": None})}
                metrics = {"eval/hellaswag/acc": 0.30, "eval/hellaswag/acc_stderr": 0.04}
            if evals and seed < 2:  # val/bpb on two of the three seeds of each row
                metrics["val/bpb"] = 1.5
            rid = _run(client, exp, f"{abl}-seed{seed}", abl, seed, mean + offset, tags, metrics)
            if evals and abl == "method-b":  # an older run: no tag, its configuration in the results JSON only
                client.log_metric(rid, "eval/hellaswag/acc", 0.4, step=4)
                results = {"results": {"hellaswag": {"acc,none": 0.4}}, "config": {"limit": 80, "num_fewshot": 5},
                           "configs": {"hellaswag": {"num_fewshot": 5}}}
                client.log_text(rid, json.dumps(results), "eval/results-step000004-20250101-000000-abcd1234.json")


@pytest.fixture(scope="module")
def store(tmp_path_factory, store_template):
    root = tmp_path_factory.mktemp("power")
    seed_store(root, store_template)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    _study(client, root, "clear", CLEAR, evals=True)
    _study(client, root, "close", CLOSE)
    reports = {}
    for name in ("clear", "close"):
        out = root / f"report-{name}"
        assert main(["compare", "--experiment", name, "--tracking_uri", uri, "--out", str(out)]) == 0
        reports[name] = out
    return {"root": root, "uri": uri, "client": client, "out": reports}


def _csv(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["ablation"]: row for row in csv.DictReader(f)}


def _section(text: str, head: str) -> str:
    return text[text.index(head):].split("\n## ", 1)[0]


def test_every_delta_has_its_seeds_needed(store):
    rows = _csv(store["out"]["clear"] / "table.csv")
    assert rows["method-a"]["seeds_needed_baseline"] == "17"  # Δ = -S, pooled std S: d = 1
    assert rows["method-a"]["seeds_needed_control"] == "17"
    # d = 10: two seeds a side give Welch's test (1-2 degrees of freedom) power 0.79, so 3 (the pooled t-test said 2)
    assert rows["method-b"]["seeds_needed_baseline"] == str(seeds_needed(10.0, 1.0)) == "3"
    assert rows["baseline"]["seeds_needed_baseline"] == ""  # no Δ of the reference to itself
    table = (store["out"]["clear"] / "table.md").read_text()
    head = table.splitlines()[0].split(" | ")
    assert head.count("seeds needed") == 2
    line = next(x for x in table.splitlines() if x.startswith("| **method-a**") or x.startswith("| method-a"))
    assert "| 0.288 | ≥ 17 |" in line  # p then seeds needed (scipy: ttest_ind of the two rows' seeds)
    p = stats.ttest_ind([2.98, 2.99, 3.0], [2.99, 3.0, 3.01], equal_var=False).pvalue
    assert f"{p:.3f}" == "0.288"


def test_pairwise_section_holm_corrects_and_names_what_is_resolved(store):
    text = (store["out"]["clear"] / "report.md").read_text()
    section = _section(text, "## Pairwise tests")
    assert "3 rows, 3 pairs: 2 resolved, 1 not." in section
    pairs = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:8]]
             for line in section.splitlines() if line.startswith("| method") or line.startswith("| baseline")}
    assert set(pairs) == {("method-b", "baseline"), ("method-b", "method-a"), ("method-a", "baseline")}
    raw = {k: stats.ttest_ind(*[[CLEAR[a] + o for o in (-S, 0, S)] for a in k], equal_var=False).pvalue for k in pairs}
    order = sorted(raw, key=raw.get)  # Holm by hand: the smallest p times 3, the next times 2, the last times 1
    adjusted = {order[0]: 3 * raw[order[0]]}
    adjusted[order[1]] = max(adjusted[order[0]], 2 * raw[order[1]])
    adjusted[order[2]] = max(adjusted[order[1]], raw[order[2]])
    for key, (delta, p, p_holm, resolved, need) in pairs.items():
        assert float(delta) == pytest.approx(CLEAR[key[0]] - CLEAR[key[1]], abs=5e-5) and float(delta) < 0
        assert float(p) == pytest.approx(raw[key], rel=0.05, abs=1e-3), key
        assert float(p_holm) == pytest.approx(adjusted[key], rel=0.05, abs=1e-3), key
        assert resolved == ("yes" if adjusted[key] < 0.05 else "no")
        sd = pooled_std(*[[CLEAR[a] + o for o in (-S, 0, S)] for a in key])
        assert need == f"≥ {seeds_needed(float(delta), sd, alpha=0.05 / 3)}"  # at the level Holm asks of 3 pairs
    assert pairs[("method-a", "baseline")][3:] == ["no", "≥ 23"]  # d = 1 at α = 0.05 / 3 (17 at 0.05)
    z = stats.norm.ppf(1 - 0.05 / 6) + stats.norm.ppf(0.8)
    assert 2 * z**2 <= 23 <= 2 * z**2 + 3  # the normal bound, 20.9; the t-test needs a little more
    assert "`method-b` has the lowest validation loss of the group, resolved against each of the other 2" in section
    assert section.index("| method-b | baseline") < section.index("| method-a | baseline")  # resolved first


def test_no_ordering_words_without_a_resolved_test(store):
    for name in ("clear", "close"):
        text = (store["out"][name] / "report.md").read_text()
        assert not ORDERING.search(text), (name, ORDERING.search(text))
    close = _section((store["out"]["close"] / "report.md").read_text(), "## Pairwise tests")
    assert "3 rows, 3 pairs: 0 resolved, 3 not." in close
    assert "No row is resolved as the lowest" in close and "has the lowest validation loss" not in close
    assert "leading group `method-b`, `method-a`, `baseline` has no established order" in close
    assert f"`baseline` ≥ {seeds_needed(1.5 * S, S, alpha=0.05 / 3)}" in close  # d = 1.5 from the lowest


def test_evaluations_of_different_configurations_are_separate_columns(store):
    table = (store["out"]["clear"] / "table.md").read_text()
    head = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert "hellaswag/acc [limit 80, 0-shot]" in head and "hellaswag/acc [all items, 0-shot]" in head
    assert "hellaswag/acc [limit 80, 5-shot]" in head  # the older run's, from its results JSON
    assert not any("stderr" in h or "sample_len" in h for h in head)
    body = table.split("\n\n", 1)[0].splitlines()[2:]  # the table's rows, not the pairwise table's
    cells = {line.split("|")[1].strip().strip("*"): [c.strip() for c in line.strip("|").split("|")] for line in body}
    col = head.index("hellaswag/acc [limit 80, 0-shot]")
    assert cells["baseline"][col] == "0.2550 ± 0.0071 (n 2)"  # seeds 0, 1 only: never with seed 2's full run
    assert cells["method-a"][col] == "0.3000 ± 0.0000"  # all three seeds: no n
    assert cells["baseline"][head.index("hellaswag/acc [all items, 0-shot]")] == "0.2700 (n 1)"
    assert cells["method-b"][head.index("hellaswag/acc [limit 80, 5-shot]")] == "0.4000 ± 0.0000"
    assert cells["baseline"][head.index("val bpb")] == "1.5000 ± 0.0000 (n 2)"  # a row's seed count is per metric
    assert "`hellaswag/acc` ran under 3, shown apart as" in table
    assert "only k of the row's seeds have that score" in table
    appendix = _section((store["out"]["clear"] / "report.md").read_text(), "## Appendix")
    # only the limit differs among these metrics' configurations
    assert "hellaswag/acc_stderr [limit 80]" in appendix and "hellaswag/sample_len [all items]" in appendix
    assert "| baseline | 0.0400 ± 0.0000 (n 2) |" in appendix
    rows = _csv(store["out"]["clear"] / "table.csv")
    assert rows["baseline"]["eval/hellaswag/acc [limit 80, 0-shot]_n"] == "2"  # the CSV keeps every column
    assert float(rows["baseline"]["eval/hellaswag/sample_len [all items]_mean"]) == 10042.0


def test_the_summary_run_lives_in_its_own_experiment_and_is_reused(store):
    client, uri = store["client"], store["uri"]
    training = client.get_experiment_by_name("clear").experiment_id
    assert all("lrattn.summary" not in r.data.tags for r in client.search_runs([training]))
    reports = client.get_experiment_by_name("clear-reports")
    (summary,) = client.search_runs([reports.experiment_id], "tags.`lrattn.report_of` = 'clear'")
    assert summary.data.tags["lrattn.summary"] == "true" and summary.info.run_name == "compare-clear"
    description = summary.data.tags["mlflow.note.content"]  # a few lines and where the report is, not the table
    assert description.startswith("**Comparison of `clear`**") and "compare/report.md" in description
    assert "## Pairwise tests" not in description and len(description.splitlines()) < 20
    assert summary.data.params["report_experiment"] == "clear" and summary.data.params["report_reference"] == "baseline"
    assert any(key.startswith("delta/") for key in summary.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(summary.info.run_id, "compare")}
    assert {"compare/report.md", "compare/table.csv"} <= artifacts
    assert main(["compare", "--experiment", "clear", "--tracking_uri", uri, "--out", str(store["root"] / "again")]) == 0
    assert len(client.search_runs([reports.experiment_id])) == 1  # reused, not another
    assert len(client.search_runs([training])) == 9  # the training runs only
    assert main(["compare", "--experiment", "clear-reports", "--tracking_uri", uri, "--out",
                 str(store["root"] / "none")]) == 2  # no training runs there: refused, not read as one


def test_an_unknown_experiment_is_one_line_naming_the_closest(store, capsys):
    """A typo'd --experiment names the store's closest experiments; with none close, what the store holds."""
    for name, hint in (("claer", "(closest: clear, close, c"),
                       ("zzz", "(it holds: Default, clear, clear-reports, close, close-reports)")):
        assert main(["compare", "--experiment", name, "--tracking_uri", store["uri"], "--out",
                     str(store["root"] / name)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"no MLflow experiment '{name}'" in err[0] and hint in err[0], err
        assert not (store["root"] / name).exists()  # refused before any work


# ---- figures ------------------------------------------------------------------------------------------
def _rows(n_methods: int, names: str = "method-{}") -> list:
    records = [RunRecord(run_id=f"b{s}", name=f"b{s}", size="tiny", ablation="baseline", control=None, seed=s,
                         start_time=s, val_loss=3.0 + 0.01 * s, params=100, added_flops_pct=0.0, metrics={})
               for s in range(2)]
    for i in range(n_methods):
        records += [RunRecord(run_id=f"m{i}{s}", name=f"m{i}{s}", size="tiny", ablation=names.format(i),
                              control="baseline", seed=s, start_time=s, val_loss=2.95 + 0.002 * i + 0.01 * s,
                              params=100, added_flops_pct=0.5 + 0.01 * (i % 4), metrics={}) for s in range(2)]
    return summarise(records)


def _text_boxes(fig, ax):
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    return {a.get_text(): labels.box_of(Text.get_window_extent(a, renderer)) for a in ax.texts}


def _min_font(fig) -> float:
    from matplotlib.text import Text

    return min(t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip())


@pytest.mark.parametrize("n_methods,numbered", [(2, False), (14, True)])
def test_figure_one_labels_cover_nothing_and_the_ring_is_in_the_legend(n_methods, numbered):
    rows = _rows(n_methods, "a-rather-long-method-name-{}")
    fig = loss_vs_flops_figure(rows, "study")
    ax = fig.axes[0]
    fig.canvas.draw()
    boxes = _text_boxes(fig, ax)
    assert len(boxes) == len(rows)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    if numbered:  # too crowded to name each point beside it: numbers, keyed in the legend with each marker
        assert sorted(boxes, key=int) == [str(i) for i in range(1, len(rows) + 1)]
        ordered = sorted(rows, key=lambda r: (r.added_flops_pct, r.mean))
        assert {f"{i}: {r.label}" for i, r in enumerate(ordered, 1)} <= set(legend)
    else:
        assert set(boxes) == {r.label for r in rows}
    assert "on the Pareto front (ring)" in legend
    ring = ax.get_legend().legend_handles[legend.index("on the Pareto front (ring)")]
    assert ring.get_marker() == "o" and ring.get_markerfacecolor() == "none"
    renderer = fig.canvas.get_renderer()
    points = [ax.transData.transform((r.added_flops_pct, r.mean)) for r in rows]
    obstacles = [(x - 6, y - 6, x + 6, y + 6) for x, y in points]
    obstacles.append(labels.box_of(ax.get_legend().get_window_extent(renderer)))
    obstacles += [labels.box_of(t.get_window_extent(renderer)) for t in ax.get_yticklabels() + ax.get_xticklabels()]
    items = list(boxes.items())
    for i, (text, box) in enumerate(items):
        assert not any(labels.overlap(box, other) for _, other in items[i + 1:]), text
        assert not any(labels.overlap(box, other) for other in obstacles), text
    assert _min_font(fig) >= 8


def _weights(sites: int, sources, **extra) -> dict:
    rng = np.random.default_rng(sites)
    return {"kind": "k", "sites_by_sources": [[float(v) for v in rng.random(sources(j))] for j in range(sites)], **extra}


def test_heatmap_panels_are_sized_to_their_rows_and_titles_cover_nothing():
    mudd = _weights(32, lambda j: j // 4 + 2, site_labels=[f"after layer {j // 4 + 1}: {'QKVR'[j % 4]}" for j in range(32)],
                    site_axis="dense aggregation after layer i, per stream (Q, K, V: the next attention's inputs; R: "
                              "what it adds to, after the last layer the output)", value="mean DA weight w_i[c, j]")
    small = _weights(4, lambda j: 5)
    fig = heatmaps_figure({"tiny/muddformer [A]": (mudd, 4, 3), "tiny/block-attnres": (small, 4, 3),
                           "tiny/a variant with a name longer than its panel is wide": (_weights(3, lambda j: 3), 4, 2)},
                          "study: routing weights at the last validation")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert len(panels) == 3
    figure = labels.box_of(fig.bbox)
    heights = []
    for ax in panels:
        frame = labels.box_of(ax.get_window_extent(renderer))
        title = labels.box_of(ax.title.get_window_extent(renderer))
        assert not labels.overlap(title, frame)
        for other in fig.axes:
            if other is not ax and other not in ax.child_axes:
                assert not labels.overlap(labels.box_of(other.get_tightbbox(renderer)), title)
        tight = labels.box_of(ax.get_tightbbox(renderer))
        assert figure[0] <= tight[0] and tight[2] <= figure[2] and figure[1] <= tight[1] and tight[3] <= figure[3]
        ticks = sorted((labels.box_of(t.get_window_extent(renderer)) for t in ax.get_yticklabels()), key=lambda b: b[1])
        assert all(a[3] <= b[1] for a, b in zip(ticks, ticks[1:], strict=False))  # 32 row labels, none on another
        heights.append((frame[3] - frame[1]) / len(ax.get_yticklabels()))
    assert all(0.22 * fig.dpi <= h <= 0.5 * fig.dpi for h in heights), heights  # a panel is as tall as its rows
    suptitle = labels.box_of(fig._suptitle.get_window_extent(renderer))
    assert not any(labels.overlap(suptitle, labels.box_of(ax.get_tightbbox(renderer))) for ax in panels)
    assert _min_font(fig) >= 7


def test_a_ladder_draws_one_heatmap_figure_per_size_the_largest_first():
    from types import SimpleNamespace

    rows = [SimpleNamespace(size=size, params=params) for size, params in
            [("ladder-s", 300), ("ladder-l", 3000), ("ladder-m", 1000), ("ladder-l", 3001), ("ladder-s", 301)]]
    groups = heatmap_groups(rows)
    assert [(size, stem, len(members)) for size, stem, members in groups] == [
        ("ladder-l", "routing_heatmaps", 2), ("ladder-m", "routing_heatmaps-ladder-m", 1),
        ("ladder-s", "routing_heatmaps-ladder-s", 2)]
    assert heatmap_groups(rows[:1]) == [("ladder-s", "routing_heatmaps", rows[:1])]  # one size: the one file


def test_a_few_huge_coefficients_clip_the_diverging_scale_and_say_so():
    from lrattn_lightning.train.diagnostics import heatmap_figure

    rng = np.random.default_rng(0)
    values = rng.uniform(-1.5, 1.5, size=(10, 6))
    values[0, 0] = 230.0  # MUDDFormer's first dense aggregation, as the scaling study logged it
    fig = heatmap_figure({"sites_by_sources": values.tolist(), "value": "mean DA weight"}, "t")
    image = fig.axes[0].images[0]
    typical = float(np.quantile(np.abs(values), 0.9))
    assert image.get_clim() == pytest.approx((-typical, typical))  # the other cells keep their colours
    bar = image.colorbar
    assert bar.extend == "both" and f"clipped at ±{typical:.3g}" in bar.ax.get_ylabel()
    assert "230.00" in [t.get_text() for t in fig.axes[0].texts]  # the number printed is the exact one
    values[0, 0] = 1.4  # no outlier: the full range, nothing clipped
    fig = heatmap_figure({"sites_by_sources": values.tolist()}, "t")
    image = fig.axes[0].images[0]
    assert image.get_clim() == pytest.approx((-np.abs(values).max(), np.abs(values).max()))
    assert image.colorbar.extend == "neither" and "clipped" not in image.colorbar.ax.get_ylabel()
    # in a study's figure the redrawn colour bar keeps the clipping
    values[0, 0] = 230.0
    fig = heatmaps_figure({"m": ({"sites_by_sources": values.tolist()}, 4, 3)}, "study")
    panel = next(ax for ax in fig.axes if ax.images and ax.get_title())
    assert panel.images[0].colorbar.extend == "both"
