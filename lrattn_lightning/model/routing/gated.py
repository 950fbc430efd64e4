"""The gated residual (docs/method.md §7; `routing: gated`): its router, state and decoding cache.

Sublayer i (1..2L) mixes the stream x it read with what it wrote, F(x), by one gate per token:

    alpha_i  = sigmoid( <W_q,i cummean(x), W_k,i cummean(F(x))> / sqrt(d) + b_i )     float32 (float64
                                                                                   for float64 models)
    y        = alpha_i x + (1 - alpha_i) F(x)

cummean is the running mean over positions <= t, so the decoder stays causal (the blog seed averages
over the whole sequence); W_q, W_k are d x d and orthogonally initialised. The bias b_i is optional
(`gate_bias`, config.py): without it alpha starts at sigmoid(~0) = 0.5 at every sublayer, so each
sublayer halves the stream; with it b_i starts at logit(alpha0_i). With alpha0_i = i / (i + 1)
(`running_mean`) and a zero bilinear term, the stream after sublayer i is (o_0 + ... + o_i) / (i + 1):
the plain residual stream scaled, which every parameter-free pre-norm undoes.

Two training-time controls live on the router as state, not architecture (set by train/controls.py's GateHold):
    gate_hold             a persistent bool buffer: while true every alpha is exactly 0.5 and the gate
                          parameters get no gradient (the description's fixed alpha for the first steps);
                          it travels in checkpoints, so a held model evaluates as it trained
    gate_grad_normalize   backward through alpha replaces its gradient G (one tensor [B, T, 1] per
                          sublayer) by G / (||G|| + 1e-6), clipped to |.| < 1 (already true after the
                          normalisation; kept because the description states both)

Document masking (`Decoder.doc_separator` set): the running means restart at every document boundary,
so a token's gate sees only its own document, as its attention does (`segments`, the decoder's segment ids).

KV-cache decoding: the causal means continue over earlier positions, so the router's own cache
(`GatedCache`, held opaquely by the decoder's KVCache) keeps per sublayer the sums of x and F(x) over the
positions of the current document seen so far. One implementation (the `impl` backend names only AttnRes
code and is ignored here).

Shape legend: B batch, T tokens, D = d_model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.options import Range
from lrattn_lightning.model.routing._math import compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router

GRAD_NORM_EPS = 1e-6


def segment_starts(segments_BT: Tensor) -> tuple[Tensor, Tensor] | None:
    """Per position, where its segment's sums must be cut: the index before its segment's start within this
    pass [B, T, 1] and whether that start lies in this pass [B, T, 1] (False: it continues the prefix).
    Computed once per pass, shared by every sublayer's running means; None when T = 1 (nothing to cut)."""
    B, T = segments_BT.shape
    if T == 1:
        return None
    new = torch.zeros_like(segments_BT, dtype=torch.bool)
    new[:, 1:] = segments_BT[:, 1:] != segments_BT[:, :-1]
    positions = torch.arange(T, device=segments_BT.device).expand(B, T)
    start_BT = torch.where(new, positions, 0).cummax(dim=1).values  # 0: continues the prefix
    return (start_BT - 1).clamp(min=0).unsqueeze(-1), (start_BT > 0).unsqueeze(-1)


