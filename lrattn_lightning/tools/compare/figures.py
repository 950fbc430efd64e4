"""The figures of `lrattn compare`, from its rows (table.py) and the runs' routing artifacts.

    loss_vs_flops      the paper's Figure 1: mean val loss against added FLOPs %, one point per row (bars: std
                       over seeds), the Pareto front of each recipe marked; the legend (the ring's meaning
                       included) sits under the axes and every label where it covers no point, bar, ring, line
                       or other label (labels.py), or, where the points crowd, a number keyed in the legend
    routing_heatmaps   heatmaps.py
    gate_alphas        the gated residual's mean alpha per sublayer, one line per ablation (band: seed min-max)
    training_curves    one row of panels per size (ladder order): train loss over the whole run, the same zoomed
                       on its second half, and val loss over the whole run; mean over seeds, overlaid

A row's name in a figure is its label (table.Row.label), with its recipe's letter when the
experiment holds several. Each figure is written as .png and .svg; matplotlib is imported when one is drawn.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.core.files import replacing
from lrattn_lightning.tools.compare import labels as labels_mod
from lrattn_lightning.tools.compare.runs import Curve
from lrattn_lightning.tools.compare.table import Row
from lrattn_lightning.tools.compare.words import size_list
from lrattn_lightning.train.schema import Artifact, Metric


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), imported when a figure is first drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def row_names(rows: list[Row]) -> dict[int, str]:
    """id(row) -> its name in figures: size/ if several sizes, the label, [recipe] if several recipes."""
    multi_size = len({r.size for r in rows}) > 1
    methods = ablation_names(rows)
    return {id(r): (f"{r.size}/" if multi_size else "") + methods[id(r)] for r in rows}


def ablation_names(rows: list[Row]) -> dict[int, str]:
    """id(row) -> its method's name in figures, whatever its size: the label, [recipe] if several recipes."""
    recipes = any(r.group != "A" for r in rows)
    return {id(r): (r.label or r.ablation) + (f" [{r.group}]" if recipes else "") for r in rows}


def _colors(rows: list[Row]) -> dict[int, Any]:
    """id(row) -> its colour: one a method (label and recipe), the same at every size."""
    plt = pyplot()
    methods = ablation_names(rows)
    order = sorted(set(methods.values()))
    cmap = plt.get_cmap("tab10" if len(order) <= 10 else "tab20")
    return {key: cmap(order.index(name) % cmap.N) for key, name in methods.items()}


SIZE_MARKERS = ("o", "s", "D", "v", "P", "X", "h", "<", ">", "p")  # ^ marks a point off the scale


def _markers(rows: list[Row]) -> dict[str, str]:
    """size -> its marker in the FLOPs figure (ladder order)."""
    return {size: SIZE_MARKERS[i % len(SIZE_MARKERS)] for i, size in enumerate(size_list(rows))}


DPI = 150  # PNGs at 100 % zoom: 9-point labels are 19 pixels tall


def save_figure(fig: Any, out: Path, stem: str) -> list[Path]:
    """`fig` as out/STEM.png (at DPI) and out/STEM.svg, then closed. Laid out (its layout engine) and measured (the
    tight box, padded as savefig pads it) once, at the PNG's DPI, for both files: savefig with bbox_inches="tight"
    lays the figure out and draws it twice for each file (a dry draw to measure it, then its own). The PNG is the
    one savefig makes; the SVG's box and layout are the PNG's (measured at 150 dpi, not 72)."""
    import matplotlib

    paths = [out / f"{stem}.png", out / f"{stem}.svg"]
    fig.set_dpi(DPI)
    fig.draw_without_rendering()
    box = fig.get_tightbbox().padded(matplotlib.rcParams["savefig.pad_inches"])
    fig.set_layout_engine(None)  # laid out: the axes keep their places
    with replacing(paths[0], "wb", "figure") as png:  # never through a link (core/files.py)
        fig.savefig(png, format="png", dpi=DPI, bbox_inches=box)
    with replacing(paths[1], "wb", "figure") as svg:
        fig.savefig(svg, format="svg", bbox_inches=box)
    pyplot().close(fig)
    return paths


