"""Hyper-Connections and mHC (Zhu et al. 2025; manifold-constrained HC; SPEC §9; `routing: hyper_connections`).

The residual stream becomes n streams H [n, d] per token, each starting as the embedding. Sublayer i reads a
mix of the streams, and every stream takes back a weighted copy of what it wrote:

    A   = A_static + dyn_A(H)        [n, 1 + n]: column 0 mixes the branch input, columns 1..n the new streams
    x   = sum_s A[s, 0] H[s]                        what sublayer i reads (then through the decoder's pre-norm)
    H'  = A[:, 1:]^T H                              the width connection
    H   = H' + beta (x) F(x)                        beta [n] = beta_static + dyn_beta(H): the depth connection
    the head reads sum_s H[s]

Initialisation and dynamic terms follow lucidrains/hyper-connections (`HyperConnections`, and
`ManifoldConstrainedHyperConnections` for mHC): A_static has a one in column 0 at stream (i - 1) mod n and the
identity in columns 1..n, beta_static = 1. With `dynamic: true` (default), from N(H) = RMSNorm(H) * g (g a
learned gain per sublayer, started at 1):
    HC    dyn_A = tanh(N(H) W_A) s_A,  dyn_beta = tanh(N(H) w_beta) s_beta   W_A, w_beta zero; s_A = s_beta = 0.01
    mHC   (`manifold: true`) A[:, 0] = sigmoid(A_static + N(H) W_A s_pre), A[:, 1:] = Sinkhorn-Knopp of
          exp(A_static + N(H) W_A s_res) (`sinkhorn_iters`, default 20, the column max subtracted first; the
          result doubly stochastic), beta = beta_static + 2 sigmoid(N(H) w_beta) s_post; s_pre = s_res = s_post = 0.01
So one stream with static coefficients is the plain residual stream exactly, and n HC streams start as n
equal copies of it (the head's RMSNorm sees n times the baseline's stream). mHC does not start as the
baseline (sigmoid(1) and sigmoid(0) in the read; exp(I) normalised in the width connection): as published.
The mixing computes in float32 (float64 for float64 models).

    params/sublayer = n (n + 1) + n [+ dynamic: d (n + 1) + d + d + 2 (mHC: 3)]
    FLOPs/token     = 2L (2 d n (n + 1) + 2 n d [+ dynamic: 2 n d (n + 2) + 4 n d]) + n d (the final sum)

Depth routing is per token: KV-cache decoding needs no cache of its own. AdamW takes every parameter of the
router (small coefficient tables, not matrices of the core). Diagnostics ("mixing"): a recording pass keeps
each read site's coefficients as one heatmap row of 2n + n^2 columns: the read A[:, 0] (n), the width
connection A[s, 1 + t] from stream s into stream t (n^2), and beta (n).

Shape legend: B batch, T tokens, n streams, D = d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.core.errors import config_error
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, RoutingKind

SCALE0 = 1e-2  # the public code's initial scales of the dynamic terms


def sinkhorn(log_alpha: Tensor, iters: int) -> Tensor:
    """Doubly stochastic matrices from log-weights [..., n, n] by alternate column / row normalisation."""
    alpha = (log_alpha - log_alpha.amax(dim=-2, keepdim=True).detach()).exp()
    for _ in range(iters):
        alpha = F.normalize(alpha, p=1, dim=-2)
        alpha = F.normalize(alpha, p=1, dim=-1)
    return alpha


@dataclass
class StreamsState:
    streams: Tensor  # H [B, T, n, D]
    pending: tuple[Tensor, Tensor] | None = None  # (H', beta) of the sublayer that just read
    weights: list[Tensor] | None = None  # recording: per read site, [read | width | beta] as [2n + n^2, B, T, 1]


class HyperConnectionsRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.options
        self.d, self.n, self.M = cfg.size.d_model, a.streams, cfg.size.n_sublayers
        self.dynamic, self.manifold, self.iters = a.dynamic, a.manifold, a.sinkhorn_iters
        n, d, M = self.n, self.d, self.M
        self.static_alpha = nn.Parameter(torch.empty(M, n, n + 1))
        self.static_beta = nn.Parameter(torch.empty(M, n))
        if self.dynamic:
            self.norm_gain = nn.Parameter(torch.empty(M, d))
            self.dynamic_alpha = nn.Parameter(torch.empty(M, d, n + 1))
            self.dynamic_beta = nn.Parameter(torch.empty(M, d))
            self.scales = nn.Parameter(torch.empty(M, 3 if self.manifold else 2))  # (alpha | pre, res), beta
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.static_alpha.zero_()
            for i in range(self.M):
                self.static_alpha[i, i % self.n, 0] = 1.0  # the read: stream (i - 1) mod n of sublayer i
                self.static_alpha[i, :, 1:] = torch.eye(self.n)
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.norm_gain.fill_(1.0)
                self.dynamic_alpha.zero_()
                self.dynamic_beta.zero_()
                self.scales.fill_(SCALE0)

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> StreamsState:
        return StreamsState(emb_BTD.unsqueeze(-2).expand(*emb_BTD.shape[:-1], self.n, self.d),
                            weights=[] if record else None)

    def _coefficients(self, H: Tensor, i: int) -> tuple[Tensor, Tensor]:
        """(A [B, T, n, 1 + n], beta [B, T, n]) of sublayer i + 1 for streams H (compute dtype)."""
        A, beta = self.static_alpha[i].to(H.dtype), self.static_beta[i].to(H.dtype)
        if not self.dynamic:
            if self.manifold:
                A = torch.cat((A[..., :1].sigmoid(), sinkhorn(A[..., 1:], self.iters)), dim=-1)
            return A.expand(*H.shape[:-2], *A.shape), beta.expand(H.shape[:-1])
        normed = F.rms_norm(H, (self.d,)) * self.norm_gain[i].to(H.dtype)
        wa, wb = normed @ self.dynamic_alpha[i].to(H.dtype), normed @ self.dynamic_beta[i].to(H.dtype)
        s = self.scales[i].to(H.dtype)
        if not self.manifold:
            return A + wa.tanh() * s[0], beta + wb.tanh() * s[1]
        pre = (A[..., :1] + wa[..., :1] * s[0]).sigmoid()
        res = sinkhorn(A[..., 1:] + wa[..., 1:] * s[1], self.iters)
        return torch.cat((pre, res), dim=-1), beta + 2 * wb.sigmoid() * s[2]

    def read(self, state: StreamsState, j: int) -> Tensor:
        dtype = state.streams.dtype
        if j == self.M:  # the head reads the sum of the streams
            return state.streams.sum(dim=-2)
        with torch.autocast(state.streams.device.type, enabled=False):
            H = state.streams.to(compute_dtype(dtype))
            A, beta = self._coefficients(H, j)
            mixed = A.transpose(-1, -2) @ H  # [B, T, 1 + n, D]
        state.pending = (mixed[..., 1:, :], beta)
        if state.weights is not None:  # [B, T, n + n^2 + n] -> [2n + n^2, B, T, 1]
            row = torch.cat((A[..., 0], A[..., 1:].flatten(-2), beta), dim=-1).detach().float()
            state.weights.append(row.movedim(-1, 0).unsqueeze(-1))
        return mixed[..., 0, :].to(dtype)

    def write(self, state: StreamsState, i: int, out_BTE: Tensor) -> None:
        H, beta = state.pending
        out = out_BTE[..., : self.d]
        state.streams = (H + beta.unsqueeze(-1) * out.to(H.dtype).unsqueeze(-2)).to(out.dtype)
        state.pending = None


@dataclass(frozen=True)
class HyperConnectionsOptions(KindOptions):
    streams: int = 4  # n
    dynamic: bool = True  # input-dependent coefficients (tanh(RMSNorm(H) W) s terms, s = 0 at init)
    manifold: bool = False  # mHC: Sinkhorn-Knopp doubly stochastic mixing, sigmoid pre / 2 sigmoid post maps
    sinkhorn_iters: int = 20

    def validate(self, where: str) -> None:
        for option in ("streams", "sinkhorn_iters"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(where, option, f"must be a positive integer, got {value!r}")
        for option in ("dynamic", "manifold"):
            if not isinstance(getattr(self, option), bool):
                raise config_error(where, option, f"must be true or false, got {getattr(self, option)!r}")


class HyperConnectionsKind(RoutingKind):
    name = "hyper_connections"
    Options = HyperConnectionsOptions
    diagnostics = "mixing"

    def diagnostic_axes(self, cfg: ModelConfig) -> dict:
        n = cfg.options.streams
        return {"site_labels": [str(j) for j in range(cfg.size.n_sublayers)],
                "source_labels": ([f"read {s}" for s in range(n)] + [f"{s}→{t}" for s in range(n) for t in range(n)]
                                  + [f"β {s}" for s in range(n)]),
                "site_axis": "read site j (feeds sublayer j + 1)",
                "source_axis": "coefficient: read A[s, 0]; width s→t A[s, 1 + t]; depth β[s]",
                "value": "mean coefficient", "embedding_column": None}

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return HyperConnectionsRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        a, d = cfg.options, cfg.size.d_model
        n = a.streams
        per = n * (n + 1) + n + ((d * (n + 1) + 2 * d + (3 if a.manifold else 2)) if a.dynamic else 0)
        return cfg.size.n_sublayers * per

    def added_flops(self, cfg: ModelConfig) -> int:
        a, d = cfg.options, cfg.size.d_model
        n = a.streams
        per = 2 * d * n * (n + 1) + 2 * n * d + ((2 * n * d * (n + 2) + 4 * n * d) if a.dynamic else 0)
        return cfg.size.n_sublayers * per + n * d

    def adamw_names(self, router: nn.Module) -> None:
        return None


KIND = HyperConnectionsKind()