def causal_mean(x_BTD: Tensor, prefix: tuple[Tensor, Tensor] | None = None,
                starts: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Running mean over positions <= t of the same segment (keeps the gated residual causal).

    prefix: (sum [B, 1, D] in the compute dtype, count [B, 1, 1]) of the earlier positions that the first
    position continues (count 0 where it starts a new segment), for incremental decoding.
    starts: `segment_starts` of the segment ids (document masking; None: one segment). Sums in
    compute_dtype(x): float32, float64 for float64 models.
    -> (means [B, T, D], the (sum, count) at the last position: the next prefix).
    """
    B, T, D = x_BTD.shape
    cdtype = compute_dtype(x_BTD.dtype)
    sums = x_BTD.to(cdtype).cumsum(dim=1)
    counts = torch.arange(1, T + 1, device=x_BTD.device, dtype=cdtype).view(1, T, 1).expand(B, T, 1)
    if prefix is not None:
        sums, counts = sums + prefix[0], counts + prefix[1]
    if starts is not None:  # subtract what precedes each position's segment start
        before_BT1, inside_BT1 = starts[0], starts[1].to(cdtype)
        sums = sums - sums.gather(1, before_BT1.expand(B, T, D)) * inside_BT1
        counts = counts - counts.gather(1, before_BT1) * inside_BT1
    return (sums / counts).to(x_BTD.dtype), (sums[:, -1:], counts[:, -1:])


class NormalizedGateGrad(torch.autograd.Function):
    """Identity forward; backward G -> clamp(G / (||G|| + 1e-6), -1, 1) over the whole gate tensor."""

    @staticmethod
    def forward(ctx, gate_BT1: Tensor) -> Tensor:
        return gate_BT1.view_as(gate_BT1)

    @staticmethod
    def backward(ctx, grad_BT1: Tensor) -> Tensor:
        grad = grad_BT1.float()
        grad = grad / (torch.linalg.vector_norm(grad) + GRAD_NORM_EPS)
        return grad.clamp(-1.0, 1.0).to(grad_BT1.dtype)


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@dataclass
class GatedCache:
    """Incremental decoding: per sublayer i = 1..2L, the sums over the earlier positions of the current
    document of x and F(x) ([B, 1, D] each, compute dtype) and how many positions they cover ([B, 1, 1]);
    the segment id of the last cached position ([B], document masking); updated in place."""

    sums: list[tuple[Tensor, Tensor, Tensor] | None]
    last_segment: Tensor | None = None


@dataclass
class GatedState:
    stream: Tensor  # the running hidden state [B, T, D]
    weights: list[Tensor] | None = None  # recording: per sublayer [alpha_i, 1 - alpha_i] as [2, B, T, 1]
    cache: GatedCache | None = None
    starts: tuple[Tensor, Tensor] | None = None  # document masking: `segment_starts` of this pass
    continues: Tensor | None = None  # [B, 1, 1]: 1 where the first new position continues the cached document


class GatedRouter(Router):
    """The gated write: gate matrices W_q, W_k per sublayer, optional biases b_i, the hold buffer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d, self.n_sublayers = cfg.size.d_model, cfg.size.n_sublayers
        M = self.n_sublayers
        self.gate_q = nn.ModuleList(nn.Linear(self.d, self.d, bias=False) for _ in range(M))
        self.gate_k = nn.ModuleList(nn.Linear(self.d, self.d, bias=False) for _ in range(M))
        self.gate_alpha0 = initial_gates(cfg)  # alpha0_i, i = 1..2L, or None (no bias parameter)
        if self.gate_alpha0 is not None:
            self.gate_bias = nn.Parameter(torch.zeros(M))  # b_i, one scalar per sublayer
        self.register_buffer("gate_hold", torch.tensor(False))
        self._held = False  # python mirror of gate_hold: no device sync per write
        self.gate_grad_normalize = False
        self.register_load_state_dict_post_hook(GatedRouter._after_load)
        self._register_load_state_dict_pre_hook(GatedRouter._default_hold)

    def reset_parameters(self) -> None:
        """W_q, W_k orthogonal; b_i = logit(alpha0_i)."""
        for lin in [*self.gate_q, *self.gate_k]:
            if not lin.weight.is_meta:
                nn.init.orthogonal_(lin.weight)
        if self.gate_alpha0 is not None and not self.gate_bias.is_meta:
            with torch.no_grad():
                self.gate_bias.copy_(torch.tensor([logit(a) for a in self.gate_alpha0], dtype=torch.float64))

    # ---- training-time state ---------------------------------------------------------------------
    def set_gate_hold(self, hold: bool) -> None:
        """Hold every alpha at exactly 0.5 (True) or let the gates compute it (False)."""
        self.gate_hold.fill_(bool(hold))
        self._held = bool(hold)

    @property
    def gates_held(self) -> bool:
        return self._held

    @staticmethod
    def _after_load(module: GatedRouter, _incompatible_keys) -> None:
        module._held = bool(module.gate_hold)

    @staticmethod
    def _default_hold(state_dict, prefix, *args) -> None:
        """Checkpoints written before gates could be held have no gate_hold: they were never held."""
        state_dict.setdefault(prefix + "gate_hold", torch.tensor(False))

    # ---- the forward-pass protocol -----------------------------------------------------------------
    def new_cache(self) -> GatedCache:
        return GatedCache([None] * self.n_sublayers)

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: GatedCache | None = None,
              segments: Tensor | None = None) -> GatedState:
        continues = None
        if segments is not None and cache is not None:
            if cache.last_segment is not None:
                continues = (segments[:, :1] == cache.last_segment[:, None]).unsqueeze(-1)
            cache.last_segment = segments[:, -1]
        starts = None if segments is None else segment_starts(segments)
        return GatedState(emb_BTD, [] if record else None, cache, starts, continues)

    def read(self, state: GatedState, j: int) -> Tensor:
        return state.stream

    def write(self, state: GatedState, i: int, out_BTE: Tensor) -> None:
        x_BTD, fx_BTD = state.stream, out_BTE[..., : self.d]
        if self._held:
            gate_BT1 = x_BTD.new_full((*x_BTD.shape[:-1], 1), 0.5)
            if state.cache is not None:  # keep the cached sums current for a later release
                self._gate_means(state, i, x_BTD, fx_BTD)
        else:
            gate_BT1 = self._gate(state, i, x_BTD, fx_BTD)
            if self.gate_grad_normalize and gate_BT1.requires_grad:
                gate_BT1 = NormalizedGateGrad.apply(gate_BT1)
        if state.weights is not None:  # a two-source read: alpha on the stream, 1 - alpha on F(x)
            state.weights.append(torch.stack((gate_BT1, 1 - gate_BT1)).detach().float())
        state.stream = gate_BT1 * x_BTD + (1 - gate_BT1) * fx_BTD

    def _gate(self, state: GatedState, i: int, x_BTD: Tensor, fx_BTD: Tensor) -> Tensor:
        """alpha_i [B, T, 1] in the stream's dtype (computed in float32, float64 for float64 models)."""
        mean_x, mean_fx = self._gate_means(state, i, x_BTD, fx_BTD)
        gate_logit = (self.gate_q[i - 1](mean_x) * self.gate_k[i - 1](mean_fx)).sum(-1, keepdim=True)
        cdtype = compute_dtype(gate_logit.dtype)
        gate_logit = gate_logit.to(cdtype) / math.sqrt(self.d)
        if self.gate_alpha0 is not None:
            gate_logit = gate_logit + self.gate_bias[i - 1].to(cdtype)
        return torch.sigmoid(gate_logit).to(x_BTD.dtype)

    @staticmethod
    def _gate_means(state: GatedState, i: int, x: Tensor, fx: Tensor) -> tuple[Tensor, Tensor]:
        """Causal running means of x and F(x) within each document, continuing the cached sums when
        decoding incrementally (dropped in rows whose first new token starts a new document)."""
        cache, prefix_x, prefix_fx = state.cache, None, None
        if cache is not None and cache.sums[i - 1] is not None:
            sum_x, sum_fx, n = cache.sums[i - 1]
            if state.continues is not None:
                keep = state.continues.to(sum_x.dtype)
                sum_x, sum_fx, n = sum_x * keep, sum_fx * keep, n * keep
            prefix_x, prefix_fx = (sum_x, n), (sum_fx, n)
        mean_x, (last_x, count) = causal_mean(x, prefix_x, state.starts)
        mean_fx, (last_fx, _) = causal_mean(fx, prefix_fx, state.starts)
        if cache is not None:
            cache.sums[i - 1] = (last_x, last_fx, count)
        return mean_x, mean_fx


