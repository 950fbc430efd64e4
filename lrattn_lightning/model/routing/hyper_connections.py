"""Hyper-Connections, mHC and Frac-Connections (Zhu et al. 2025; manifold-constrained HC; Zhu et al., arXiv
2503.14125; docs/method.md §9-10; `routing: hyper_connections`).

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

Frac-Connections (`fractions: m`, default 1 = the above unchanged): each stream's d channels are m fractions of
width e = d/m, so the streams hold N = n m slots H_a [e] (slot a = s m + k: fraction k of stream s). Per sublayer
A = [Y | A_r] is [N, m + N] and beta [N]:
    x    = concat_k sum_a Y[a, k] H_a              the read: m fractions of the input
    H'_b = sum_a A_r[a, b] H_a + beta_b y_k(b)     y = F(x) split alike; slot b = (s, k) takes fraction k of y
    Y    = one at (slot k of stream (i - 1) mod n, k), A_r = I, beta = 1, and the dynamic terms per slot as HC's
           (N(H_a) over e channels; g, W_A [e, m + N], w_beta [e] shared by the slots; scales s_A, s_beta)
With n = 1 this is FracConnection of wdlctc/hyper-connection-factory (`hyper.py`, docs/method.md §10's code), whose defaults
the registry's `frac-connections-m2` takes: m = 2, dynamic, N = LayerNorm with gain and bias (eps 1e-5;
`norm: layer`, flat `hc_norm`; `rms`, the default, keeps HC's RMSNorm * g), scalar scales 0.01, Y = A_r = I: the baseline
exactly at init. The factory has no streams x fractions; lucidrains' `num_fracs` has, and that generalisation is
offered here (n streams x m fractions, each stream read as HC's stream (i - 1) mod n, every slot its own row),
but its layout is not followed: there beta is an [m, m] matrix per stream (all ones: every fraction of the
stream takes the sum of the output's fractions) and its Y at init reads fraction 0 into every input fraction,
so its Frac does not start as the baseline. mHC has no fractions in either code: manifold with fractions > 1
is refused.

    params/sublayer = N (m + N) + N [+ dynamic: e (m + N) + e + e (LayerNorm: 2 e) + 2 (mHC: 3)]
    FLOPs/token     = 2L (2 n d (m + N) + 2 n d [+ dynamic: 2 n d (m + N + 1) + c n d]) + n d (the final sum)
                      c = 4 (RMSNorm * g) or 7 (LayerNorm: mean and centring, bias); m = 1: N = n, e = d, HC's
                      n (n + 1) + n [+ d (n + 1) + 2 d + 2] and 2 d n (n + 1) + 2 n d [+ 2 n d (n + 2) + 4 n d]

Depth routing is per token: KV-cache decoding needs no cache of its own. AdamW takes every parameter of the
router (small coefficient tables, not matrices of the core). Diagnostics ("mixing"): a recording pass keeps
each read site's coefficients as one heatmap row of N m + N^2 + N columns: the read (HC: A[:, 0], n; Frac:
Y[a, k], slot a into the input's fraction k), the width connection A_r[a, b] from slot a into slot b (N^2),
and beta (N).

Shape legend: B batch, T tokens, n streams, m fractions, N = n m slots, e = D / m, D = d_model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig, SizeConfig
from lrattn_lightning.model.options import PositiveInt
from lrattn_lightning.model.routing._math import autocast_off, compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router

SCALE0 = 1e-2  # the public code's initial scales of the dynamic terms
Norm = Literal["rms", "layer"]


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
    pending: tuple[Tensor, Tensor] | None = None  # (H' [B, T, N, e], beta [B, T, N]) of the sublayer that just read
    weights: list[Tensor] | None = None  # recording: per read site, [read | width | beta] as [C, B, T, 1]


class HyperConnectionsRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.options
        self.d, self.n, self.m, self.M = cfg.size.d_model, a.streams, a.fractions, cfg.size.n_sublayers
        self.e, self.N = self.d // self.m, self.n * self.m  # fraction width, slots (stream s, fraction k)
        self.dynamic, self.manifold, self.iters = a.dynamic, a.manifold, a.sinkhorn_iters
        self.layer_norm = a.norm == "layer"
        m, N, e, M = self.m, self.N, self.e, self.M
        self.static_alpha = nn.Parameter(torch.empty(M, N, m + N))
        self.static_beta = nn.Parameter(torch.empty(M, N))
        if self.dynamic:
            self.norm_gain = nn.Parameter(torch.empty(M, e))
            if self.layer_norm:
                self.norm_bias = nn.Parameter(torch.empty(M, e))
            self.dynamic_alpha = nn.Parameter(torch.empty(M, e, m + N))
            self.dynamic_beta = nn.Parameter(torch.empty(M, e))
            self.scales = nn.Parameter(torch.empty(M, 3 if self.manifold else 2))  # (alpha | pre, res), beta
        self.reset_parameters()

    def reset_parameters(self) -> None:
        m = self.m
        with torch.no_grad():
            self.static_alpha.zero_()
            for i in range(self.M):
                for k in range(m):  # the read Y: fraction k of stream (i - 1) mod n of sublayer i, into fraction k
                    self.static_alpha[i, (i % self.n) * m + k, k] = 1.0
                self.static_alpha[i, :, m:] = torch.eye(self.N)
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.norm_gain.fill_(1.0)
                if self.layer_norm:
                    self.norm_bias.zero_()
                self.dynamic_alpha.zero_()
                self.dynamic_beta.zero_()
                self.scales.fill_(SCALE0)

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> StreamsState:
        return StreamsState(emb_BTD.unsqueeze(-2).expand(*emb_BTD.shape[:-1], self.n, self.d),
                            weights=[] if record else None)

    def _norm(self, H: Tensor, i: int) -> Tensor:
        """N(H) per slot over its e channels: RMSNorm * g, or LayerNorm (g, b; eps 1e-5) with `norm: layer`."""
        gain = self.norm_gain[i].to(H.dtype)
        if self.layer_norm:
            return F.layer_norm(H, (self.e,), gain, self.norm_bias[i].to(H.dtype), eps=1e-5)
        return F.rms_norm(H, (self.e,)) * gain

    def _coefficients(self, H: Tensor, i: int) -> tuple[Tensor, Tensor]:
        """(A [B, T, N, m + N], beta [B, T, N]) of sublayer i + 1 for slots H [B, T, N, e] (compute dtype)."""
        A, beta, m = self.static_alpha[i].to(H.dtype), self.static_beta[i].to(H.dtype), self.m
        if not self.dynamic:
            if self.manifold:
                A = torch.cat((A[..., :1].sigmoid(), sinkhorn(A[..., 1:], self.iters)), dim=-1)
            return A.expand(*H.shape[:-2], *A.shape), beta.expand(H.shape[:-1])
        normed = self._norm(H, i)
        wa, wb = normed @ self.dynamic_alpha[i].to(H.dtype), normed @ self.dynamic_beta[i].to(H.dtype)
        s = self.scales[i].to(H.dtype)
        if not self.manifold:
            return A + wa.tanh() * s[0], beta + wb.tanh() * s[1]
        pre = (A[..., :m] + wa[..., :m] * s[0]).sigmoid()  # mHC: m = 1 (validated)
        res = sinkhorn(A[..., m:] + wa[..., m:] * s[1], self.iters)
        return torch.cat((pre, res), dim=-1), beta + 2 * wb.sigmoid() * s[2]

    def read(self, state: StreamsState, j: int) -> Tensor:
        dtype, m = state.streams.dtype, self.m
        if j == self.M:  # the head reads the sum of the streams
            return state.streams.sum(dim=-2)
        with autocast_off(state.streams.device):
            H = state.streams.to(compute_dtype(dtype))
            if m > 1:  # [B, T, n, D] -> slots [B, T, n m, e], slot s m + k = fraction k of stream s
                H = H.unflatten(-1, (m, self.e)).flatten(-3, -2)
            A, beta = self._coefficients(H, j)
            mixed = A.transpose(-1, -2) @ H  # [B, T, m + N, e]: the read's m fractions, then the N new slots
        state.pending = (mixed[..., m:, :], beta)
        if state.weights is not None:  # [B, T, N m + N^2 + N] -> [N m + N^2 + N, B, T, 1]
            row = torch.cat((A[..., :m].flatten(-2), A[..., m:].flatten(-2), beta), dim=-1).detach().float()
            state.weights.append(row.movedim(-1, 0).unsqueeze(-1))
        return mixed[..., :m, :].flatten(-2).to(dtype)  # concat over k of sum_i Y[i, k] H_i

    def write(self, state: StreamsState, i: int, out_BTE: Tensor) -> None:
        H, beta = state.pending
        out = out_BTE[..., : self.d].to(H.dtype)
        if self.m == 1:
            H = H + beta.unsqueeze(-1) * out.unsqueeze(-2)
        else:  # slot (s, k) takes back beta[s, k] times fraction k of the output
            H = H.unflatten(-2, (self.n, self.m)) + beta.unflatten(-1, (self.n, self.m)).unsqueeze(-1) \
                * out.unflatten(-1, (self.m, self.e)).unsqueeze(-3)
            H = H.flatten(-2)
        state.streams = H.to(out_BTE.dtype)
        state.pending = None


@dataclass(frozen=True)
class HyperConnectionsOptions(KindOptions):
    """`hyper_connections: {streams: 1, fractions: 2, norm: layer}` (flat: the same names, hc_norm)."""

    flat_names: ClassVar[dict[str, str]] = {"norm": "hc_norm"}
    streams: PositiveInt = 4  # n
    dynamic: bool = True  # input-dependent coefficients (tanh(N(H) W) s terms, W = 0 at init)
    manifold: bool = False  # mHC: Sinkhorn-Knopp doubly stochastic mixing, sigmoid pre / 2 sigmoid post maps
    sinkhorn_iters: PositiveInt = 20
    fractions: PositiveInt = 1  # m: Frac-Connections' fractions of d per stream (1: Hyper-Connections)
    norm: Norm = "rms"  # N of the dynamic terms: rms (RMSNorm * g) | layer (LayerNorm: g, b)

    def clipped_to(self, size: SizeConfig) -> dict[str, int]:
        m = self.fractions
        return {} if size.d_model % m == 0 else {"fractions": max(k for k in range(1, m) if size.d_model % k == 0)}

    def rules(self, where: str) -> None:
        if self.manifold and self.fractions > 1:
            raise self.error(where, "fractions", f"mHC ({self.name_of('manifold')}: true) has no fractions (neither "
                                                 f"public code defines it), got {self.name_of('fractions')}="
                                                 f"{self.fractions}; set it to 1 or {self.name_of('manifold')}: false")


class HyperConnectionsKind(UnkeyedKind):
    name = "hyper_connections"
    Options = HyperConnectionsOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        d, m = cfg.size.d_model, cfg.options.fractions
        if d % m:
            raise cfg.options.error(where, "fractions", f"d_model={d} is not divisible by fractions={m}; choose a "
                                                        f"divisor of {d}")

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return HyperConnectionsRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        a, d = cfg.options, cfg.size.d_model
        m, N, e = a.fractions, a.streams * a.fractions, d // a.fractions
        dynamic = e * (2 if a.norm == "layer" else 1) + e * (m + N) + e + (3 if a.manifold else 2)
        return cfg.size.n_sublayers * (N * (m + N) + N + (dynamic if a.dynamic else 0))

    def added_flops(self, cfg: ModelConfig) -> int:
        a, d = cfg.options, cfg.size.d_model
        n, m, N = a.streams, a.fractions, a.streams * a.fractions  # N slots of e = d / m channels: N e = n d
        norm = 7 if a.norm == "layer" else 4  # per channel: RMSNorm * g 4; LayerNorm adds mean, centring, bias
        per = 2 * n * d * (m + N) + 2 * n * d + ((2 * n * d * (m + N + 1) + norm * n * d) if a.dynamic else 0)
        return cfg.size.n_sublayers * per + n * d

    def adamw_names(self, router: nn.Module) -> None:
        return None

    def code_paths(self, options: HyperConnectionsOptions) -> list[str]:
        return []


KIND = HyperConnectionsKind()
