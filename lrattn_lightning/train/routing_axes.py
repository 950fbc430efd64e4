"""What each routing kind's recorded weights are, keyed by the kind's name: which statistics apply to them and the
rows and columns of its heatmap (train/diagnostics.py reads it; routing/weights.json carries the labels).

    RECORDED[kind]   None: the kind records nothing (the plain residual stream has no routing weights), else
                     Recorded(weights, axes) with `weights` one of
        depth_weights   a softmax over sources per read site, alpha [S_j, B, T, m] (AttnRes, Delta AttnRes):
                        entropy, effective sources, top-1, embedding weight (diagnostics.site_stats)
        gates           the gated residual's [alpha_i, 1 - alpha_i] per sublayer (diagnostics.gate_stats)
        mixing          any real mixing weights (DenseFormer's, the hyper-connections' coefficients, an own
                        router's): the table is all
                     and `axes(cfg)` the labels: `site_labels` (one per row; None: 1, 2, ...), `source_labels` (one
                     per column; None: 0, 1, ...), `site_axis`, `source_axis`, `value` (what a cell is) and
                     `embedding_column` (the embedding's column, for the `embedding` statistic of a softmax read)
Every kind in model/routing/kinds.py KINDS has an entry (tests/model/routing/test_kinds.py holds the table to it):
a kind whose routers record weights says what they are here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.delta_attnres import block_layers, read_sources
from lrattn_lightning.model.routing.denseformer import averaged_layers
from lrattn_lightning.model.routing.muddformer import WAYS, ways


@dataclass(frozen=True)
class Recorded:
    weights: Literal["depth_weights", "gates", "mixing"]
    axes: Callable[[ModelConfig], dict[str, Any]]


def attnres_axes(cfg: ModelConfig) -> dict[str, Any]:
    return {"site_labels": None, "source_labels": None, "site_axis": "read site j (feeds sublayer j + 1; 2L: the head)",
            "source_axis": "source (0 = embedding, then the later outputs or block summaries)",
            "value": "mean routing weight", "embedding_column": 0}


def gated_axes(cfg: ModelConfig) -> dict[str, Any]:
    return {"site_labels": [str(i) for i in range(1, cfg.size.n_sublayers + 1)],
            "source_labels": ["stream: α", "F(x): 1 - α"], "site_axis": "sublayer i (its gated write)",
            "source_axis": "source of y = α x + (1 - α) F(x)", "value": "mean weight", "embedding_column": None}


def external_axes(cfg: ModelConfig) -> dict[str, Any]:
    """Whatever a recording state's `weights` hold (docs/extending.md: the contract)."""
    return {"site_labels": None, "source_labels": None, "site_axis": "row of the router's state.weights",
            "source_axis": f"source, as {cfg.options.router} orders them", "value": "mean weight",
            "embedding_column": None}


def denseformer_axes(cfg: ModelConfig) -> dict[str, Any]:
    return {"site_labels": [f"after layer {t}" for t in averaged_layers(cfg)], "source_labels": None,
            "site_axis": "DWA (its average is what the next layer and the head read)",
            "source_axis": "source x_s (0 = embedding, s = layer s's output)", "value": "weight w_{t,s}",
            "embedding_column": 0}


def delta_attnres_axes(cfg: ModelConfig) -> dict[str, Any]:
    null = cfg.options.null_source
    first = 0 if null else 1
    if cfg.options.mode == "delta":
        labels = [str(i) for i in range(max(read_sources(cfg)) - int(null))]
        axis = "0 = embedding, i = sublayer i's output"
    else:
        labels, axis = _block_labels(cfg), "x0 = embedding, Bk = the outputs of block k's layers (L = layers)"
    return {"site_labels": [str(j) for j in range(first, cfg.size.n_sublayers)],
            "source_labels": (["null"] if null else []) + labels,
            "site_axis": "read site j (its read is added to the stream sublayer j + 1 sees)",
            "source_axis": f"source (null: the learned zero source; {axis})",
            "value": "mean softmax weight", "embedding_column": 1 if null else 0}


def _block_labels(cfg: ModelConfig) -> list[str]:
    """Delta AttnRes's b_0 .. b_{K-1} by what they hold: x0, then B_k (layers), + B_{k-2} + ... for the recursive
    sources."""
    P, L = block_layers(cfg), cfg.size.n_layers
    names = ["x0"] + [f"B{k}" for k in range(1, math.ceil(L / P))]
    labels = ["x0"]
    for k in range(1, len(names)):
        held = names[k::-2] if cfg.options.block_sources == "recursive" else names[k:k + 1]
        layers = f"L{k - 1}" if P == 1 else f"L{(k - 1) * P}-{k * P - 1}"
        labels.append(f"{held[0]} ({layers})" + "".join(f" + {n}" for n in held[1:]))
    return labels