# The gated residual's learned per-sublayer gate bias b_i (docs/method.md §7, docs/gated-residual.md):
#   g_i = sigmoid(<W_q cummean(x), W_k cummean(F(x))> / sqrt(d) + b_i), with b_i initialised to logit(alpha0_i)
#   none          no bias parameter: alpha starts at sigmoid(~0) = 0.5 everywhere (the blog seed's formula)
#   constant      every sublayer starts at alpha0 = gate_alpha
#   last_layer    the last layer's two sublayers start at gate_alpha, the others at 0.5 (b = 0)
#   running_mean  sublayer i starts at alpha0_i = i / (i + 1) (b_i = log i): the stream starts as the mean
#                 of the embedding and the i outputs, i.e. the plain residual stream / (i + 1)
GateBias = Literal["none", "constant", "last_layer", "running_mean"]
Alpha0 = Annotated[float, Range(0, 1, open_low=True, open_high=True)]


@dataclass(frozen=True)
class GatedOptions(KindOptions):
    gate_bias: GateBias = "none"
    gate_alpha: Alpha0 | None = None  # alpha0 of gate_bias constant / last_layer

    def rules(self, where: str) -> None:
        """gate_alpha exactly when the bias needs one."""
        bias, alpha = self.name_of("gate_bias"), self.name_of("gate_alpha")
        if self.gate_bias in ("constant", "last_layer"):
            if self.gate_alpha is None:
                raise self.error(where, "gate_alpha", f"{bias} '{self.gate_bias}' needs the initial gate alpha0 in "
                                                      f"(0, 1), got None")
        elif self.gate_alpha is not None:
            raise self.error(where, "gate_alpha", f"{bias} '{self.gate_bias}' sets no alpha0 of its own; leave {alpha} "
                                                  f"null (or use {bias} constant / last_layer)")


