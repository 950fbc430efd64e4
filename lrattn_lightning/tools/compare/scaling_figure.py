"""The figure of `lrattn compare`'s compute multipliers (scaling.py, scaling_local.py), two panels side by side:

    left    validation loss against training compute (log x), one colour per method, every run a small dot, the
            mean over seeds of each size a ring, the fitted law a line; each legend entry carries the method's
            multiplier k and its interval (when the multipliers are refused, the axes' title says why)
    right   the per-size multipliers read off the reference's own ladder (scaling_local.py): k at each size,
            sizes in ladder order, its interval as a bar, a hollow marker where the reading is extrapolated
            beyond the reference's ladder; k = 1 (the reference) a dotted line

Written as scaling.png and scaling.svg.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from lrattn_lightning.tools.compare.figures import save_figure
from lrattn_lightning.tools.compare.scaling import LEVEL, Scaling
from lrattn_lightning.tools.compare.scaling_local import LocalMultiplier
from lrattn_lightning.tools.compare.words import ladder


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
    order = list(dict.fromkeys(r.size for r in rows))  # scaling_local gives them in the ladder's order
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
