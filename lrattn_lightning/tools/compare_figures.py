"""The figures of `lrattn compare`, from its rows (tools/compare_table.py) and the runs' routing artifacts.

    loss_vs_flops      the paper's Figure 1: mean val loss against added FLOPs %, one point per ablation
                       (bars: std over seeds), the Pareto front marked
    routing_heatmaps   the mean routing weights (sites x sources) of each AttnRes ablation, side by side
    gate_alphas        the gated residual's mean alpha per sublayer, one line per ablation (band: seed min-max)
    training_curves    train loss and val loss against step, mean over seeds, overlaid

Each is written as .png and .svg; matplotlib is imported when a figure is drawn.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from lrattn_lightning.tools.compare_table import Row


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
    """Figure 1: mean val loss against added FLOPs %, one point per ablation, Pareto front marked (rows whose
    cost is unknown, NaN, are left out)."""
    rows = [r for r in rows if r.added_flops_pct == r.added_flops_pct]
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
    _place_labels(fig, ax, rows, top, multi)
    ax.set_xlabel("added FLOPs % of the non-embedding core (forward, per token)")
    ax.set_ylabel("validation loss (nats/token), mean ± std over seeds")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, out, "loss_vs_flops")


def _place_labels(fig: Any, ax: Any, rows: list[Row], top: float | None, multi: bool) -> None:
    """Name every point, each label where it overlaps no point, Pareto ring or earlier label."""
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


def _run_artifacts(client: Any, row: Row, path: str, tmp: str) -> tuple[list[dict], int]:
    """The JSON artifact `path` of each of the row's runs that has one, and the latest step among them."""
    found, step = [], 0
    for run in row.runs:
        try:
            local = client.download_artifacts(run.run_id, path, tmp)
        except Exception:  # runs of another routing kind have no such artifact
            continue
        data = json.loads(Path(local).read_text())
        found.append(data)
        step = max(step, int(data.get("step", 0)))
    return found, step


def routing_matrices(client: Any, rows: list[Row]) -> dict[str, tuple[list[list[float]], int, int]]:
    """ablation label -> (seed-mean routing weights sites x sources, step, seeds) from routing/weights.json."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            datas, step = _run_artifacts(client, row, "routing/weights.json", tmp)
            mats = [d["sites_by_sources"] for d in datas]
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
            datas, step = _run_artifacts(client, row, "routing/gates.json", tmp)
            curves = [d["alpha"] for d in datas]
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


# Curves of close variants lie on top of each other: besides its colour each gets a line style and a marker
# (staggered along the steps, and smaller for each later variant so that marks at one point nest), so a line
# hidden under another still shows through its dashes and marks.
LINE_STYLES = ["-", (0, (6, 2)), (0, (1.5, 1.5)), (0, (6, 1.5, 1.5, 1.5)), (0, (3, 1.5, 1.5, 1.5, 1.5, 1.5))]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def plot_curves(rows: list[Row], out: Path, title: str) -> list[Path]:
    """Train loss (smoothed) and val loss against step; mean over seeds, min-max band for train loss.

    One legend, under both panels: each variant has the same colour, line style and marker in both."""
    plt = _plt()
    colors, multi = _colors(rows), len({r.size for r in rows}) > 1
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12.5, 4.6))
    handles = {}  # label -> a line of it, for the shared legend
    for i, row in enumerate(sorted(rows, key=lambda r: _label(r, multi))):
        style = {"color": colors[row.ablation], "ls": LINE_STYLES[i % len(LINE_STYLES)],
                 "marker": MARKERS[i % len(MARKERS)], "lw": 1.5, "ms": 8 - 1.5 * (i % 4), "label": _label(row, multi)}
        for key, ax in (("train/loss", ax_t), ("val/loss", ax_v)):
            steps, mean, lo, hi = _seed_mean(row, key)
            if not steps:
                continue
            if key == "train/loss":
                mean, lo, hi = _smooth(mean), _smooth(lo), _smooth(hi)
                ax.fill_between(steps, lo, hi, color=style["color"], alpha=0.15, lw=0)
                every = max(1, len(steps) // 8)  # ~8 marks a line, each variant's shifted along the steps
                handles[style["label"]] = ax.plot(steps, mean, markevery=(i * every // len(rows), every), **style)[0]
            else:
                handles[style["label"]] = ax.plot(steps, mean, **style)[0]
    ax_t.set_title("train loss (moving average of 5 logged steps; band: seed min-max)", fontsize=9)
    ax_v.set_title("validation loss (mean over seeds)", fontsize=9)
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    _zoom(ax_t, rows, "train/loss")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room for the legend under the panels
    if handles:
        fig.legend(handles=list(handles.values()), loc="lower center", ncol=min(len(handles), 5), fontsize=8,
                   frameon=False, handlelength=3.5)
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