def plot_loss_vs_flops(rows: list[Row], out: Path, title: str) -> list[Path]:
    return save_figure(loss_vs_flops_figure(rows, title), out, "loss_vs_flops")


def loss_vs_flops_figure(rows: list[Row], title: str) -> Any:
    """Figure 1: mean val loss against added FLOPs %, one point per row, each recipe's Pareto front marked
    (rows whose cost is unknown, NaN, are left out). Returns the figure, drawn."""
    rows = [r for r in rows if r.added_flops_pct == r.added_flops_pct]
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    names, colors, markers = row_names(rows), _colors(rows), _markers(rows)
    fig, ax = plt.subplots(figsize=(8.0, 5.4), dpi=DPI)
    xs = [r.added_flops_pct for r in rows if r.added_flops_pct > 0]
    if xs and max(xs) / min(xs) > 5:  # costs over decades (the paper's 0.06 % .. 2.4 %): log beyond the smallest
        ax.set_xscale("symlog", linthresh=min(xs), linscale=0.6)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    top = _clip_top(rows)
    shown = [r for r in rows if top is None or r.mean <= top]
    for row in shown:
        ax.errorbar(row.added_flops_pct, row.mean, yerr=row.std or 0.0, fmt=markers[row.size], ms=7, capsize=3,
                    color=colors[id(row)], zorder=3)
    fronts = sorted({(r.size, r.group) for r in rows})
    for size, group in fronts:
        front = sorted((r for r in shown if (r.size, r.group) == (size, group) and r.pareto),
                       key=lambda r: r.added_flops_pct)
        label = "Pareto front" + (f" of recipe {group}" if len({g for _, g in fronts}) > 1 else "")
        first = (size, group) == min((s, g) for s, g in fronts if g == group)
        ax.step([r.added_flops_pct for r in front], [r.mean for r in front], where="post", color="0.35", lw=1.2,
                ls="--" if group == "A" else ":", zorder=2, label=label if first and len(front) > 1 else None)
        ax.scatter([r.added_flops_pct for r in front], [r.mean for r in front], s=190, facecolors="none",
                   edgecolors="0.2", lw=1.4, zorder=4)
    anchors = [row for row in rows if row.added_flops_pct == 0 and row.control is None]
    anchor_names = list(dict.fromkeys(row.label or row.ablation for row in anchors))
    for i, row in enumerate(anchors):  # one legend entry for them all: the lines look alike, their points say whose
        several = len(anchors) > 1
        label = (f"{' / '.join(anchor_names)}'s mean{' at each size' if len({r.size for r in anchors}) > 1 else ''}"
                 f"{' and recipe' if len({r.group for r in anchors}) > 1 else ''} (the control, dotted)") if several \
            else f"{names[id(row)]} (control)"
        ax.axhline(row.mean, color="0.6", ls=":", lw=1, zorder=1, label=label if i == 0 else None)
    if top is not None:
        low = min(r.mean - (r.std or 0.0) for r in shown)
        ax.set_ylim(low - 0.08 * (top - low), top)
        for row in rows:
            if row.mean > top:  # off the scale: an arrow at the top edge, the value in the label
                ax.plot(row.added_flops_pct, top, "^", ms=9, color=colors[id(row)], clip_on=False, zorder=5)
    ax.set_xlabel("added FLOPs % of the non-embedding core (forward, per token)", fontsize=10)
    ax.set_ylabel("validation loss (nats/token), mean ± std over seeds", fontsize=10)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(r.pareto for r in shown):  # the ring is a marker of its own: the legend says what it means
        handles.append(Line2D([], [], ls="none", marker="o", ms=RING_MS, mfc="none", mec="0.2", mew=1.4))
        labels.append("on the Pareto front (ring)")
    if len(shown) < len(rows):
        handles.append(Line2D([], [], ls="none", marker="^", ms=9, color="0.35"))
        labels.append("off the scale (its value in its label)")
    if len(markers) > 1:  # a colour is a method at every size; the marker says which size
        for size, marker in markers.items():
            handles.append(Line2D([], [], ls="none", marker=marker, ms=7, color="0.35"))
            labels.append(f"size {size}")
    _legend(ax, handles, labels)
    _name_points(fig, ax, rows, top, names, colors, markers, handles, labels)
    return fig


