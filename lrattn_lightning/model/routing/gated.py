"""The gated residual (SPEC §7; `routing: gated`), written by `DepthRouter` through `GatedResidual`.

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

Two training-time controls live on the router as state, not architecture (set by the LightningModule):
    gate_hold             a persistent bool buffer: while true every alpha is exactly 0.5 and the gate
                          parameters get no gradient (the description's fixed alpha for the first steps);
                          it travels in checkpoints, so a held model evaluates as it trained
    gate_grad_normalize   backward through alpha replaces its gradient G (one tensor [B, T, 1] per
                          sublayer) by G / (||G|| + 1e-6), clipped to |.| < 1 (already true after the
                          normalisation; kept because the description states both)

Shape legend: B batch, T tokens, D = d_model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lrattn_lightning.model.config import ModelConfig
    from lrattn_lightning.model.routing.attnres import RoutingState

GRAD_NORM_EPS = 1e-6


def causal_mean(x_BTD: Tensor, prefix: tuple[Tensor, int] | None = None) -> Tensor:
    """Running mean over positions <= t (keeps the gated residual causal).

    prefix: (sum over earlier positions [B, 1, D] in the compute dtype, their count), for incremental decoding.
    Sums in compute_dtype(x): float32, float64 for float64 models.
    """
    T = x_BTD.shape[1]
    cdtype = _compute_dtype(x_BTD.dtype)
    sums = x_BTD.to(cdtype).cumsum(dim=1)
    counts = torch.arange(1, T + 1, device=x_BTD.device, dtype=cdtype).view(1, T, 1)
    if prefix is not None:
        sums, counts = sums + prefix[0], counts + prefix[1]
    return (sums / counts).to(x_BTD.dtype)


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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 (routing.compute_dtype, which imports this module)."""
    return torch.promote_types(dtype, torch.float32)


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


class GatedResidual:
    """The gated write of `DepthRouter` (mixed into it, so parameter names stay router.gate_q.N ...)."""

    d: int
    n_sublayers: int

    def _init_gates(self, cfg: ModelConfig) -> None:
        M = self.n_sublayers
        self.gate_q = nn.ModuleList(nn.Linear(self.d, self.d, bias=False) for _ in range(M))
        self.gate_k = nn.ModuleList(nn.Linear(self.d, self.d, bias=False) for _ in range(M))
        self.gate_alpha0 = cfg.initial_gates()  # alpha0_i, i = 1..2L, or None (no bias parameter)
        if self.gate_alpha0 is not None:
            self.gate_bias = nn.Parameter(torch.zeros(M))  # b_i, one scalar per sublayer
        self.register_buffer("gate_hold", torch.tensor(False))
        self._held = False  # python mirror of gate_hold: no device sync per write
        self.gate_grad_normalize = False
        self.register_load_state_dict_post_hook(GatedResidual._after_load)
        self._register_load_state_dict_pre_hook(GatedResidual._default_hold)

    def _reset_gates(self) -> None:
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
    def _after_load(module: GatedResidual, _incompatible_keys) -> None:
        module._held = bool(module.gate_hold)

    @staticmethod
    def _default_hold(state_dict, prefix, *args) -> None:
        """Checkpoints written before gates could be held have no gate_hold: they were never held."""
        state_dict.setdefault(prefix + "gate_hold", torch.tensor(False))

    # ---- the write ---------------------------------------------------------------------------------
    def _gated_write(self, state: RoutingState, i: int, fx_BTD: Tensor) -> None:
        x_BTD = state.stream
        if self._held:
            gate_BT1 = x_BTD.new_full((*x_BTD.shape[:-1], 1), 0.5)
            if state.gate_prefix is not None:  # keep the cached sums current for a later release
                self._gate_means(state, i, x_BTD, fx_BTD)
        else:
            gate_BT1 = self._gate(state, i, x_BTD, fx_BTD)
            if self.gate_grad_normalize and gate_BT1.requires_grad:
                gate_BT1 = NormalizedGateGrad.apply(gate_BT1)
        if state.weights is not None:  # a two-source read: alpha on the stream, 1 - alpha on F(x)
            state.weights.append(torch.stack((gate_BT1, 1 - gate_BT1)).detach().float())
        state.stream = gate_BT1 * x_BTD + (1 - gate_BT1) * fx_BTD

    def _gate(self, state: RoutingState, i: int, x_BTD: Tensor, fx_BTD: Tensor) -> Tensor:
        """alpha_i [B, T, 1] in the stream's dtype (computed in float32, float64 for float64 models)."""
        mean_x, mean_fx = self._gate_means(state, i, x_BTD, fx_BTD)
        gate_logit = (self.gate_q[i - 1](mean_x) * self.gate_k[i - 1](mean_fx)).sum(-1, keepdim=True)
        cdtype = _compute_dtype(gate_logit.dtype)
        gate_logit = gate_logit.to(cdtype) / math.sqrt(self.d)
        if self.gate_alpha0 is not None:
            gate_logit = gate_logit + self.gate_bias[i - 1].to(cdtype)
        return torch.sigmoid(gate_logit).to(x_BTD.dtype)

    @staticmethod
    def _gate_means(state: RoutingState, i: int, x: Tensor, fx: Tensor) -> tuple[Tensor, Tensor]:
        """Causal running means of x and F(x), continuing cached sums when decoding incrementally."""
        if state.gate_prefix is None:
            return causal_mean(x), causal_mean(fx)
        prev = state.gate_prefix[i - 1]
        if prev is None:
            means = causal_mean(x), causal_mean(fx)
        else:
            means = causal_mean(x, (prev[0], state.prefix_len)), causal_mean(fx, (prev[1], state.prefix_len))
        sums = tuple(t.to(_compute_dtype(t.dtype)).sum(dim=1, keepdim=True) for t in (x, fx))
        state.gate_prefix[i - 1] = sums if prev is None else (prev[0] + sums[0], prev[1] + sums[1])
        return means
