"""The `## Compute multipliers` section of `lrattn compare` when its runs span two or more sizes (a ladder,
experiments/sweeps/scaling-*.yaml): the runs as (method, size, seed, training compute, val loss) points, the fit
and the multipliers of scaling.py, and their files

    scaling.md           the section: the multiplier table, the fit's parameters and quality, the cell residuals
    scaling.csv          one row per method: A_m, alpha, the multiplier, its bootstrap median and Welch interval
    scaling_points.csv   one row per run: its compute, loss, the law's value there and the residual (law - loss)
    scaling.png/svg      two panels side by side (scaling_figure):
                         left   validation loss against training compute (log x), one colour per method, every
                                run a small dot, the mean over seeds of each size a ring, the fitted law a line;
                                each legend entry carries the method's multiplier k and its interval (when the
                                multipliers are refused, the axes' title says why)
                         right  the per-size multipliers read off the reference's own ladder (scaling.py): k
                                at each size, sizes in ladder order, its interval as a bar, a hollow marker where
                                the reading is extrapolated beyond the reference's ladder; k = 1 (the reference) a
                                dotted line

A method is a row's label (table.Row.label: the ablation, `+variant`, ...). A run's training compute is
3 x (the core's forward FLOPs per token, from its size params, + the routing's, its added_flops_pct of them) x its
tokens (its last step x tokens per step): training_compute. Where a size holds a method under several recipes,
only recipe A (the size's most common) counts, and a line says so.
"""

from __future__ import annotations

import csv
import io
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.core.files import write_file
from lrattn_lightning.model.accounting import core_flops
from lrattn_lightning.model.config import SizeConfig
from lrattn_lightning.tools.compare.figures import save_figure
from lrattn_lightning.tools.compare.scaling import (
    LEVEL,
    POOR_FIT,
    RESAMPLES,
    LocalMultiplier,
    Point,
    Scaling,
    analyse,
    local_multipliers,
)
from lrattn_lightning.tools.compare.table import Row, RunRecord
from lrattn_lightning.tools.compare.words import ladder, size_list
from lrattn_lightning.train.schema import Metric, Param

_SIZE_FIELDS = ("n_layers", "d_model", "n_heads", "d_mlp", "vocab_size", "seq_len")


def training_compute(params: dict[str, str], record: RunRecord) -> float | None:
    """3 x (core + routing) forward FLOPs per token x tokens trained; None where the run does not say."""
    try:
        size = SizeConfig(name=params.get(Param.SIZE, record.size), doc="", **{f: int(params[f]) for f in _SIZE_FIELDS})
        per_step = record.parts.get("tokens_per_step")
        tokens = (float(per_step) * record.final_step if per_step not in (None, "None") and record.final_step
                  else record.metrics.get(Metric.TOKENS_SEEN))
    except (KeyError, ValueError, TypeError):
        return None
    pct = record.added_flops_pct
    if not tokens or pct != pct:  # no token count, or a routing of unknown cost (NaN)
        return None
    return 3.0 * core_flops(size) * (1 + pct / 100) * float(tokens)


def ladder_points(client: Any, rows: list[Row]) -> tuple[list[Point], list[str]]:
    """The runs of `rows` as points, and one line per thing left out."""
    by_cell: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in rows:
        by_cell[(row.label or row.ablation, row.size)].append(row)
    points, notes, unknown = [], [], []
    rank = {size: i for i, size in enumerate(size_list(rows))}  # ladder order (words.py)
    for (method, size), mine in sorted(by_cell.items(), key=lambda item: (item[0][0], rank[item[0][1]])):
        if len(mine) > 1:
            others = sorted(r.group for r in mine if r.group != "A")
            notes.append(f"`{method}` at {size}: only recipe A counts (recipe {', '.join(others)} left out).")
            mine = [r for r in mine if r.group == "A"]
        for row in mine:
            for run in row.runs:
                compute = training_compute(client.get_run(run.run_id).data.params, run)
                if compute is None:
                    unknown.append(run.name)
                    continue
                points.append(Point(method, size, run.seed, compute, run.val_loss))
    if unknown:
        notes.append(f"Left out, training compute unknown (no size params, token count or routing FLOPs): "
                     f"{', '.join(unknown)}.")
    return points, notes


