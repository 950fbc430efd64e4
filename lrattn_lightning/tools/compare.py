"""`lrattn compare --experiment NAME`: the report of a sweep, read back from MLflow (any tracking URI).

Writes into --out (default reports/EXPERIMENT) and logs as artifacts of a summary run in the same
experiment (tag lrattn.summary=true; its description shows the table in the MLflow UI):

    table.md, table.csv      one row per (size, ablation): seeds, final val loss mean ± std, the
                             difference to the ablation's control and to the baseline with Welch's
                             t-test across seeds, added FLOPs %, parameters, tokens/s, val bits per byte,
                             and every downstream score `eval/<task>/<metric>` the runs carry
    loss_vs_flops.png/svg    the paper's Figure 1: mean val loss against added FLOPs %, one point per
                             ablation (bars: std over seeds), the Pareto front marked
    routing_heatmaps.png/svg the mean routing weights (sites x sources) of each AttnRes ablation, side by side
    gate_alphas.png/svg      the gated residual's mean alpha per sublayer, one line per ablation (mean over
                             seeds, band: seed min-max), from each run's routing/gates.json
    training_curves.png/svg  train loss and val loss against step, mean over seeds, overlaid
    report.md                all of the above on one page, with the runs it was made from

Only FINISHED runs count; when a (size, ablation, seed) was run more than once, the latest counts.
A run a sweep tagged with a `variant` (its own training flags) is its own row, `ablation+variant`,
whose control is the plain ablation.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lrattn_lightning.errors import Parser

SUMMARY_TAG = "lrattn.summary"
FIGURES = ("loss_vs_flops", "routing_heatmaps", "gate_alphas", "training_curves")


@dataclass
class RunRecord:
    run_id: str
    name: str
    size: str
    ablation: str
    control: str | None
    seed: int | None
    start_time: int
    val_loss: float
    params: int
    added_flops_pct: float
    metrics: dict[str, float]
    tokens_per_s: float | None = None
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


@dataclass
class Row:
    size: str
    ablation: str
    control: str | None
    runs: list[RunRecord]
    delta_control: float | None = None
    p_control: float | None = None
    delta_baseline: float | None = None
    p_baseline: float | None = None
    pareto: bool = False

    @property
    def losses(self) -> list[float]:
        return [r.val_loss for r in self.runs]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.losses) if len(self.runs) > 1 else None

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.runs]

    @property
    def added_flops_pct(self) -> float:
        return self.runs[0].added_flops_pct

    @property
    def params(self) -> int:
        return self.runs[0].params

    @property
    def tokens_per_s(self) -> float | None:
        values = [r.tokens_per_s for r in self.runs if r.tokens_per_s]
        return statistics.fmean(values) if values else None

    def metric(self, key: str) -> tuple[float | None, float | None]:
        values = [r.metrics[key] for r in self.runs if key in r.metrics]
        if not values:
            return None, None
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


# ---- reading MLflow --------------------------------------------------------------------------------
def read_runs(client: Any, experiment: str, sweep: str | None = None, curves: bool = True) -> list[RunRecord]:
    """The experiment's finished training runs (one per size, ablation, seed: the latest)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment '{experiment}' at {client.tracking_uri}; check --experiment/--tracking_uri")
    query = "attributes.status = 'FINISHED'" + (f" and tags.sweep = '{sweep}'" if sweep else "")
    latest: dict[tuple, RunRecord] = {}
    for run in _search_all(client, exp.experiment_id, query):
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        if tags.get(SUMMARY_TAG) == "true" or "ablation" not in params or "val/loss" not in metrics:
            continue
        seed = int(tags["seed"]) if tags.get("seed", "").lstrip("-").isdigit() else None
        control = None if tags.get("control") in (None, "none") else tags["control"]
        ablation = params["ablation"]
        if tags.get("variant"):  # a training-time variant of the entry: its own row, compared with the entry
            ablation, control = f"{ablation}+{tags['variant']}", ablation
        record = RunRecord(
            run_id=run.info.run_id, name=run.info.run_name or run.info.run_id, size=params.get("size", "?"),
            ablation=ablation, control=control,
            seed=seed, start_time=run.info.start_time or 0, val_loss=float(metrics["val/loss"]),
            params=int(float(params.get("params", 0))), added_flops_pct=float(params.get("added_flops_pct", 0.0)),
            metrics=dict(metrics),
        )
        key = (record.size, record.ablation, seed if seed is not None else record.run_id)
        if key not in latest or record.start_time > latest[key].start_time:
            latest[key] = record
    records = sorted(latest.values(), key=lambda r: (r.size, r.ablation, r.seed if r.seed is not None else -1))
    for record in records:
        speed = [m.value for m in client.get_metric_history(record.run_id, "train/device/items_per_sec")]
        record.tokens_per_s = statistics.median(speed) if speed else None
        if curves:
            for key in ("train/loss", "val/loss"):
                history = sorted(client.get_metric_history(record.run_id, key), key=lambda m: (m.step, m.timestamp))
                record.curves[key] = sorted({m.step: m.value for m in history}.items())  # a resumed run's later values win
    return records