RING_MS = 13.8  # points: the diameter of the Pareto ring (scatter s=190 is an area in points^2)
LABEL_PT = 9


def _legend(ax: Any, handles: list, labels: list[str]) -> None:
    """Under the axes, never over a point."""
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=min(3, len(handles)),
                  fontsize=LABEL_PT, frameon=False)


def _name_points(fig: Any, ax: Any, rows: list[Row], top: float | None, names: dict[int, str], colors: dict,
                 markers: dict[str, str], handles: list, labels: list[str]) -> None:
    """Name every point beside it where its name covers nothing (labels.py); where one name finds no such place
    near its point, number the points instead and key the numbers, with each point's marker, in the legend."""
    from matplotlib.lines import Line2D

    fig.canvas.draw()  # final limits and scales, so labels can be placed in pixels
    ordered = sorted(rows, key=lambda r: (r.added_flops_pct, r.mean))
    ring = RING_MS / 2 * fig.dpi / 72 + 1

    def marks() -> list[tuple]:
        boxes = []
        for r in rows:
            x, y = ax.transData.transform((r.added_flops_pct, min(r.mean, top) if top else r.mean))
            boxes.append((x - ring, y - ring, x + ring, y + ring))
            if r.std and (top is None or r.mean <= top):  # the error bar
                _, lo = ax.transData.transform((r.added_flops_pct, r.mean - r.std))
                _, hi = ax.transData.transform((r.added_flops_pct, r.mean + r.std))
                boxes.append((x - 5, lo, x + 5, hi))
        return boxes + labels_mod.furniture(fig, ax) + labels_mod.line_boxes(ax)

    def xy(r: Row) -> tuple[float, float]:
        return (r.added_flops_pct, min(r.mean, top) if top else r.mean)

    def off(r: Row) -> str:
        return f" ({r.mean:.3f}, off scale)" if top is not None and r.mean > top else ""

    items = [(xy(r), names[id(r)] + off(r), colors[id(r)]) for r in ordered]
    if labels_mod.place(fig, ax, items, marks(), inside=True, reach=60, fontsize=LABEL_PT) is not None:
        return
    for i, r in enumerate(ordered, start=1):
        handles.append(Line2D([], [], ls="none", marker=markers[r.size], ms=7, color=colors[id(r)]))
        labels.append(f"{i}: {names[id(r)]}{off(r)}")
    _legend(ax, handles, labels)
    fig.canvas.draw()  # the legend grew: measure it again
    numbers = [(xy(r), str(i), colors[id(r)]) for i, r in enumerate(ordered, start=1)]
    labels_mod.place(fig, ax, numbers, marks(), inside=False, fontsize=LABEL_PT)


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


def run_artifacts(client: Any, row: Row, path: str, tmp: str) -> tuple[list[dict], int]:
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


def gate_curves(client: Any, rows: list[Row]) -> dict[str, tuple[list[list[float]], int]]:
    """row name -> (alpha per sublayer of each seed, step) from the gated runs' routing/gates.json."""
    found, names = {}, row_names(rows)
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            datas, step = run_artifacts(client, row, Artifact.GATES_JSON, tmp)
            curves = [d["alpha"] for d in datas]
            if curves and all(len(c) == len(curves[0]) for c in curves):
                found[names[id(row)]] = (curves, step)
    return found