def write_scaling(client: Any, rows: list[Row], out: Path, title: str, reference: str = "baseline",
                  per_method_exponents: bool = False, resamples: int = RESAMPLES) -> tuple[list[Path], str]:
    """The section's files in `out` and its markdown; nothing ([], '') when the rows hold fewer than two sizes."""
    if len({row.size for row in rows}) < 2:
        return [], ""
    points, notes = ladder_points(client, rows)
    result = analyse(points, reference, shared=not per_method_exponents, resamples=resamples)
    result.notes[:0] = notes
    local, local_notes = local_multipliers(points, reference)
    text = section(result) + "\n" + local_section(local, local_notes, reference)
    files = [out / "scaling.md", out / "scaling.csv", out / "scaling_points.csv", out / "scaling_local.csv"]
    for path, content in zip(files, (text, method_csv(result), points_csv(result), local_csv(local)), strict=True):
        write_file(path, content, "report file")
    files += plot_scaling(result, out, title + " — validation loss against training compute", local)
    return files, text + "\n![loss against training compute](scaling.png)\n"


# ---- text --------------------------------------------------------------------------------------------
def _g(value: float | None, digits: int = 3) -> str:
    return "—" if value is None or value != value else f"{value:.{digits}g}"


def section(result: Scaling) -> str:
    ref, shared = result.reference, result.shared
    law = ("L(C) = E + A_m·C^(−α) with E and α shared by every method" if shared else
           "L(C) = E + A_m·C^(−α_m) with E shared and one exponent per method")
    what = (f"k = (A_{ref}/A_m)^(1/α), the same at every compute" if shared else
            f"read at the ladder's largest compute C* = {result.at:.3g} FLOPs (with per-method exponents k depends on "
            "C)")
    lines = ["## Compute multipliers\n",
             f"Final validation loss against training compute C (3 × the core's and the routing's forward FLOPs per "
             f"token × tokens trained), fitted as {law} (least squares over every run). A method's multiplier k is "
             f"how much more compute `{ref}` needs to reach that method's loss: {what}; k > 1 means the method is "
             f"worth more compute than `{ref}`. Interval ({100 * LEVEL:g} %): Welch's t on ln k, linearised through "
             "the fit, its variance from each (method, size) cell's seed variance, Welch-Satterthwaite degrees of "
             "freedom (on simulated ladders it leaves out the true k in 2-5 % of studies at 2, 3 and 5 seeds). "
             f"Median: of {result.resamples or RESAMPLES} seeded bootstrap refits (each cell's seeds resampled), a "
             "check on k.\n"]
    if result.refusal:
        lines.append(f"**No compute multipliers: {result.refusal}.**\n")
    else:
        lines += [_table(result), _quality(result), _residuals(result)]
    lines += [f"{note}\n" for note in result.notes]
    return "\n".join(lines)