def _search_all(client: Any, experiment_id: str, query: str) -> list[Any]:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            print(f"[lrattn compare] read {len(runs)} runs", file=sys.stderr, flush=True)
            return runs


# ---- statistics ------------------------------------------------------------------------------------
def welch(a: list[float], b: list[float]) -> tuple[float, float | None]:
    """(mean(a) - mean(b), two-sided p of Welch's t-test); p is None below two seeds a side."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, None
    from scipy import stats  # scipy comes with mlflow

    if statistics.variance(a) == 0 and statistics.variance(b) == 0:
        return diff, (1.0 if diff == 0 else 0.0)
    return diff, float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x and lower y are better)."""
    front, best = [], math.inf
    for i in sorted(range(len(points)), key=lambda i: points[i]):
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def summarise(records: list[RunRecord], reference: str = "baseline") -> list[Row]:
    """One row per (size, ablation), ordered by size then added FLOPs; differences and the Pareto front."""
    groups: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    for r in records:
        groups[(r.size, r.ablation)].append(r)
    rows = [Row(size, abl, runs[0].control, runs) for (size, abl), runs in groups.items()]
    rows.sort(key=lambda row: (row.size, row.added_flops_pct, row.ablation))
    by_name = {(row.size, row.ablation): row for row in rows}
    for row in rows:
        control = by_name.get((row.size, row.control)) if row.control else None
        if control is not None:
            row.delta_control, row.p_control = welch(row.losses, control.losses)
        base = by_name.get((row.size, reference))
        if base is not None and row is not base:
            row.delta_baseline, row.p_baseline = welch(row.losses, base.losses)
    for size in {row.size for row in rows}:
        mine = [row for row in rows if row.size == size]
        for i in pareto_front([(row.added_flops_pct, row.mean) for row in mine]):
            mine[i].pareto = True
    return rows


# ---- the table -------------------------------------------------------------------------------------
def eval_keys(rows: list[Row]) -> list[str]:
    return sorted({k for row in rows for r in row.runs for k in r.metrics if k.startswith("eval/")})


def _num(value: float | None, digits: int = 4, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _p(value: float | None) -> str:
    return "—" if value is None else (f"{value:.3f}" if value >= 0.001 else f"{value:.1e}")


def _mean_std(mean: float | None, std: float | None, digits: int = 4) -> str:
    return "—" if mean is None else _num(mean, digits) + ("" if std is None else f" ± {std:.{digits}f}")


def markdown_table(rows: list[Row], reference: str = "baseline") -> str:
    evals = eval_keys(rows)
    multi_size = len({row.size for row in rows}) > 1
    head = (["size"] if multi_size else []) + [
        "ablation", "seeds", "val loss (mean ± std)", "control", "Δ vs control", "p", f"Δ vs {reference}", "p",
        "added FLOPs %", "params", "tokens/s", "val bpb", *[k[len("eval/"):] for k in evals]]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if h in ("size", "ablation", "control") else "---:" for h in head) + "|"]
    for row in rows:
        name = f"**{row.ablation}**" if row.pareto else row.ablation
        seeds = ",".join("?" if s is None else str(s) for s in row.seeds)
        bpb = row.metric("val/bpb")
        cells = ([row.size] if multi_size else []) + [
            name, f"{len(row.runs)} ({seeds})", _mean_std(row.mean, row.std), row.control or "—",
            _num(row.delta_control, sign=True), _p(row.p_control), _num(row.delta_baseline, sign=True),
            _p(row.p_baseline), f"{row.added_flops_pct:.3f}", f"{row.params:,}",
            "—" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}", _mean_std(*bpb),
            *[_mean_std(*row.metric(k)) for k in evals]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_table(rows: list[Row], reference: str = "baseline") -> str:
    evals = eval_keys(rows)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["size", "ablation", "n_seeds", "seeds", "val_loss_mean", "val_loss_std", "val_loss_per_seed",
                     "control", "delta_control", "p_control", f"delta_{reference}", f"p_{reference}",
                     "added_flops_pct", "params", "tokens_per_s", "val_bpb_mean", "pareto", "run_ids",
                     *[f"{k}_mean" for k in evals], *[f"{k}_std" for k in evals]])
    for row in rows:
        writer.writerow([row.size, row.ablation, len(row.runs), ";".join(map(str, row.seeds)), row.mean,
                         "" if row.std is None else row.std, ";".join(f"{v:.6f}" for v in row.losses),
                         row.control or "", _blank(row.delta_control), _blank(row.p_control),
                         _blank(row.delta_baseline), _blank(row.p_baseline), row.added_flops_pct, row.params,
                         _blank(row.tokens_per_s), _blank(row.metric("val/bpb")[0]), row.pareto,
                         ";".join(r.run_id for r in row.runs),
                         *[_blank(row.metric(k)[0]) for k in evals], *[_blank(row.metric(k)[1]) for k in evals]])
    return out.getvalue()


