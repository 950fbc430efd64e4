"""The figure of `lrattn compare`'s compute multipliers (scaling.py): validation loss against training compute
(log x), one colour per method, every run a small dot, the mean over seeds of each size a ring, the fitted law a
line, and beside the axes the multiplier table (k, its interval). When the multipliers are refused the curves and
the table are not drawn: the table's place says why. Written as scaling.png and scaling.svg.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.tools.compare.figures import save_figure
from lrattn_lightning.tools.compare.scaling import LEVEL, Scaling


def plot_scaling(result: Scaling, out: Path, title: str) -> list[Path]:
    return save_figure(scaling_figure(result, title), out, "scaling")


def scaling_figure(result: Scaling, title: str) -> Any:
    """The figure, drawn (module doc)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, side) = plt.subplots(1, 2, figsize=(12.5, 5.2), gridspec_kw={"width_ratios": [3, 2]})
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
                ls="none" if result.fit else ":", color=colors[m], label=m)
        if result.fit is not None:
            grid = np.geomspace(min(computes) / 1.5, max(computes) * 1.5, 200)
            ax.plot(grid, result.fit.predict(m, grid), "-", lw=1.4, color=colors[m])
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs: 3 × forward FLOPs per token × tokens)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(3, len(methods)), frameon=False, fontsize=8)
    _side(side, result, colors)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _side(ax: Any, result: Scaling, colors: dict[str, Any]) -> None:
    """The multiplier table, or the one line that refuses it."""
    ax.axis("off")
    if result.refusal:
        text = "No compute multipliers:\n" + "\n".join(textwrap.wrap(result.refusal, 48))
        ax.text(0.0, 0.9, text, va="top", ha="left", fontsize=9, transform=ax.transAxes)
        return
    fit = result.fit
    head = ["method", "k", f"{100 * LEVEL:g} % interval", "α"]
    cells = [[m, f"{result.k[m]:.3f}",
              f"{result.low[m]:.3f} – {result.high[m]:.3f}" if m in result.low else "—", f"{fit.alpha[m]:.3f}"]
             for m in result.methods]
    table = ax.table(cellText=cells, colLabels=head, loc="upper center", cellLoc="center", colLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.scale(1.0, 1.35)
    for i, m in enumerate(result.methods, start=1):
        table[i, 0].get_text().set_color(colors[m])
    where = "" if result.shared else f" (read at C = {result.at:.3g})"
    ax.set_title(f"compute multiplier k against {result.reference}{where}\n"
                 f"L = E + A_m C^-α, E = {fit.E:.3f}", fontsize=9)