def _table(result: Scaling) -> str:
    fit = result.fit
    head = ["method", "sizes", "runs", "A_m", "α", "multiplier k", "median", f"{100 * LEVEL:g} % interval",
            "residual RMS"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in result.methods:
        mine = [i for i, p in enumerate(result.points) if p.method == m]
        rms = math.sqrt(sum(fit.residuals[i] ** 2 for i in mine) / len(mine))
        interval = (f"{result.low[m]:.3f} – {result.high[m]:.3f}" if m in result.low else "—")
        sizes = len({result.points[i].size for i in mine})
        lines.append(f"| {m} | {sizes} | {len(mine)} | {fit.A(m):.4g} | {fit.alpha[m]:.4f} | {result.k[m]:.3f} | "
                     f"{_g(result.median.get(m), 4)} | {interval} | {rms:.4f} |")
    return "\n".join(lines) + "\n"


def _quality(result: Scaling) -> str:
    fit = result.fit
    alpha = f"α = {fit.alpha[result.reference]:.4f}" if result.shared else "α per method above"
    text = (f"E = {fit.E:.4f}, {alpha}; residual RMS over all runs {fit.rms:.4f}; the cell means (mean over seeds "
            f"per method and size) sit {result.cell_rms:.4f} (RMS) from the law")
    if result.seed_std is not None:
        text += (f", against a seed standard deviation of {result.seed_std:.4f} (ratio "
                 f"{result.cell_rms / result.seed_std:.2f}; above {POOR_FIT:g} the fit is called poor, and not "
                 "reported)")
    if fit.E <= 1e-6:
        text += (". E sits at its lower bound 0: these losses show no floor within the ladder (a pure power law "
                 "fits as well as any saturating one), so E is not estimated")
    if result.failed:
        text += (f". {result.failed} of {result.resamples} bootstrap resamples failed to refit (no convergence, or a "
                 "bound): " + ("no median" if result.failed == result.resamples else "the median is of the others")
                 + " (the interval does not resample)")
    return text + ".\n"


def _residuals(result: Scaling) -> str:
    """Fit minus mean loss per method (rows) and size (columns, by compute)."""
    sizes = sorted({p.size for p in result.points},
                   key=lambda s: min(p.compute for p in result.points if p.size == s))
    cell: dict[tuple[str, str], list[float]] = defaultdict(list)
    for p, r in zip(result.points, result.fit.residuals, strict=True):
        cell[(p.method, p.size)].append(r)
    lines = ["Residuals, the law minus the mean loss over seeds:\n", "| method | " + " | ".join(sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for m in result.methods:
        values = [cell.get((m, s)) for s in sizes]
        lines.append(f"| {m} | " + " | ".join("—" if not v else f"{sum(v) / len(v):+.4f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


def local_section(rows: list[LocalMultiplier], notes: list[str], reference: str) -> str:
    """The per-size multipliers (scaling.local_multipliers): methods x sizes, k and its interval, Δ beside it."""
    lines = ["### Per-size multipliers, the reference's ladder read directly\n",
             f"At each size, the compute at which `{reference}`'s seed-mean losses (ln loss linear in ln compute "
             "between its sizes) reach the method's mean loss, over the method's own compute there: no law fitted, so "
             "a ladder that bends away from one power law still reads size by size. Interval "
             f"({100 * LEVEL:g} %): Welch's t on ln k, its variance from the seeds of the method's cell and of the "
             f"two `{reference}` sizes the reading lies between, Welch-Satterthwaite degrees of freedom (at "
             f"`{reference}`'s own size it excludes k = 1 where Welch's test of Δ has p < 0.05; on simulated ladders "
             "it leaves out the true k in 2.5-5 % of studies at 2, 3 and 5 seeds). `*`: beyond "
             f"`{reference}`'s ladder, read off the line through the two sizes at that end of it (a loss below its "
             "largest size's: its two largest sizes; above its smallest's: its two smallest), after the interval: an "
             "end of it lies there. Δ: the method's mean loss minus the reference's at that size.\n"]
    if rows:
        sizes = list(dict.fromkeys(r.size for r in rows))  # rows come by the ladder's order
        cell = {(r.method, r.size): r for r in rows}
        lines += ["| method | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(sizes)]
        for m in sorted({r.method for r in rows}):
            lines.append(f"| {m} | " + " | ".join(_local_cell(cell.get((m, s))) for s in sizes) + " |")
        lines.append("")
    lines += [f"{note}\n" for note in notes]
    return "\n".join(lines)


def _local_cell(r: LocalMultiplier | None) -> str:
    if r is None:
        return "—"
    k = "—" if r.k is None else f"{r.k:.2f}{'*' if r.extrapolated else ''}"
    interval = f" ({r.low:.2f}–{r.high:.2f}{'*' if r.beyond else ''})" if r.low is not None else (" (no interval)" if r.k is not None else "")
    return f"{k}{interval}, Δ {r.delta:+.3f} (n {r.seeds})"


def local_csv(rows: list[LocalMultiplier]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["method", "size", "seeds", "delta", "multiplier", "low", "high", "extrapolated", "no_interval"])
    for r in rows:
        writer.writerow([r.method, r.size, r.seeds, r.delta, "" if r.k is None else r.k, "" if r.low is None else r.low,
                         "" if r.high is None else r.high, r.extrapolated, r.why or ""])
    return out.getvalue()


def method_csv(result: Scaling) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["method", "reference", "shared_exponent", "E", "A", "alpha", "multiplier", "median", "low",
                     "high", "level", "resamples", "at_compute", "refusal"])
    for m in result.methods:
        fit = result.fit
        writer.writerow([m, result.reference, result.shared, *(("", "", "") if fit is None else
                                                               (fit.E, fit.A(m), fit.alpha[m])),
                         result.k.get(m, ""), result.median.get(m, ""), result.low.get(m, ""),
                         result.high.get(m, ""), LEVEL, result.resamples, result.at or "", result.refusal or ""])
    return out.getvalue()


def points_csv(result: Scaling) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["method", "size", "seed", "compute", "val_loss", "fitted", "residual"])
    for i, p in enumerate(result.points):
        fitted = "" if result.fit is None else float(result.fit.predict(p.method, p.compute))
        residual = "" if result.fit is None else result.fit.residuals[i]
        writer.writerow([p.method, p.size, "" if p.seed is None else p.seed, p.compute, p.loss, fitted, residual])
    return out.getvalue()


# ---- the figure ------------------------------------------------------------------------------------
def plot_scaling(result: Scaling, out: Path, title: str, local: list[LocalMultiplier] | None = None) -> list[Path]:
    return save_figure(scaling_figure(result, title, local), out, "scaling")


def scaling_figure(result: Scaling, title: str, local: list[LocalMultiplier] | None = None) -> Any:
    """The figure, drawn (module doc)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, side) = plt.subplots(1, 2, figsize=(13.0, 5.6), gridspec_kw={"width_ratios": [1.25, 1]},
                                   layout="constrained")
    methods = result.methods
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    colors = {m: cmap(i % cmap.N) for i, m in enumerate(methods)}
    computes = [p.compute for p in result.points]
    for m in methods:
        mine = [p for p in result.points if p.method == m]
        ax.scatter([p.compute for p in mine], [p.loss for p in mine], s=12, alpha=0.45, color=colors[m], lw=0)
        cells = defaultdict(list)
        for p in mine:
            cells[p.size].append(p)
        means = sorted((np.mean([p.compute for p in c]), np.mean([p.loss for p in c])) for c in cells.values())
        ax.plot(*zip(*means, strict=True), "o", ms=7, mfc="none", mec=colors[m], mew=1.6,
                ls="none" if result.fit else ":", color=colors[m], label=_legend_text(result, m))
        if result.fit is not None:
            grid = np.geomspace(min(computes) / 1.5, max(computes) * 1.5, 200)
            ax.plot(grid, result.fit.predict(m, grid), "-", lw=1.4, color=colors[m])
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs: 3 × forward FLOPs per token × tokens)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.grid(True, which="both", alpha=0.25)
    if result.refusal:
        ax.set_title("No compute multipliers from one law:\n" + "\n".join(textwrap.wrap(result.refusal, 70)),
                     fontsize=8, loc="left")
    else:
        where = "" if result.shared else f", read at C = {result.at:.3g}"
        ax.set_title(f"L = E + A_m C^-α, E = {result.fit.E:.3f}; in the legend: k against {result.reference} "
                     f"({100 * LEVEL:g} % interval){where}", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2 if len(methods) > 3 else 1, frameon=False,
              fontsize=8)
    _local(side, local or [], result.reference, colors)
    fig.suptitle(title, fontsize=10)
    return fig


def _legend_text(result: Scaling, m: str) -> str:
    if result.refusal or m not in result.k:
        return m
    interval = f" ({result.low[m]:.2f}–{result.high[m]:.2f})" if m in result.low else ""
    return f"{m}: k {result.k[m]:.2f}{interval}"


def _local(ax: Any, rows: list[LocalMultiplier], reference: str, colors: dict[str, Any]) -> None:
    """The per-size multipliers: k against size, one offset column of points per method."""
    read = [r for r in rows if r.k is not None]
    if not read:
        ax.axis("off")
        ax.text(0.5, 0.5, f"no per-size multipliers: `{reference}`'s ladder cannot be read", ha="center",
                va="center", fontsize=9, transform=ax.transAxes, wrap=True)
        return
    order = list(dict.fromkeys(r.size for r in rows))  # local_multipliers gives them in the ladder's order
    sizes = ladder(order, {s: i for i, s in enumerate(order)})
    methods = [m for m in colors if any(r.method == m for r in read)]
    width = 0.7 / max(1, len(methods))
    for j, m in enumerate(methods):
        for r in (r for r in read if r.method == m):
            x = sizes.index(r.size) - 0.35 + width * (j + 0.5)
            err = None if r.low is None else [[r.k - r.low], [r.high - r.k]]
            ax.errorbar(x, r.k, yerr=err, fmt="o", ms=6, capsize=2, color=colors.get(m, "0.3"),
                        mfc="white" if r.extrapolated else colors.get(m, "0.3"), lw=1.1,
                        label=m if r.size == next(q.size for q in read if q.method == m) else None)
    ax.axhline(1.0, color="0.5", ls=":", lw=1)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib_formatter())  # 1.2, not 1.2 x 10^0
    ax.yaxis.set_minor_formatter(matplotlib_formatter())
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.set_xlabel("size (ladder order)")
    ax.set_ylabel(f"multiplier k against {reference} (log)")
    ax.set_title(f"per-size multipliers, read off {reference}'s ladder ({100 * LEVEL:g} % interval;\n"
                 "hollow: beyond its ladder, extrapolated)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.25)


def matplotlib_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")
