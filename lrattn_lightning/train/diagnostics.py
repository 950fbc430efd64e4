"""Routing diagnostics computed from the forward pass's own weights (not a re-derivation).

Every routing kind that records (train/routing_axes.py: what its weights are) hands over one tensor [S, B, T, m] per
heatmap row (S sources; B, T, m may be 1); `weights_table` averages each over batch, tokens and depth heads into the
ragged rows x sources matrix of routing/weights.json, with the kind's labels (routing_axes.axes):

    {"step": N, "kind": ..., "sites_by_sources": [[...], ...], "site_labels": [...], "source_labels": [...],
     "site_axis": ..., "source_axis": ..., "value": ...}           (a cell the kind leaves empty: null)

`heatmap_figure` draws it (compare draws the same file). For a softmax read over sources
("depth_weights": AttnRes, Delta AttnRes), read site j with weights alpha [S_j, B, T, M] has
    entropy      H = -sum_i alpha_i log alpha_i, normalised by log S_j   (1 = uniform)
    eff_sources  exp(H)                                                 (effective number of sources)
    top1         max_i alpha_i                                          (mass on the favourite)
    embedding    alpha_e                                                (weight of the token embedding)
each averaged over batch, tokens and depth heads. Real mixing weights ("mixing": DenseFormer's alpha, the
hyper-connections' coefficients, an own router's) have no such statistics: the table is all.

The gated residual (routing: gated) records at site i the two-source weights [alpha_i, 1 - alpha_i]
of its write y = alpha_i x + (1 - alpha_i) F(x); its statistics per site are
    alpha        mean alpha_i over batch and tokens (the weight kept on the incoming stream)
    saturated    the fraction of tokens with alpha_i < 0.01 or > 0.99
"""

from __future__ import annotations

import math

from torch import Tensor

from lrattn_lightning.train import routing_axes

STATS = ("entropy", "eff_sources", "top1", "embedding")
GATE_STATS = ("alpha", "saturated")
SATURATION = 0.01


def site_stats(weights: list[Tensor], embedding_column: int = 0) -> list[dict[str, float]]:
    """One dict of STATS per read site."""
    out = []
    for alpha_SBTM in weights:
        a = alpha_SBTM.double().clamp_min(1e-30)
        S = a.shape[0]
        entropy_BTM = -(a * a.log()).sum(0)
        out.append({
            "entropy": float((entropy_BTM / math.log(S)).mean()) if S > 1 else 0.0,
            "eff_sources": float(entropy_BTM.exp().mean()),
            "top1": float(a.max(0).values.mean()),
            "embedding": float(a[embedding_column].mean()) if S > embedding_column else 0.0,
        })
    return out


def mean_stats(cfg, weights: list[Tensor]) -> dict[str, float]:
    """The statistics averaged over sites, as the routing/mean/<stat> metrics ({} for mixing weights)."""
    kind = routing_axes.recorded(cfg)
    if kind == "gates":
        stats, names = gate_stats(weights), GATE_STATS
    elif kind == "depth_weights":
        stats, names = site_stats(weights, routing_axes.axes(cfg)["embedding_column"]), STATS
    else:
        return {}
    return {name: sum(r[name] for r in stats) / len(stats) for name in names} if stats else {}


def mean_weights(weights: list[Tensor]) -> list[list[float | None]]:
    """Mean weight per row and source over everything else: a ragged rows x sources matrix (None: no source)."""
    rows = []
    for w in weights:
        w = w.detach().float()
        values = (w.reshape(w.shape[0], -1).mean(1) if w.dim() > 1 else w).tolist()
        rows.append([None if not math.isfinite(v) else v for v in values])
    return rows


def weights_table(cfg, weights: list[Tensor]) -> dict:
    """routing/weights.json's content (without the step): the matrix and the kind's labels."""
    axes = {k: v for k, v in routing_axes.axes(cfg).items() if k != "embedding_column"}
    matrix = mean_weights(weights)
    if axes.get("site_labels") is not None and len(axes["site_labels"]) != len(matrix):
        axes["site_labels"] = None  # (a router recording other rows than its kind says: numbered instead)
    width = max((len(r) for r in matrix), default=0)
    if axes.get("source_labels") is not None and len(axes["source_labels"]) < width:
        axes["source_labels"] = None
    return {"kind": cfg.kind.name, "sites_by_sources": matrix, **axes}