def plot_gate_curves(curves: dict, out: Path, title: str) -> list[Path]:
    from lrattn_lightning.train.diagnostics import gate_figure

    means, spread, steps = {}, {}, set()
    for label, (per_seed, step) in curves.items():
        columns = list(zip(*per_seed, strict=True))
        means[label] = [statistics.fmean(c) for c in columns]
        spread[label] = ([min(c) for c in columns], [max(c) for c in columns])
        steps.add(step)
    step_text = "/".join(map(str, sorted(steps)))
    fig = gate_figure(means, f"{title}\nmean alpha per sublayer at step {step_text} (band: seed min-max)", spread=spread)
    return save_figure(fig, out, "gate_alphas")


# Curves of close variants lie on top of each other: besides its colour each gets a line style and a marker
# (staggered along the steps, and smaller for each later variant so that marks at one point nest), so a line
# hidden under another still shows through its dashes and marks.
LINE_STYLES = ["-", (0, (6, 2)), (0, (1.5, 1.5)), (0, (6, 1.5, 1.5, 1.5)), (0, (3, 1.5, 1.5, 1.5, 1.5, 1.5))]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def plot_curves(rows: list[Row], out: Path, title: str) -> list[Path]:
    return save_figure(curves_figure(rows, title), out, "training_curves")


def curves_figure(rows: list[Row], title: str) -> Any:
    """One row of panels per size (ladder order: sizes train for different lengths, so each gets its own step
    axis): train loss (smoothed) over the size's whole run, the same zoomed on the second half of its steps (where
    the variants differ; the first steps' large losses flatten it in the whole view), and val loss over the whole
    run; mean over seeds, min-max band for train loss. One legend, under the panels: each ablation has the same
    colour, line style and marker in every panel and size."""
    plt = pyplot()
    sizes = size_list(rows)
    several = len(sizes) > 1
    names = ablation_names(rows)  # no size/: the panel rows say it
    order = sorted(set(names.values()))
    cmap = plt.get_cmap("tab10" if len(order) <= 10 else "tab20")
    colors = {name: cmap(i % cmap.N) for i, name in enumerate(order)}
    fig, grid = plt.subplots(len(sizes), 3, figsize=(16.5, 1.0 + 3.6 * len(sizes)), squeeze=False,
                             layout="constrained")
    handles = {}  # label -> a line of it, for the shared legend
    for size, (ax_t, ax_z, ax_v) in zip(sizes, grid, strict=True):
        mine = [r for r in rows if r.size == size]
        last = max([_last_step(run.curves.get(key, [])) for r in mine for run in r.runs
                    for key in (Metric.TRAIN_LOSS, Metric.VAL_LOSS)] + [run.final_step or 0 for r in mine for run in r.runs] + [1])
        zoom_from = last // 2
        means = {(id(r), key): _seed_mean(r, key) for r in mine for key in (Metric.TRAIN_LOSS, Metric.VAL_LOSS)}
        val_steps = [means[id(r), Metric.VAL_LOSS][0] for r in mine]
        ends = {len(steps) for steps in val_steps} <= {0, 1}  # each row validated once (or never)
        for k, row in enumerate(sorted(mine, key=lambda r: names[id(r)])):
            i = order.index(names[id(row)])
            style = {"color": colors[names[id(row)]], "ls": LINE_STYLES[i % len(LINE_STYLES)],
                     "marker": MARKERS[i % len(MARKERS)], "lw": 1.5, "ms": 8 - 1.5 * (i % 4), "label": names[id(row)]}
            for key in (Metric.TRAIN_LOSS, Metric.VAL_LOSS):
                steps, mean, lo, hi = means[id(row), key]
                if not steps:
                    continue
                if key == Metric.VAL_LOSS and ends:  # one point a row: side by side, each with its seeds' range
                    ax_v.errorbar([k], mean, yerr=[[mean[0] - lo[0]], [hi[0] - mean[0]]], fmt=style["marker"],
                                  ms=style["ms"], color=style["color"], capsize=4, lw=1.5)
                    continue
                if key == Metric.VAL_LOSS:
                    handles[style["label"]] = ax_v.plot(steps, mean, **style)[0]
                    continue
                mean, lo, hi = _smooth(mean), _smooth(lo), _smooth(hi)
                every = max(1, len(steps) // 8)  # ~8 marks a line, each variant's shifted along the steps
                for ax in (ax_t, ax_z):
                    ax.fill_between(steps, lo, hi, color=style["color"], alpha=0.15, lw=0)
                    handles[style["label"]] = ax.plot(steps, mean, markevery=(i * every // len(order), every),
                                                      **style)[0]
        at = f"{size}: " if several else ""
        ax_t.set_title(f"{at}train loss, whole run (moving average of 5 logged steps; band: seed min-max)", fontsize=9)
        ax_z.set_title(f"{at}train loss, steps {zoom_from}-{last} (zoom)", fontsize=9)
        if ends:
            steps = sorted({one[0] for one in val_steps if one})
            at_step = f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))
            ax_v.set_title(f"{at}validation loss at {at_step}, its only one (bar: seed range)", fontsize=9)
        else:
            ax_v.set_title(f"{at}validation loss, whole run (mean over seeds)", fontsize=9)
        for ax in (ax_t, ax_z, ax_v):
            ax.set_xlabel("step")
            ax.set_ylabel("loss (nats/token)")
            ax.grid(alpha=0.3)
        for ax in (ax_t, ax_v) if not ends else (ax_t,):  # the whole run, whatever each row's length
            ax.set_xlim(0, last * 1.02)
        if ends:  # the rows side by side, in the legend's order; their colour and marker say which is which
            ax_v.set_xlim(-0.7, len(mine) - 0.3)
            ax_v.set_xticks([])
            ax_v.set_xlabel("method (legend below)")
        _zoom(ax_z, mine, zoom_from, last)
    fig.suptitle(title, fontsize=10)
    if handles:
        fig.legend(handles=list(handles.values()), loc="outside lower center", ncol=min(len(handles), 5), fontsize=8,
                   frameon=False, handlelength=3.5)
    return fig


