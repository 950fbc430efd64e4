"""MUDDFormer's multiway dynamic dense connections (Xiao et al., ICML 2025; docs/method.md §10; `routing: muddformer`).

Per layer (attention + MLP) the next layer reads four streams Q, K, V, R, all x_0 for layer 1. The attention takes
three separate inputs (the router protocol's `read_attention` extension, router.py), each through the decoder's
own parameter-free pre-norm, and R is what it adds to:

    a = Attn(norm(Q_i), norm(K_i), norm(V_i))       Y = R_i + a       X_i = Y + MLP(norm(Y))

After layer i (1..L), per token, a dense aggregation (DA) over X_0..X_i makes the next layer's streams:

    w_i     = GELU(RMS(X_i) W1_i) W2_i + a_i        [C, i + 1]   (C = 4 ways for i < L, 1 for the last)
    S_c     = sum_{j<=i} w_i[c, j] X_j              c in (Q, K, V, R); the model's output is the last R

W1_i is d x K_i with K_i = 64 (floor(C (i + 1) e / 64) + 1) (e = 4 at the last layer, else 1), W2_i is
K_i x C (i + 1); W2 = 0 and a_i one-hot on X_i at init, W1 ~ N(0, 1/d): exactly the pre-norm baseline at init.
RMS is parameter-free (eps 1e-6), as the public code's. `prepost_norm: true` (PrePostDANorm, `ppn`: the
MUDDFormer code's default for deep models; plain MUDDFormer diverged at 24 layers in hyper-connection-factory)
stores the sources normalised, N_j = RMSNorm(X_j) g_j (gains started at 1), sets a_i = 0, and makes every stream
`X_i + DA_c` with the R stream's DA term through one more RMSNorm whose gain starts at 1e-3:

    S_c = X_i + sum_j w_i[c, j] N_j  (Q, K, V)      S_R = X_i + RMSNorm(sum_j w_i[R, j] N_j) g_post_i

also exactly the baseline at init (a_i = 0 and W2 = 0 make every DA term zero; the post gain matters once they
move). This follows hyper-connection-factory's
`hcfactory/connections/dense.py` (and, through it, the JAX reference `layers/mudd.py`): the depth-varying FFN width
of the paper is left out, as there. `dynamic: false` keeps only the static a_i; `multiway: false` makes
one R stream that the attention also reads (a dynamic DenseFormer), as the factory's two ablations. The decoder's
norms are weight-free for every kind (docs/method.md §5), so MUDDFormer's separate Q/K/V norms are too (the factory gives
every norm, the baseline's included, a gain): the runs compared differ in the connection only.

    params = sum_i C_i (i + 1) [+ dynamic: K_i (d + C_i (i + 1))] [+ ppn: (L + 1) d + L d]
    FLOPs/token = sum_i [2 C_i (i + 1) d (the sums) + dynamic: 2 K_i (d + C_i (i + 1)) + ppn: C_i d (the adds)]
                  (the norms and the GELU not counted, as for the other kinds)

The DA computes in float32 (float64 models: float64) with autocast off. Depth routing is per token: KV-cache
decoding keeps no state of its own (a step recomputes X_0..X_i of its tokens). AdamW takes every router
parameter under muon_adamw: the factory trains every connection parameter with AdamW (no decay), its W1/W2 too.
Diagnostics ("mixing"): a recording pass keeps, per layer and way, the DA weights w_i[c, :] over X_0..X_i.

Shape legend: B batch, T tokens, D = d_model, C ways, n = i + 1 sources.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import autocast_off, compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router

EPS = 1e-6  # the public code's RMSNorm eps
POST_GAIN0 = 1e-3  # PrePostDANorm's post-norm gain at init
WAYS = ("Q", "K", "V", "R")


def ways(cfg: ModelConfig) -> list[int]:
    """C_i per layer i = 1..L: 4 (Q, K, V, R) before the last layer, 1 (R) after it (or 1 everywhere)."""
    L, multi = cfg.size.n_layers, cfg.options.multiway
    return [4 if multi and i < L else 1 for i in range(1, L + 1)]


def hidden_widths(cfg: ModelConfig) -> list[int]:
    """K_i of the DA's MLP per layer i = 1..L."""
    L = cfg.size.n_layers
    return [64 * (C * (i + 1) * (4 if i == L else 1) // 64 + 1) for i, C in enumerate(ways(cfg), start=1)]


@dataclass
class MuddState:
    sources: list[Tensor]  # X_0 .. X_i as the DA reads them (ppn: N_j), compute dtype
    streams: tuple[Tensor, ...]  # (Q, K, V, R) for the next layer, or (R,) with one way
    inner: Tensor | None = None  # Y = R + a inside the current layer
    weights: list[Tensor] | None = field(default=None)  # recording: per layer and way, w [n, B, T, 1]


class MuddFormerRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a, d, L = cfg.options, cfg.size.d_model, cfg.size.n_layers
        self.d, self.L, self.ways = d, L, ways(cfg)
        self.dynamic, self.ppn = a.dynamic, a.prepost_norm
        self.static = nn.ParameterList(nn.Parameter(torch.empty(C, i + 1)) for i, C in enumerate(self.ways, 1))
        if self.dynamic:
            K = hidden_widths(cfg)
            self.w1 = nn.ParameterList(nn.Parameter(torch.empty(k, d)) for k in K)
            self.w2 = nn.ParameterList(nn.Parameter(torch.empty(C * (i + 1), k))
                                       for i, (C, k) in enumerate(zip(self.ways, K, strict=True), 1))
        if self.ppn:
            self.pre_gain = nn.Parameter(torch.empty(L + 1, d))  # N_j = RMSNorm(X_j) g_j, j = 0..L
            self.post_gain = nn.Parameter(torch.empty(L, d))  # the R stream's DA term, per layer
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for s in self.static:
                s.zero_()
                if not self.ppn:
                    s[:, -1] = 1.0  # a_i one-hot on X_i
            if self.dynamic:
                for w in self.w1:
                    w.normal_(std=self.d ** -0.5)
                for w in self.w2:
                    w.zero_()
            if self.ppn:
                self.pre_gain.fill_(1.0)
                self.post_gain.fill_(POST_GAIN0)

    def _source(self, x: Tensor, j: int) -> Tensor:
        return F.rms_norm(x, (self.d,), eps=EPS) * self.pre_gain[j].to(x.dtype) if self.ppn else x

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> MuddState:
        with autocast_off(emb_BTD.device):
            x0 = emb_BTD.to(compute_dtype(emb_BTD.dtype))
            return MuddState([self._source(x0, 0)], (emb_BTD,) * self.ways[0], weights=[] if record else None)

    def read_attention(self, state: MuddState, j: int) -> tuple[Tensor, Tensor, Tensor]:
        return state.streams[:3] if len(state.streams) == 4 else state.streams * 3

    def read(self, state: MuddState, j: int) -> Tensor:
        return state.inner if j % 2 else state.streams[-1]  # the MLP's Y; R (after the last layer: the output)

    def write(self, state: MuddState, i: int, out_BTE: Tensor) -> None:
        out = out_BTE[..., : self.d]
        if i % 2:  # the attention: Y = R + a
            state.inner = state.streams[-1] + out
            return
        layer = i // 2  # 1..L
        X = state.inner + out
        state.inner = None
        dtype = X.dtype
        with autocast_off(X.device):
            Xc = X.to(compute_dtype(dtype))
            state.sources.append(self._source(Xc, layer))
            C, n = self.ways[layer - 1], layer + 1
            w = self.static[layer - 1].to(Xc.dtype)  # [C, n]
            if self.dynamic:
                hidden = F.gelu(F.rms_norm(Xc, (self.d,), eps=EPS) @ self.w1[layer - 1].to(Xc.dtype).T)
                w = (hidden @ self.w2[layer - 1].to(Xc.dtype).T).unflatten(-1, (C, n)) + w  # [B, T, C, n]
            V = torch.stack(state.sources, dim=-2)  # [B, T, n, D]
            mixed = w.expand(*Xc.shape[:-1], C, n) @ V  # [B, T, C, D]
            streams = list(mixed.unbind(-2))
            if self.ppn:
                streams[-1] = F.rms_norm(streams[-1], (self.d,), eps=EPS) * self.post_gain[layer - 1].to(Xc.dtype)
                streams = [Xc + s for s in streams]
        if state.weights is not None:
            for c in range(C):
                state.weights.append(w.expand(*Xc.shape[:-1], C, n)[..., c, :].detach().float()
                                     .movedim(-1, 0).unsqueeze(-1))
        state.streams = tuple(s.to(dtype) for s in streams)


@dataclass(frozen=True)
class MuddFormerOptions(KindOptions):
    """`muddformer: {prepost_norm: true}` (flat: mudd_prepost_norm, mudd_dynamic, mudd_multiway)."""

    flat_names: ClassVar[dict[str, str]] = {"prepost_norm": "mudd_prepost_norm", "dynamic": "mudd_dynamic",
                                            "multiway": "mudd_multiway"}
    prepost_norm: bool = False  # PrePostDANorm (`ppn`): normalised sources, X_i + DA, post-norm on R
    dynamic: bool = True  # the per-token GELU(RMS(X_i) W1) W2 term (false: the static a_i only)
    multiway: bool = True  # separate Q, K, V, R streams (false: one R stream the attention reads too)


class MuddFormerKind(UnkeyedKind):
    name = "muddformer"
    Options = MuddFormerOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """Its options fit any size."""

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return MuddFormerRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        a, d, L = cfg.options, cfg.size.d_model, cfg.size.n_layers
        total = 0
        for i, (C, K) in enumerate(zip(ways(cfg), hidden_widths(cfg), strict=True), 1):
            total += C * (i + 1) + (K * (d + C * (i + 1)) if a.dynamic else 0)
        return total + ((2 * L + 1) * d if a.prepost_norm else 0)

    def added_flops(self, cfg: ModelConfig) -> int:
        a, d = cfg.options, cfg.size.d_model
        total = 0
        for i, (C, K) in enumerate(zip(ways(cfg), hidden_widths(cfg), strict=True), 1):
            total += 2 * C * (i + 1) * d
            total += 2 * K * (d + C * (i + 1)) if a.dynamic else 0
            total += C * d if a.prepost_norm else 0
        return total

    def adamw_names(self, router: nn.Module) -> None:
        return None  # every connection parameter, W1/W2 too (the factory's connection group)

    def code_paths(self, options: MuddFormerOptions) -> list[str]:
        return []


KIND = MuddFormerKind()
