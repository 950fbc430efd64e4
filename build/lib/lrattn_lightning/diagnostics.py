"""Routing diagnostics computed from the forward pass's own weights (not a re-derivation).

For read site j with weights alpha [S_j, B, T, M] (sources: embedding first, then later outputs
or block summaries in order):
    entropy      H = -sum_i alpha_i log alpha_i, normalised by log S_j   (1 = uniform)
    eff_sources  exp(H)                                                 (effective number of sources)
    top1         max_i alpha_i                                          (mass on the favourite)
    embedding    alpha_0                                                (weight of the token embedding)
each averaged over batch, tokens and depth heads.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

STATS = ("entropy", "eff_sources", "top1", "embedding")


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