def initial_gates(cfg: ModelConfig) -> list[float] | None:
    """alpha0_i of the bias for sublayers i = 1..2L (None: no bias, alpha starts at 0.5)."""
    a, m = cfg.options, cfg.size.n_sublayers
    if a.gate_bias == "none":
        return None
    if a.gate_bias == "constant":
        return [float(a.gate_alpha)] * m
    if a.gate_bias == "last_layer":  # the last layer = its attention (2L-1) and MLP (2L) sublayers
        return [float(a.gate_alpha) if i >= m - 1 else 0.5 for i in range(1, m + 1)]
    return [i / (i + 1) for i in range(1, m + 1)]  # running_mean


class GatedKind(UnkeyedKind):
    """The gated residual: W_q, W_k per sublayer (matrices: Muon under muon_adamw), the optional biases b_i.

        params = 2L (2 d^2 [+ 1 with a gate bias])
        FLOPs  = 2L (4 d^2 + 5 d [+ 1 with a gate bias])   W_q, W_k, the dot, the mix
    """

    name = "gated"
    Options = GatedOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """Its options fit any size."""

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return GatedRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        d, M = cfg.size.d_model, cfg.size.n_sublayers
        return M * 2 * d * d + (M if cfg.options.gate_bias != "none" else 0)

    def added_flops(self, cfg: ModelConfig) -> int:
        d, M = cfg.size.d_model, cfg.size.n_sublayers
        return M * (2 * 2 * d * d + 2 * d + 3 * d + (1 if cfg.options.gate_bias != "none" else 0))

    def adamw_names(self, router: nn.Module) -> set[str]:
        return set()  # W_q, W_k to Muon, the biases by the usual rule

    def code_paths(self, options: GatedOptions) -> list[str]:
        return []


KIND = GatedKind()
