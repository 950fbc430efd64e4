"""Routing diagnostics computed from the forward pass's own weights (not a re-derivation).

For read site j with weights alpha [S_j, B, T, M] (sources: embedding first, then later outputs
or block summaries in order):
    entropy      H = -sum_i alpha_i log alpha_i, normalised by log S_j   (1 = uniform)
    eff_sources  exp(H)                                                 (effective number of sources)
    top1         max_i alpha_i                                          (mass on the favourite)
    embedding    alpha_0                                                (weight of the token embedding)
each averaged over batch, tokens and depth heads.

The gated residual (routing: gated) records at site i the two-source weights [alpha_i, 1 - alpha_i]
of its write y = alpha_i x + (1 - alpha_i) F(x); its statistics per site are
    alpha        mean alpha_i over batch and tokens (the weight kept on the incoming stream)
    saturated    the fraction of tokens with alpha_i < 0.01 or > 0.99
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

STATS = ("entropy", "eff_sources", "top1", "embedding")
GATE_STATS = ("alpha", "saturated")
SATURATION = 0.01


def site_stats(weights: list[Tensor]) -> list[dict[str, float]]:
    """One dict of STATS per read site j = 1..2L."""
    out = []
    for alpha_SBTM in weights:
        a = alpha_SBTM.double().clamp_min(1e-30)
        S = a.shape[0]
        entropy_BTM = -(a * a.log()).sum(0)
        out.append({
            "entropy": float((entropy_BTM / math.log(S)).mean()) if S > 1 else 0.0,
            "eff_sources": float(entropy_BTM.exp().mean()),
            "top1": float(a.max(0).values.mean()),
            "embedding": float(a[0].mean()),
        })
    return out


def mean_weights(weights: list[Tensor]) -> list[list[float]]:
    """Mean alpha per site and source: a ragged sites x sources matrix (row j-1 has S_j entries)."""
    return [alpha.float().mean(dim=(1, 2, 3)).tolist() for alpha in weights]


def heatmap_figure(matrix: list[list[float]], title: str):
    """Sites x sources heatmap (matplotlib Figure); empty cells where a site has fewer sources."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_sites, n_src = len(matrix), max(len(row) for row in matrix)
    grid = torch.full((n_sites, n_src), float("nan"))
    for j, row in enumerate(matrix):
        grid[j, : len(row)] = torch.tensor(row)
    fig, ax = plt.subplots(figsize=(1.2 + 0.35 * n_src, 1.2 + 0.3 * n_sites), dpi=110)
    im = ax.imshow(grid.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xlabel("source (0 = embedding)")
    ax.set_ylabel("read site j")
    ax.set_yticks(range(n_sites), [str(j + 1) for j in range(n_sites)], fontsize=7)
    ax.set_xticks(range(n_src), [str(i) for i in range(n_src)], fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="mean routing weight")
    fig.tight_layout()
    return fig


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