def heatmap_figure(table: dict, title: str, ax=None):
    """The rows x sources heatmap of a weights table (matplotlib Figure; or drawn into `ax`): weights in [0, 1]
    on viridis from 0 to 1, any others (negative, above 1) on a diverging scale centred at 0; empty cells
    where a row has fewer sources (or the kind leaves one out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    matrix = table["sites_by_sources"]
    n_sites, n_src = len(matrix), max(len(row) for row in matrix)
    grid = np.full((n_sites, n_src), np.nan)
    for j, row in enumerate(matrix):
        grid[j, : len(row)] = [np.nan if v is None else v for v in row]
    fig = None
    if ax is None:
        # constrained layout makes room for the tick labels, the title and the colour bar's label inside the
        # canvas (tight_layout gave up on these small figures: "Tight layout not applied", everything clipped);
        # the size leaves the cells their room beside that furniture, and the title its width
        width = max(3.4 + 0.38 * n_src, 1.0 + 0.075 * len(title))
        fig, ax = plt.subplots(figsize=(width, 2.4 + 0.3 * n_sites), dpi=110, layout="constrained")
    finite = grid[np.isfinite(grid)]
    unit = finite.size == 0 or (finite.min() >= 0 and finite.max() <= 1)
    limit = 1.0 if unit else max(float(np.abs(finite).max()), 1e-12)
    clipped = False
    if not unit and finite.size >= 8:  # a few huge coefficients would wash every other cell out to white
        typical = float(np.quantile(np.abs(finite), 0.9))
        if limit > 4 * typical > 0:
            limit, clipped = typical, True
    im = ax.imshow(grid, cmap="viridis" if unit else "RdBu_r", vmin=0.0 if unit else -limit, vmax=limit,
                   aspect="auto", interpolation="nearest")
    sites = table.get("site_labels") or [str(j + 1) for j in range(n_sites)]
    sources = table.get("source_labels") or [str(i) for i in range(n_src)]
    x_label, y_label = table.get("source_axis") or "source (0 = embedding)", table.get("site_axis") or "read site j"
    if fig is not None:  # its own figure: long axis labels wrapped to the figure's sides (7 pt: ~0.055 in a char)
        inches = fig.get_size_inches()
        x_label, y_label = _wrap(x_label, inches[0] - 1.0, 0.055), _wrap(y_label, inches[1] - 1.2, 0.055)
    ax.set_xlabel(x_label, fontsize=7)
    ax.set_ylabel(y_label, fontsize=7)
    ax.set_yticks(range(n_sites), sites[:n_sites], fontsize=6)
    ax.set_xticks(range(n_src), sources[:n_src], fontsize=6, rotation=90 if max(map(len, sources)) > 3 else 0)
    if grid.size <= 400:  # small enough to print the weights themselves
        for (j, i), value in np.ndenumerate(grid):
            if np.isfinite(value):
                dark = (value > 0.55) if unit else abs(value) > 0.6 * limit
                ax.text(i, j, f"{value:.2f}", ha="center", va="center", fontsize=5,
                        color=("black" if unit else "white") if dark else ("white" if unit else "black"))
    ax.set_title(title, fontsize=9)
    label = table.get("value") or "mean routing weight"
    if clipped:  # the colours saturate at the 90th percentile of |value|; the printed numbers are exact
        label += f" (colour clipped at ±{limit:.3g})"
    if fig is not None:  # the bar's label along its ~0.85 of the axes' height (10 pt: ~0.07 in a char)
        label = _wrap(label, 0.85 * (fig.get_size_inches()[1] - 1.0), 0.07)
    (fig or ax.figure).colorbar(im, ax=ax, label=label, shrink=0.85, extend="both" if clipped else "neither")
    return fig or ax.figure


def _wrap(text: str, inches: float, per_char: float) -> str:
    """`text` broken into lines of at most `inches` (each character ~`per_char` inches), at spaces."""
    import textwrap

    return "\n".join(textwrap.wrap(text, max(12, int(inches / per_char)))) or text


def gate_stats(weights: list[Tensor]) -> list[dict[str, float]]:
    """One dict of GATE_STATS per sublayer i = 1..2L, from the gated residual's [2, B, T, 1] weights."""
    out = []
    for w in weights:
        alpha = w[0].double()
        out.append({
            "alpha": float(alpha.mean()),
            "saturated": float(((alpha < SATURATION) | (alpha > 1 - SATURATION)).double().mean()),
        })
    return out


def gate_figure(curves: dict[str, list[float]], title: str, initial: list[float] | None = None,
                spread: dict[str, tuple[list[float], list[float]]] | None = None):
    """Mean alpha against sublayer, one line per label (matplotlib Figure); `initial`: the alpha0 dashed,
    `spread`: label -> (low, high) per sublayer, drawn as a band. The plain residual's i/(i+1) is dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(c) for c in curves.values())
    sub = list(range(1, n + 1))
    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    ax.plot(sub, [i / (i + 1) for i in sub], ":", color="0.5", lw=1, label="i/(i+1): the plain residual stream")
    ax.axhline(0.5, color="0.8", lw=0.8)
    if initial is not None:
        ax.plot(sub, initial, "--", color="0.3", lw=1, label="alpha at initialisation")
    for label, alphas in curves.items():
        line, = ax.plot(sub[: len(alphas)], alphas, "o-", ms=3.5, lw=1.3, label=label)
        if spread and label in spread:
            lo, hi = spread[label]
            ax.fill_between(sub[: len(lo)], lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xlabel("sublayer i (odd: attention, even: MLP)")
    ax.set_ylabel("mean alpha_i (weight kept on the stream)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(sub)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