def _curve_arrays(curve: Any) -> tuple[Any, Any]:
    """(steps, values) of a run's curve as numpy arrays: a runs.Curve's own arrays, or any (step, value) pairs."""
    if isinstance(curve, Curve):
        return np.frombuffer(curve.steps, dtype=np.int64), np.frombuffer(curve.values, dtype=np.float64)
    pairs = np.array(list(curve), dtype=float).reshape(-1, 2)
    return pairs[:, 0].astype(np.int64), pairs[:, 1]


def _last_step(curve: Any) -> int:
    steps, _ = _curve_arrays(curve)
    return int(steps.max()) if len(steps) else 0


def _seed_mean(row: Row, key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """The steps every seed of the row logged, and the mean, min and max over its seeds there (one pass of numpy
    over the row's points, not a Python loop over them)."""
    arrays = [_curve_arrays(run.curves[key]) for run in row.runs if run.curves.get(key)]
    if len(arrays) < len(row.runs) or not arrays:
        return [], [], [], []
    steps = np.concatenate([s for s, _ in arrays])
    values = np.concatenate([v for _, v in arrays])
    order = np.argsort(steps, kind="stable")
    steps, values = steps[order], values[order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    counts = np.diff(np.r_[starts, len(steps)])
    every = counts == len(row.runs)  # steps every seed logged
    mean = np.add.reduceat(values, starts) / counts
    low, high = np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)
    return (steps[starts][every].tolist(), mean[every].tolist(), low[every].tolist(), high[every].tolist())


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def _zoom(ax: Any, rows: list[Row], start: int, end: int) -> None:
    """The zoom panel's limits: steps start..end and the (smoothed) losses there."""
    values = []
    for row in rows:
        steps, mean, lo, hi = _seed_mean(row, Metric.TRAIN_LOSS)
        smooth_lo, smooth_hi = _smooth(lo), _smooth(hi)
        values += [v for s, a, b in zip(steps, smooth_lo, smooth_hi, strict=True) if s >= start for v in (a, b)]
    ax.set_xlim(start, max(end, start + 1))
    if values:
        pad = 0.05 * (max(values) - min(values) or 1e-3)
        ax.set_ylim(min(values) - pad, max(values) + pad)