def _blank(value: Any) -> Any:
    return "" if value is None else value


# ---- the figures -----------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(rows: list[Row]) -> dict[str, Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    return {row.ablation: cmap(i % cmap.N) for i, row in enumerate(sorted(rows, key=lambda r: r.ablation))}


def _label(row: Row, multi_size: bool) -> str:
    return f"{row.size}/{row.ablation}" if multi_size else row.ablation


def _save(fig: Any, out: Path, stem: str) -> list[Path]:
    paths = [out / f"{stem}.png", out / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=130, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    _plt().close(fig)
    return paths


def plot_loss_vs_flops(rows: list[Row], out: Path, title: str) -> list[Path]:
    """Figure 1: mean val loss against added FLOPs %, one point per ablation, Pareto front marked."""
    plt = _plt()
    from matplotlib.ticker import FuncFormatter

    colors, multi = _colors(rows), len({r.size for r in rows}) > 1
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    xs = [r.added_flops_pct for r in rows if r.added_flops_pct > 0]
    if xs and max(xs) / min(xs) > 5:  # costs over decades (the paper's 0.06 % .. 2.4 %): log beyond the smallest
        ax.set_xscale("symlog", linthresh=min(xs), linscale=0.6)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    top = _clip_top(rows)
    shown = [r for r in rows if top is None or r.mean <= top]
    for row in shown:
        ax.errorbar(row.added_flops_pct, row.mean, yerr=row.std or 0.0, fmt="o", ms=7, capsize=3,
                    color=colors[row.ablation], zorder=3)
    for size in sorted({r.size for r in rows}):
        front = sorted((r for r in shown if r.size == size and r.pareto), key=lambda r: r.added_flops_pct)
        ax.step([r.added_flops_pct for r in front], [r.mean for r in front], where="post", ls="--", color="0.35",
                lw=1.2, zorder=2, label="Pareto front" if size == min(r.size for r in rows) else None)
        ax.scatter([r.added_flops_pct for r in front], [r.mean for r in front], s=190, facecolors="none",
                   edgecolors="0.2", lw=1.4, zorder=4)
    for row in rows:
        if row.added_flops_pct == 0 and row.control is None:
            ax.axhline(row.mean, color="0.6", ls=":", lw=1, zorder=1, label=f"{_label(row, multi)} (control)")
    if top is not None:
        low = min(r.mean - (r.std or 0.0) for r in shown)
        ax.set_ylim(low - 0.08 * (top - low), top)
        for row in rows:
            if row.mean > top:  # off the scale: an arrow at the top edge, the value in the label
                ax.plot(row.added_flops_pct, top, "^", ms=9, color=colors[row.ablation], clip_on=False, zorder=5)
    fig.canvas.draw()  # final limits and scales, so labels can be placed in pixels, clear of points and labels
    px_per_pt = fig.dpi / 72
    marks = [tuple(ax.transData.transform((r.added_flops_pct, min(r.mean, top) if top else r.mean))) for r in rows]
    ring = 8 * px_per_pt  # the Pareto ring around a point
    boxes: list[tuple[float, float, float, float]] = [(x - ring, y - ring, x + ring, y + ring) for x, y in marks]
    for row, (px, py) in sorted(zip(rows, marks, strict=True), key=lambda item: (item[1][0], item[1][1])):
        off_scale = top is not None and row.mean > top
        text = _label(row, multi) + (f" ({row.mean:.3f}, off scale)" if off_scale else "")
        width, height = 5.2 * len(text) * px_per_pt, 9 * px_per_pt
        for dy in ((-14, 8, -26, 20, -38, 32, -50, 44) if off_scale else (6, -14, 18, -26, 30, -38, 42, -50)):
            box = (px + 7 * px_per_pt, py + dy * px_per_pt, px + 7 * px_per_pt + width, py + dy * px_per_pt + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
                break
        boxes.append(box)
        ax.annotate(text, (row.added_flops_pct, min(row.mean, top) if top else row.mean), textcoords="offset points",
                    xytext=(7, dy), fontsize=8, annotation_clip=False)
    ax.set_xlabel("added FLOPs % of the non-embedding core (forward, per token)")
    ax.set_ylabel("validation loss (nats/token), mean ± std over seeds")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, out, "loss_vs_flops")


def _clip_top(rows: list[Row]) -> float | None:
    """Upper y limit that leaves far-off points off the scale, or None when every point fits well."""
    anchors = [r for r in rows if r.added_flops_pct == 0 and r.control is None]
    if not anchors:
        return None
    top_anchor = max(r.mean for r in anchors)
    spread = max(top_anchor - min(r.mean for r in rows), *[(r.std or 0.0) for r in anchors], 1e-3)
    limit = top_anchor + 4 * spread
    inside = [r for r in rows if r.mean <= limit]
    if len(inside) == len(rows):
        return None
    return max(r.mean + (r.std or 0.0) for r in inside) + 0.6 * spread


def routing_matrices(client: Any, rows: list[Row]) -> dict[str, tuple[list[list[float]], int, int]]:
    """ablation label -> (seed-mean routing weights sites x sources, step, seeds) from routing/weights.json."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            mats, step = [], 0
            for run in row.runs:
                try:
                    path = client.download_artifacts(run.run_id, "routing/weights.json", tmp)
                except Exception:  # runs without depth routing have no such artifact
                    continue
                data = json.loads(Path(path).read_text())
                mats.append(data["sites_by_sources"])
                step = max(step, int(data.get("step", 0)))
            if mats and all(len(m) == len(mats[0]) and [len(x) for x in m] == [len(x) for x in mats[0]] for m in mats):
                mean = [[statistics.fmean(m[j][i] for m in mats) for i in range(len(mats[0][j]))]
                        for j in range(len(mats[0]))]
                found[(row.size, row.ablation)] = (mean, step, len(mats))
    return found


def gate_curves(client: Any, rows: list[Row]) -> dict[tuple[str, str], tuple[list[list[float]], int]]:
    """(size, ablation) -> (alpha per sublayer of each seed, step) from the gated runs' routing/gates.json."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            curves, step = [], 0
            for run in row.runs:
                try:
                    path = client.download_artifacts(run.run_id, "routing/gates.json", tmp)
                except Exception:  # only the gated residual logs gates
                    continue
                data = json.loads(Path(path).read_text())
                curves.append(data["alpha"])
                step = max(step, int(data.get("step", 0)))
            if curves and all(len(c) == len(curves[0]) for c in curves):
                found[(row.size, row.ablation)] = (curves, step)
    return found


def plot_gate_curves(curves: dict, out: Path, title: str) -> list[Path]:
    from lrattn_lightning.train.diagnostics import gate_figure

    multi = len({size for size, _ in curves}) > 1
    means, spread, steps = {}, {}, set()
    for (size, abl), (per_seed, step) in curves.items():
        label = f"{size}/{abl}" if multi else abl
        columns = list(zip(*per_seed, strict=True))
        means[label] = [statistics.fmean(c) for c in columns]
        spread[label] = ([min(c) for c in columns], [max(c) for c in columns])
        steps.add(step)
    step_text = "/".join(map(str, sorted(steps)))
    fig = gate_figure(means, f"{title}\nmean alpha per sublayer at step {step_text} (band: seed min-max)", spread=spread)
    return _save(fig, out, "gate_alphas")


def plot_heatmaps(matrices: dict, out: Path, title: str) -> list[Path]:
    plt = _plt()
    import numpy as np

    n = len(matrices)
    cols = min(n, 4)
    rows_n = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.6 * cols + 0.8, 3.9 * rows_n), squeeze=False)
    image = None
    multi = len({size for size, _ in matrices}) > 1
    for ax, ((size, abl), (matrix, step, seeds)) in zip(axes.flat, matrices.items(), strict=False):
        grid = np.full((len(matrix), max(len(r) for r in matrix)), np.nan)
        for j, r in enumerate(matrix):
            grid[j, : len(r)] = r
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(f"{size}/{abl}" if multi else abl, fontsize=9)
        ax.set_xlabel(f"source (0 = embedding); step {step}, {seeds} seed(s)", fontsize=7)
        ax.set_ylabel("read site j", fontsize=8)
        ax.set_yticks(range(grid.shape[0]), [str(j + 1) for j in range(grid.shape[0])], fontsize=6)
        ax.set_xticks(range(grid.shape[1]), [str(i) for i in range(grid.shape[1])], fontsize=6)
        if grid.size <= 400:  # small enough to print the weights themselves
            for (j, i), value in np.ndenumerate(grid):
                if not np.isnan(value):
                    ax.text(i, j, f"{value:.2f}"[1:] if value < 1 else "1", ha="center", va="center", fontsize=5,
                            color="black" if value > 0.55 else "white")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10, y=1.0 + 0.04 / rows_n)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="mean routing weight", shrink=0.85)
    return _save(fig, out, "routing_heatmaps")