def hyper_connections_axes(cfg: ModelConfig) -> dict[str, Any]:
    n, m = cfg.options.streams, cfg.options.fractions
    slots = [str(s) if m == 1 else (f"{s}.{k}" if n > 1 else str(k)) for s in range(n) for k in range(m)]
    reads = [f"read {a}" for a in slots] if m == 1 else [f"read {a}→{k}" for a in slots for k in range(m)]
    source_axis = ("coefficient: read A[s, 0]; width s→t A[s, 1 + t]; depth β[s]" if m == 1 else
                   "coefficient: read i→k Y[i, k] (into the input's fraction k); width i→k A_r[i, k]; depth β[k]"
                   + ("; slots stream.fraction" if n > 1 else "; i, k fractions"))
    return {"site_labels": [str(j) for j in range(cfg.size.n_sublayers)],
            "source_labels": reads + [f"{a}→{b}" for a in slots for b in slots] + [f"β {a}" for a in slots],
            "site_axis": "read site j (feeds sublayer j + 1)", "source_axis": source_axis,
            "value": "mean coefficient", "embedding_column": None}


def muddformer_axes(cfg: ModelConfig) -> dict[str, Any]:
    labels = [f"after layer {i}: {WAYS[c] if C == 4 else 'R'}" for i, C in enumerate(ways(cfg), 1) for c in range(C)]
    return {"site_labels": labels, "source_labels": None,
            "site_axis": "dense aggregation after layer i, per stream (Q, K, V: the next attention's inputs; "
                         "R: what it adds to, after the last layer the output)",
            "source_axis": "source X_j (0 = embedding, j = layer j's output; ppn: RMSNorm(X_j) g_j)",
            "value": "mean DA weight w_i[c, j]", "embedding_column": 0}


def value_residual_axes(cfg: ModelConfig) -> dict[str, Any]:
    return {"site_labels": [f"layer {n}" for n in range(2, cfg.size.n_layers + 1)],
            "source_labels": ["V_1 (layer 1's values)", "own values"],
            "site_axis": "layer n whose attention mixes its values", "source_axis": "values mixed",
            "value": "weight (lambda_n, 1 - lambda_n)", "embedding_column": None}


def laurel_axes(cfg: ModelConfig) -> dict[str, Any]:
    mode = cfg.options.mode
    rw, lr = mode in ("rw", "rw_lr"), mode in ("lr", "rw_lr")
    sources = (["a (f)", "b (skip)"] if rw else []) + (["|xAB|/|x|"] if lr else [])
    return {"site_labels": [f"{i} {'attn' if i % 2 else 'mlp'}" for i in range(1, cfg.size.n_sublayers + 1)],
            "source_labels": sources, "site_axis": "sublayer i (its write x' = a f + b (x + x A B))",
            "source_axis": "a: weight of the sublayer's output f; b: of the skip path; |xAB|/|x|: the low-rank "
                           "term's size relative to the stream",
            "value": "mean over tokens", "embedding_column": None}


RECORDED: dict[str, Recorded | None] = {
    "residual": None,
    "attnres": Recorded("depth_weights", attnres_axes),
    "gated": Recorded("gates", gated_axes),
    "external": Recorded("mixing", external_axes),
    "denseformer": Recorded("mixing", denseformer_axes),
    "delta_attnres": Recorded("depth_weights", delta_attnres_axes),
    "hyper_connections": Recorded("mixing", hyper_connections_axes),
    "muddformer": Recorded("mixing", muddformer_axes),
    "value_residual": Recorded("mixing", value_residual_axes),
    "laurel": Recorded("mixing", laurel_axes),
}


def recorded(cfg: ModelConfig) -> str | None:
    """What cfg's routers record: "depth_weights", "gates", "mixing", or None (nothing)."""
    entry = RECORDED[cfg.kind.name]
    return None if entry is None else entry.weights


def axes(cfg: ModelConfig) -> dict[str, Any]:
    """The rows and columns of cfg's recorded weights (module docstring)."""
    return RECORDED[cfg.kind.name].axes(cfg)
