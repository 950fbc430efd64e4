"""The routing heatmaps of `lrattn compare` (figures.py draws the rest): the routing weights every kind logs
(routing/weights.json: sites x sources) of each row, averaged over its seeds, one panel per row sized to its
content, one figure per size (the largest `routing_heatmaps`, the others `routing_heatmaps-SIZE`)."""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from lrattn_lightning.core.words import count
from lrattn_lightning.tools.compare.figures import DPI, pyplot, row_names, run_artifacts, save_figure
from lrattn_lightning.tools.compare.table import Row
from lrattn_lightning.tools.compare.words import size_list
from lrattn_lightning.train.schema import Artifact


def routing_matrices(client: Any, rows: list[Row]) -> dict[str, tuple[dict, int, int]]:
    """row name -> (its weights table with the seed-mean matrix, step, seeds) from each run's routing/weights.json
    (any routing kind; train/diagnostics.py). Seeds whose matrices differ in shape are not averaged: the row's
    first run's table is drawn alone."""
    found, names = {}, row_names(rows)
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            datas, step = run_artifacts(client, row, Artifact.ROUTING_WEIGHTS, tmp)
            mats = [d["sites_by_sources"] for d in datas]
            if not mats or not mats[0]:
                continue
            if not all([len(x) for x in m] == [len(x) for x in mats[0]] for m in mats):
                datas, mats = datas[:1], mats[:1]
            mean = [[_mean([m[j][i] for m in mats]) for i in range(len(mats[0][j]))] for j in range(len(mats[0]))]
            found[names[id(row)]] = ({**datas[0], "sites_by_sources": mean}, step, len(mats))
    return found


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if len(kept) == len(values) else None


def heatmap_groups(rows: list[Row]) -> list[tuple[str, str, list[Row]]]:
    """(size, file stem, its rows) per size, largest (most parameters) first: one heatmap figure per size, so a
    ladder's panels stay apart and each figure stays readable; the largest size's is `routing_heatmaps`, the
    others `routing_heatmaps-SIZE`."""
    sizes: dict[str, list[Row]] = {}
    for row in rows:
        sizes.setdefault(row.size, []).append(row)
    order = size_list(rows)[::-1]  # the largest model first (words.py)
    return [(s, "routing_heatmaps" if i == 0 else f"routing_heatmaps-{s}", sizes[s]) for i, s in enumerate(order)]


def plot_heatmaps(matrices: dict, out: Path, title: str, stem: str = "routing_heatmaps") -> list[Path]:
    return save_figure(heatmaps_figure(matrices, title), out, stem)


CELL_W, CELL_H = 0.36, 0.26  # inches a source column and a site row take: a 7-point weight, an 8-point tick label
CHAR = 0.075  # inches a character of an 8-9 point label takes, about


def heatmaps_figure(matrices: dict, title: str) -> Any:
    """One panel per row (its own labels, axes and colour scale: softmax weights and gates on 0..1, signed
    mixing coefficients on a diverging scale), drawn by the function that draws a run's own heatmap. Each panel
    is as large as its content (CELL_W x CELL_H a cell, room for its tick labels, wrapped title and axis labels,
    colour bar): a table of 32 sites gets the height of 32 rows; constrained layout keeps titles off the axes."""
    from lrattn_lightning.train.diagnostics import heatmap_figure

    plt = pyplot()
    panels = sorted(matrices.items())  # by name: the same order in every size's figure
    sizes = [_panel_inches(table) for _, (table, _, _) in panels]
    n = len(panels)
    cols = min(n, 3)
    while cols > 1 and sum(sorted((size[0] for size in sizes), reverse=True)[:cols]) > 24:  # at most ~24 in wide
        cols -= 1
    rows_n = math.ceil(n / cols)
    def widest(c: int, k: int) -> float:  # k = 0: the panel, 2: its cells
        return max(sizes[i][k] for i in range(c, n, cols))

    def tallest(r: int, k: int) -> float:  # k = 1: the panel, 3: its cells
        return max(sizes[i][k] for i in range(r * cols, min(n, (r + 1) * cols)))

    fig = plt.figure(figsize=(sum(widest(c, 0) for c in range(cols)), sum(tallest(r, 1) for r in range(rows_n)) + 0.5),
                     dpi=DPI, layout="constrained")
    # constrained layout shares out what its margins leave by these ratios: the cells' own inches
    grid = fig.add_gridspec(rows_n, cols, width_ratios=[widest(c, 2) for c in range(cols)],
                            height_ratios=[tallest(r, 3) for r in range(rows_n)])
    for i, (name, (table, step, seeds)) in enumerate(panels):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        heatmap_figure(table, f"{name}\n{table.get('kind', '')} at step {step}, mean of {count(seeds, 'seed')}", ax=ax)
        _readable(ax, table, sizes[i][0])
    fig.suptitle(title, fontsize=12)
    return fig


def _table_shape(table: dict) -> tuple[int, int, int, int]:
    """(sites, sources, longest site label, longest source label) of a weights table."""
    matrix = table["sites_by_sources"]
    sites, sources = len(matrix), max(len(r) for r in matrix)
    site_labels = table.get("site_labels") or [str(j + 1) for j in range(sites)]
    source_labels = table.get("source_labels") or [str(i) for i in range(sources)]
    return sites, sources, max(map(len, site_labels)), max(map(len, source_labels))


def _panel_inches(table: dict) -> tuple[float, float, float, float]:
    """(width, height) of a panel with its labels and colour bar, then of its cells alone, in inches."""
    sites, sources, site_chars, source_chars = _table_shape(table)
    width = 0.9 + CHAR * site_chars + CELL_W * sources + 1.5  # y label, tick labels, cells, colour bar and its label
    height = 1.1 + CELL_H * sites + 0.7 + (CHAR * source_chars if source_chars > 3 else 0.2)  # title, cells, x label
    return max(width, 3.2), max(height, 2.6), CELL_W * sources, CELL_H * sites


def _readable(ax: Any, table: dict, width: float) -> None:
    """Fonts readable at 100 % (ticks 8 pt, weights 7 pt, labels 9 pt, title 10 pt), long labels wrapped to the
    panel's size, so nothing runs past its panel."""
    import textwrap

    sites, sources, _, _ = _table_shape(table)
    ax.set_box_aspect(sites * CELL_H / (sources * CELL_W))  # cells of one shape in every panel, whatever its slot
    ax.tick_params(labelsize=8)
    for text in ax.texts:  # the weights printed in the cells
        text.set_fontsize(7)
    ax.set_xlabel(textwrap.fill(ax.get_xlabel(), max(24, int(CELL_W * sources / CHAR))), fontsize=9)
    ax.set_ylabel(textwrap.fill(ax.get_ylabel(), max(24, int(CELL_H * sites / CHAR))), fontsize=9)
    bar = ax.images[0].colorbar if ax.images else None
    if bar is not None:  # drawn again beside the axes' own box (the slot may be taller than the cells)
        label, extend = bar.ax.get_ylabel(), bar.extend
        bar.remove()
        bar = ax.figure.colorbar(ax.images[0], cax=ax.inset_axes((1.04, 0.0, max(0.04, 0.25 / (CELL_W * sources)), 1.0)),
                                 extend=extend)
        bar.set_label(textwrap.fill(label, max(12, int(CELL_H * sites / CHAR))), fontsize=9)
        bar.ax.tick_params(labelsize=8)
    lines = ax.get_title().split("\n")
    ax.set_title("\n".join(textwrap.fill(line, max(30, int((width - 1.5) / (CHAR * 1.1)))) for line in lines), fontsize=10)
