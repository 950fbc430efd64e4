"""`lrattn compare --experiment NAME`: the report of a sweep, read back from MLflow (any tracking URI).

Writes into --out (default reports/EXPERIMENT) and logs as artifacts of a summary run in an experiment of its
own, EXPERIMENT-reports (tags lrattn.summary=true, lrattn.report_of=EXPERIMENT; its metrics are the Δ and the
compute multipliers: summary_run.py), so that nothing reading the training runs (this command, a sweep, a resume)
meets it; it prints the summary run's address and the study's runs table with its columns:

    table.md, table.csv      one row per (size, ablation): seeds, final val loss mean ± std, the
                             difference to the ablation's control and to the baseline with Welch's
                             t-test across seeds and the seeds per arm that would resolve it at 80 % power,
                             added FLOPs %, parameters, tokens/s, val bits per byte, every downstream score
                             `eval/<task>/<metric>` the runs carry (one column per task configuration:
                             evals.py), and the pairwise tests of every pair of rows of a size and recipe,
                             Holm-corrected (power.py)
    loss_vs_flops.png/svg    the paper's Figure 1: mean val loss against added FLOPs %, one point per
                             ablation (bars: std over seeds), the Pareto front marked
    routing_heatmaps.png/svg the routing weights (sites x sources) every kind logs at its last validation
                             (routing/weights.json: AttnRes and delta's softmax reads, DenseFormer's α, the
                             hyper-connections' read / width / depth weights, the gates, an own router's);
                             over several sizes one figure per size: the largest here, the others in
                             routing_heatmaps-SIZE.png/svg; a few huge signed coefficients clip the colour scale
                             (said on its bar; the printed numbers are exact)
    gate_alphas.png/svg      the gated residual's mean alpha per sublayer, one line per ablation (mean over
                             seeds, band: seed min-max), from each run's routing/gates.json
    training_curves.png/svg  train loss and val loss against step, mean over seeds, overlaid; one row of
                             panels per size (ladder order), each on its own steps
    scaling.*                runs over two or more sizes (a ladder): each method's compute multiplier against the
                             reference from a fitted L(C) = E + A_m C^-alpha, with its bootstrap interval, residuals
                             and figure, the per-size multipliers beside it (scaling_report.py;
                             --per-method-exponents: one alpha per method)
    report.md                all of the above on one page, with the runs it was made from and an appendix
                             of lm-eval's bookkeeping numbers (bootstrap stderr, sample counts)

One row is one recipe: runs whose recipe fingerprints differ (train/fingerprint.py: schedule length, tokens
per step, data, optimiser, precision, an upcycling source, ...) are never pooled or paired in a Δ or p; each
recipe gets a letter, and the lines under the table describe recipe A and how the others differ, why a Δ is
—, which of several runs of one (size, ablation, seed, recipe) counts (the latest FINISHED) and why. An
upcycled run is its own row, labelled with its source. A run whose last validation is not at its last step
(its val/loss is an earlier value: a tracking gap) is left out, and a line under the table names it.
Every run left out (failed, diverged, killed, still RUNNING or killed with `kill -9`, stale, replaced) is named
with its reason in one line on the terminal and in the report's appendix, and a row that lost seeds says so
(left_out.py).
A run a sweep tagged with a `variant` (its own training flags) is its own row, `ablation+variant`,
whose control is the plain ablation. The rows and their statistics: table.py (Welch's test:
power.py); the figures: figures.py; here: the report, the summary run, the CLI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import write_file
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.tools.compare import words
from lrattn_lightning.tools.compare.evals import appendix_table
from lrattn_lightning.tools.compare.figures import (
    gate_curves,
    plot_curves,
    plot_gate_curves,
    plot_loss_vs_flops,
)
from lrattn_lightning.tools.compare.heatmaps import heatmap_groups, plot_heatmaps, routing_matrices
from lrattn_lightning.tools.compare.left_out import appendix, left_out, mark_lost_seeds, terminal_line
from lrattn_lightning.tools.compare.notes import notes
from lrattn_lightning.tools.compare.power import pairwise_section
from lrattn_lightning.tools.compare.runs import RunReader
from lrattn_lightning.tools.compare.scaling_report import write_scaling
from lrattn_lightning.tools.compare.summary_run import REPORTS_SUFFIX, addresses, log_summary_run
from lrattn_lightning.tools.compare.table import (
    Row,
    RunRecord,
    csv_table,
    markdown_table,
    read_runs,
    summarise,
)


# ---- the report ------------------------------------------------------------------------------------
def write_report(client: Any, experiment: str, out: Path, sweep: str | None = None, reference: str = "baseline",
                 command: str | None = None, per_method_exponents: bool = False) -> tuple[list[Row], list[Path]]:
    client = RunReader(client)  # runs searched once, read without a request per run (runs.py)
    records = read_runs(client, experiment, sweep)
    left = left_out(client, experiment, sweep, records)
    line = terminal_line(left)
    if line:
        print(line, file=sys.stderr, flush=True)
    stale = [r for r in records if r.stale]
    records = [r for r in records if not r.stale]
    if not records:
        raise InputError(f"experiment '{experiment}' has no FINISHED training runs with val/loss"
                         + (f" tagged sweep={sweep}" if sweep else "")
                         + (f" at their last step ({len(stale)} whose last validation is earlier: "
                            f"{', '.join(r.name for r in stale)})" if stale else "")
                         + (f"; {line.removeprefix('[lrattn compare] ')}" if line and not stale else ""))
    rows = summarise(records, reference)
    mark_lost_seeds(rows, left)
    out.mkdir(parents=True, exist_ok=True)
    title = words.title(experiment, rows)  # sizes in ladder order, nouns counted (words.py)
    table_md = markdown_table(rows, reference) + notes(rows, reference, stale) + pairwise_section(rows)
    files = [out / "table.md", out / "table.csv"]
    write_file(files[0], table_md, "report file")
    write_file(files[1], csv_table(rows, reference), "report file")
    files += plot_loss_vs_flops(rows, out, title)
    files += plot_curves(rows, out, title)
    heatmaps = []  # (size, file name) per figure: one figure per size, the largest size's first
    for size, stem, size_rows in heatmap_groups(rows):
        matrices = routing_matrices(client, size_rows)
        if matrices:
            files += plot_heatmaps(matrices, out, f"{experiment}: size {size} — routing weights at the last validation",
                                   stem)
            heatmaps.append((size, f"{stem}.png"))
    gates = gate_curves(client, rows)
    if gates:
        files += plot_gate_curves(gates, out, title)
    scaling_files, scaling_md = write_scaling(client, rows, out, title, reference, per_method_exponents)
    files += scaling_files
    report = out / "report.md"
    write_file(report, _report_text(experiment, rows, table_md, records, heatmaps, command, reference,
                                   bool(gates), scaling_md) + appendix(left), "report file")
    files.append(report)
    return rows, files


def _report_text(experiment: str, rows: list[Row], table_md: str, records: list[RunRecord],
                 heatmaps: list[tuple[str, str]], command: str | None, reference: str, gates: bool = False,
                 scaling: str = "") -> str:
    parts = [f"# {experiment}: comparison\n",
             f"Generated by `{command}` from {len(records)} finished runs." if command else "",
             f"\nFinal validation loss per run (nats/token), mean ± sample std over seeds. Δ is the difference of "
             f"means to the ablation's registry control (for an `ablation+variant` row, a run with its own training "
             f"flags: the plain ablation) and to `{reference}`, each within the row's recipe (a Δ never pairs runs "
             "of different recipe fingerprints: the lines under the table say which recipes there are and why a Δ "
             "is —); p is Welch's two-sided t-test across "
             "seeds (— below two seeds a side). Added FLOPs % is the analytic forward cost of routing relative to "
             "the non-embedding core (docs/method.md §4); tokens/s is the median training throughput of each run, averaged "
             "over seeds. Seeds needed: per arm, for 80 % power in Welch's test (the p beside it) at two-sided α = 0.05 if "
             "the observed Δ and spreads were the true ones. **Bold**: on the Pareto front of (added FLOPs %, mean val loss), a front of means: "
             "the pairwise tests say which of its differences are resolved.\n",
             table_md,
             "\n![validation loss against added FLOPs](loss_vs_flops.png)\n",
             "\n![training curves](training_curves.png)\n"]
    if heatmaps:
        size, name = heatmaps[0]
        parts.append(f"\n![routing weights at size {size}]({name})\n")
        if len(heatmaps) > 1:
            parts.append("Routing weights at the other sizes: " + ", ".join(f"[{s}]({n})" for s, n in heatmaps[1:])
                         + ".\n")
    if gates:
        parts.append("\n![gated residual: alpha per sublayer](gate_alphas.png)\n")
    if scaling:
        parts.append("\n" + scaling)
    parts.append("\n## Runs\n\n| run | row | recipe | seed | val loss | run id |\n|---|---|---|---:|---:|---|")
    parts += [f"| {r.name} | {row.label} | {row.group} (`{r.recipe}`) | {r.seed} | {r.val_loss:.4f} | `{r.run_id}` |"
              for row in rows for r in row.runs]
    appendix = appendix_table(rows, lambda row: row.label)
    if appendix:
        parts.append("\n## Appendix: lm-eval's bookkeeping\n\nNot compared across seeds, so not in the table: lm-eval's "
                     "per-run bootstrap standard errors (the table's ± is the spread over seeds) and its sample "
                     "counts; mean ± std over the row's runs that have them.\n\n" + appendix)
    return "\n".join(p for p in parts if p is not None) + "\n"


def main(argv: list[str] | None = None) -> int:
    from lrattn_lightning.train.artifacts import LinkSafeClient
    from lrattn_lightning.train.store import resolve_tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    parser = Parser(prog="lrattn compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", required=True, help="the MLflow experiment of the sweep")
    parser.add_argument("--tracking_uri", "--tracking-uri", default=None,
                        help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--sweep", default=None, help="only runs tagged with this sweep name")
    parser.add_argument("--reference", default="baseline", help="the ablation every row is also compared with")
    parser.add_argument("--out", default=None, help="output folder (default: reports/EXPERIMENT)")
    parser.add_argument("--no-summary-run", action="store_true", help="do not log the report to MLflow")
    parser.add_argument("--per-method-exponents", action="store_true",
                        help="over a size ladder, fit one exponent alpha per method (default: one shared by all)")
    args = parser.parse_args(argv)
    uri = resolve_tracking_uri(args.tracking_uri, fallback_local=False)
    client = LinkSafeClient(uri)
    out = Path(args.out or f"reports/{args.experiment}")
    command = "lrattn compare " + " ".join(argv if argv is not None else sys.argv[2:])
    rows, files = write_report(client, args.experiment, out, args.sweep, args.reference, command,
                               args.per_method_exponents)
    print((out / "table.md").read_text())
    print(f"[lrattn compare] {words.summary(rows)}; wrote {', '.join(p.name for p in files)} to {out}")
    reports_id = run_id = None
    if not args.no_summary_run:
        reports_id, run_id = log_summary_run(client, args.experiment, files, rows, args.reference, args.sweep)
        print(f"[lrattn compare] logged as run {run_id} (metrics: the Δ and multipliers; artifacts compare/*) in "
              f"experiment '{args.experiment}{REPORTS_SUFFIX}' (the training runs' experiment holds only training runs)")
    for line in addresses(client, args.experiment, reports_id, run_id):
        print(f"[lrattn compare] {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