def plot_curves(rows: list[Row], out: Path, title: str) -> list[Path]:
    """Train loss (smoothed) and val loss against step; mean over seeds, min-max band for train loss."""
    plt = _plt()
    colors, multi = _colors(rows), len({r.size for r in rows}) > 1
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12.5, 4.6))
    for row in rows:
        color, label = colors[row.ablation], _label(row, multi)
        for key, ax in (("train/loss", ax_t), ("val/loss", ax_v)):
            steps, mean, lo, hi = _seed_mean(row, key)
            if not steps:
                continue
            if key == "train/loss":
                mean, lo, hi = _smooth(mean), _smooth(lo), _smooth(hi)
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
                ax.plot(steps, mean, color=color, lw=1.4, label=label)
            else:
                ax.plot(steps, mean, "o-", color=color, lw=1.4, ms=4, label=label)
    ax_t.set_title("train loss (moving average of 5 logged steps; band: seed min-max)", fontsize=9)
    ax_v.set_title("validation loss (mean over seeds)", fontsize=9)
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    _zoom(ax_t, rows, "train/loss")
    ax_v.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "training_curves")


def _seed_mean(row: Row, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    by_step: dict[int, list[float]] = defaultdict(list)
    for run in row.runs:
        for step, value in run.curves.get(key, []):
            by_step[step].append(value)
    steps = sorted(s for s, v in by_step.items() if len(v) == len(row.runs))  # steps every seed logged
    return (steps, [statistics.fmean(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def _zoom(ax: Any, rows: list[Row], key: str) -> None:
    """Keep the first steps' large losses from flattening the part where the variants differ."""
    tails = [v for row in rows for r in row.runs for _, v in r.curves.get(key, [])[len(r.curves.get(key, [])) // 5:]]
    if tails:
        ax.set_ylim(min(tails) - 0.05 * (max(tails) - min(tails)), max(tails))


# ---- the report ------------------------------------------------------------------------------------
def write_report(client: Any, experiment: str, out: Path, sweep: str | None = None, reference: str = "baseline",
                 command: str | None = None) -> tuple[list[Row], list[Path]]:
    records = read_runs(client, experiment, sweep)
    if not records:
        raise ValueError(f"experiment '{experiment}' has no FINISHED training runs with val/loss"
                         + (f" tagged sweep={sweep}" if sweep else ""))
    rows = summarise(records, reference)
    out.mkdir(parents=True, exist_ok=True)
    sizes = ", ".join(sorted({r.size for r in rows}))
    seeds = sorted({len(row.runs) for row in rows})
    title = f"{experiment}: size {sizes}, {'/'.join(map(str, seeds))} seed(s) per ablation"
    table_md = markdown_table(rows, reference)
    files = [out / "table.md", out / "table.csv"]
    files[0].write_text(table_md)
    files[1].write_text(csv_table(rows, reference))
    files += plot_loss_vs_flops(rows, out, title)
    files += plot_curves(rows, out, title)
    matrices = routing_matrices(client, rows)
    if matrices:
        files += plot_heatmaps(matrices, out, title + " — routing weights at the last validation")
    gates = gate_curves(client, rows)
    if gates:
        files += plot_gate_curves(gates, out, title)
    report = out / "report.md"
    report.write_text(_report_text(experiment, rows, table_md, records, bool(matrices), command, reference,
                                   bool(gates)))
    files.append(report)
    return rows, files


def _report_text(experiment: str, rows: list[Row], table_md: str, records: list[RunRecord], heatmaps: bool,
                 command: str | None, reference: str, gates: bool = False) -> str:
    parts = [f"# {experiment}: comparison\n",
             f"Generated by `{command}` from {len(records)} finished runs." if command else "",
             f"\nFinal validation loss per run (nats/token), mean ± sample std over seeds. Δ is the difference of "
             f"means to the ablation's registry control (for an `ablation+variant` row, a run with its own training "
             f"flags: the plain ablation) and to `{reference}`; p is Welch's two-sided t-test across "
             "seeds (— below two seeds a side). Added FLOPs % is the analytic forward cost of routing relative to "
             "the non-embedding core (SPEC §4); tokens/s is the median training throughput of each run, averaged "
             "over seeds. **Bold**: on the Pareto front of (added FLOPs %, mean val loss).\n",
             table_md,
             "\n![validation loss against added FLOPs](loss_vs_flops.png)\n",
             "\n![training curves](training_curves.png)\n"]
    if heatmaps:
        parts.append("\n![routing weights](routing_heatmaps.png)\n")
    if gates:
        parts.append("\n![gated residual: alpha per sublayer](gate_alphas.png)\n")
    parts.append("\n## Runs\n\n| run | ablation | seed | val loss | run id |\n|---|---|---:|---:|---|")
    parts += [f"| {r.name} | {r.ablation} | {r.seed} | {r.val_loss:.4f} | `{r.run_id}` |" for r in records]
    return "\n".join(p for p in parts if p is not None) + "\n"


def log_summary_run(client: Any, experiment: str, files: list[Path], table_md: str, sweep: str | None) -> str:
    """Log the report as artifacts of the experiment's summary run (created once, then reused)."""
    exp = client.get_experiment_by_name(experiment)
    query = f"tags.`{SUMMARY_TAG}` = 'true'" + (f" and tags.sweep_summary = '{sweep}'" if sweep else "")
    found = _search_all(client, exp.experiment_id, query)
    if found:
        run_id = max(found, key=lambda r: r.info.start_time).info.run_id
    else:
        tags = {SUMMARY_TAG: "true", "mlflow.runName": f"compare-{sweep or experiment}"}
        if sweep:
            tags["sweep_summary"] = sweep
        run_id = client.create_run(exp.experiment_id, tags=tags).info.run_id
    for path in files:
        client.log_artifact(run_id, str(path), "compare")
    client.set_tag(run_id, "mlflow.note.content", table_md)  # the run's description in the UI
    client.set_terminated(run_id, "FINISHED")
    return run_id


def main(argv: list[str] | None = None) -> int:
    from mlflow.tracking import MlflowClient

    from lrattn_lightning.train.tracking import resolve_tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    parser = Parser(prog="lrattn compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", required=True, help="the MLflow experiment of the sweep")
    parser.add_argument("--tracking_uri", "--tracking-uri", default=None,
                        help="MLflow store (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--sweep", default=None, help="only runs tagged with this sweep name")
    parser.add_argument("--reference", default="baseline", help="the ablation every row is also compared with")
    parser.add_argument("--out", default=None, help="output folder (default: reports/EXPERIMENT)")
    parser.add_argument("--no-summary-run", action="store_true", help="do not log the report to MLflow")
    args = parser.parse_args(argv)
    uri = resolve_tracking_uri(args.tracking_uri, fallback_local=False)
    client = MlflowClient(uri)
    out = Path(args.out or f"reports/{args.experiment}")
    command = "lrattn compare " + " ".join(argv if argv is not None else sys.argv[2:])
    rows, files = write_report(client, args.experiment, out, args.sweep, args.reference, command)
    print((out / "table.md").read_text())
    print(f"[lrattn compare] {len(rows)} ablations; wrote {', '.join(p.name for p in files)} to {out}")
    if not args.no_summary_run:
        run_id = log_summary_run(client, args.experiment, files, (out / "table.md").read_text(), args.sweep)
        print(f"[lrattn compare] logged as artifacts compare/* of run {run_id} in experiment '{args.experiment}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
