"""Depth routing, the readable reference implementation (SPEC §2-3, §7).

A decoder with L layers has M = 2L residual-writing sublayers. o_0 is the embedding, o_i what
sublayer i writes. Read site j (0..2L) forms the hidden state that feeds sublayer j+1 (site 2L
feeds the final norm and the head). With attention residuals, site j >= 1 owns a static
pseudo-query q_j and reads

    k_i      = RMSNorm(key_i)                   per depth head, parameter-free (key_norm: rms)
    logit_i  = s * <q_j, k_i> + beta * log(c_i)  c_i: outputs summarised by source i
    alpha_j  = softmax_i(logit)                  over sources i in S_j, float32
    h_j      = sum_i alpha_{j,i} v_i             values are always the full d-dim sources

Full routing: S_j = {o_0 .. o_j}. Block routing: S_j = {o_0, completed block summaries,
the partial block if non-empty}; a summary over c outputs has value (sum o_i) / c^a.

The key of a source (a single output is a summary with c = 1), as the paper's code forms it:
    value            key = the summary value                        (standard AttnRes)
    sliced           key = (sum o_i)[..., -r:]                      (S-LR; / c^a only without key norm)
    projected        key = sum_i RMSNorm(k_i), each emitted key       (P-LR; / c^a only without key norm)
                     normalised where it is emitted
    value_projected  key = W_last RMSNorm(summary value)            (W_last: the projection of the
                                                                      block's most recent sublayer)
The embedding's key: value / sliced as above; projected RMSNorm(W_0 o_0), static s, or
projected_plus_static RMSNorm(W_0 o_0) + s; value_projected W_0 RMSNorm(o_0) (+ s).
Every RMSNorm is parameter-free with torch's default eps (finfo(dtype).eps, as the reference's
F.rms_norm calls). Routing computes in promote_types(dtype, float32): float32 for bf16 and float32
models, float64 for float64 ones.

Gated residual (routing: gated): lrattn_lightning/model/routing/gated.py.

Gated dynamic query: q = q_j + g_j * q_dyn, where q_dyn is what the most recent sublayer (the one
written just before site j) emits in r extra output rows, and g_j is a zero-initialised gate per head.

Shape legend: S sources, B batch, T tokens, D = d_model, R = key width r, M = depth heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.gated import GatedResidual


def rms_norm(x: Tensor) -> Tensor:
    """Parameter-free RMSNorm over the last dimension, eps = finfo(x.dtype).eps (torch's default)."""
    return F.rms_norm(x, (x.shape[-1],))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing computes in: at least float32, float64 for float64 models."""
    return torch.promote_types(dtype, torch.float32)


def head_rms_norm(x_R: Tensor, heads: int) -> Tensor:
    """RMSNorm of each of `heads` equal slices of the last dimension; same shape out."""
    if heads == 1:
        return rms_norm(x_R)
    return rms_norm(x_R.unflatten(-1, (heads, -1))).flatten(-2)


def depth_read(
    values: Tensor,
    keys: Tensor,
    query: Tensor,
    *,
    bias: Tensor | None = None,
    scale: float = 1.0,
    key_norm: bool = True,
    heads: int = 1,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """One read over stacked sources.

    values [S, B, T, D], keys [S, B, T, R], query [R] or [M, R/M] (static) or [B, T, R] (per token),
    bias [S] or None -> [B, T, D] (and the weights alpha [S, B, T, M] in the compute dtype when
    return_weights). Logits and softmax in compute_dtype(values.dtype).
    """
    S, B, T, D = values.shape
    R = keys.shape[-1]
    if R % heads or D % heads:
        raise ValueError(f"key width {R} and value width {D} must be divisible by heads={heads}")
    cdtype = compute_dtype(values.dtype)
    keys_SBTMr = keys.to(cdtype).unflatten(-1, (heads, R // heads))
    if key_norm:
        keys_SBTMr = rms_norm(keys_SBTMr)
    if query.dim() == 3:  # per token: [B, T, R]
        query_BTMr = query.to(cdtype).unflatten(-1, (heads, R // heads))
        logits_SBTM = torch.einsum("sbtmr,btmr->sbtm", keys_SBTMr, query_BTMr) * scale
    else:
        query_Mr = query.to(cdtype).reshape(heads, R // heads)
        logits_SBTM = torch.einsum("sbtmr,mr->sbtm", keys_SBTMr, query_Mr) * scale
    if bias is not None:
        logits_SBTM = logits_SBTM + bias.to(cdtype).view(S, 1, 1, 1)
    alpha_SBTM = logits_SBTM.softmax(dim=0)
    values_SBTMd = values.unflatten(-1, (heads, D // heads))
    out_BTD = torch.einsum("sbtm,sbtmd->btmd", alpha_SBTM.to(values.dtype), values_SBTMd).flatten(-2)
    return (out_BTD, alpha_SBTM) if return_weights else out_BTD


@dataclass
class RoutingState:
    """Everything one forward pass has written so far."""

    stream: Tensor | None = None  # residual/gated: the running hidden state
    values: list[Tensor] = field(default_factory=list)  # attnres: completed sources [B, T, D]
    keys: list[Tensor] = field(default_factory=list)  # their keys, already normalised [B, T, R]
    counts: list[int] = field(default_factory=list)  # outputs each completed source summarises
    partial_value: Tensor | None = None  # block routing: raw sum of the current block's outputs
    partial_key: Tensor | None = None  # ... and of its emitted keys (key_source projected)
    partial_count: int = 0
    partial_last: int = 0  # the block's most recent sublayer (its projection keys value_projected)
    dynamic_query: Tensor | None = None  # gated dynamic query: what the last written sublayer emitted
    # per site j=1..2L when recording: alpha [S_j, B, T, M]; gated: [alpha_j, 1 - alpha_j] as [2, B, T, 1]
    weights: list[Tensor] | None = None
    # incremental decoding of the gated residual: per sublayer, the float32 sums over earlier positions
    # of x and F(x) ([B, 1, D] each) and how many positions they cover; updated in place
    gate_prefix: list[tuple[Tensor, Tensor] | None] | None = None
    prefix_len: int = 0


class DepthRouter(GatedResidual, nn.Module):
    """Owns the routing parameters (queries, key projections, gates) and the read/write rules."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s, a = cfg.size, cfg.ablation
        self.kind = a.routing
        self.d = s.d_model
        self.n_sublayers = s.n_sublayers
        self.std = s.init_std
        if self.kind == "gated":
            self._init_gates(cfg)
        if self.kind != "attnres":
            return
        self.rank = cfg.key_dim
        self.heads = a.depth_heads
        self.scale = cfg.logit_scale
        self.key_source = a.key_source
        self.embedding_key = a.embedding_key
        self.key_norm = a.key_norm == "rms"
        self.query_norm = a.query_norm
        self.query_init = a.query_init
        self.dynamic_query = a.query == "gated_dynamic"
        self.summary_exponent = a.summary_exponent
        self.count_prior = float(a.count_prior)
        self.block_ends = frozenset(cfg.block_ends())
        self.value_projected = a.key_source in ("value_projected", "value_projected_shared")
        self.carries_keys = a.key_source in ("projected", "value_projected", "value_projected_shared")
        self.queries = nn.Parameter(torch.zeros(self.n_sublayers, self.rank))  # site j uses row j-1
        if self.dynamic_query:
            self.query_gates = nn.Parameter(torch.zeros(self.n_sublayers, self.heads))  # g_j per depth head
        emb_proj = a.embedding_key in ("projected", "projected_plus_static")
        if a.key_source == "projected" and emb_proj:
            self.embedding_key_proj = nn.Linear(self.d, self.rank, bias=False)
        if a.embedding_key in ("static", "projected_plus_static"):
            self.embedding_key_static = nn.Parameter(torch.zeros(self.rank))
        if a.key_source == "value_projected":
            # one projection per sublayer, plus the embedding's own when it is projected
            self.value_key_proj = nn.ModuleList(
                nn.Linear(self.d, self.rank, bias=False) for _ in range(self.n_sublayers + int(emb_proj))
            )
        self.first_projected_source = 0 if emb_proj else 1
        if a.key_source == "value_projected_shared":
            self.value_key_proj = nn.ModuleList([nn.Linear(self.d, self.rank, bias=False)])

    def reset_parameters(self) -> None:
        """SPEC init: queries zero (or N(0, std)), gates zero, key projections and static keys N(0, std),
        gated-residual matrices orthogonal and gate biases logit(alpha0)."""
        if self.kind == "gated":
            self._reset_gates()
            return
        if self.kind != "attnres":
            return
        if self.query_init == "zero":
            nn.init.zeros_(self.queries)
        else:
            nn.init.normal_(self.queries, std=self.std)
        for name, p in self.named_parameters():
            if name == "query_gates":
                nn.init.zeros_(p)
            elif name != "queries":
                nn.init.normal_(p, std=self.std)

    # ---- keys ----------------------------------------------------------------------------------
    def _emit_key(self, key_BTR: Tensor) -> Tensor:
        """P-LR: a projected key is RMS-normalised per depth head where it is emitted (with key norm)."""
        return head_rms_norm(key_BTR, self.heads) if self.key_norm else key_BTR

    def _project_value(self, value_BTD: Tensor, index: int) -> Tensor:
        """value_projected keys: W_index RMSNorm(v); index 0 is the embedding, i the sublayer."""
        if self.key_source == "value_projected_shared":
            proj = self.value_key_proj[0]
        else:
            proj = self.value_key_proj[index - self.first_projected_source]
        return proj(rms_norm(value_BTD))

    def _embedding_key(self, emb_BTD: Tensor) -> Tensor:
        """The embedding's raw key (before the read's norm)."""
        if not self.carries_keys:
            return self._slice_key(emb_BTD)
        parts = []
        if self.embedding_key in ("projected", "projected_plus_static"):
            if self.key_source == "projected":
                parts.append(self._emit_key(self.embedding_key_proj(emb_BTD)))
            else:
                parts.append(self._project_value(emb_BTD, 0))
        if self.embedding_key in ("static", "projected_plus_static"):
            parts.append(self.embedding_key_static.to(emb_BTD.dtype).expand(*emb_BTD.shape[:-1], self.rank))
        return sum(parts[1:], parts[0])

    def _slice_key(self, value_BTD: Tensor) -> Tensor:
        """key_source value / sliced: the key is the value or its last r dims."""
        return value_BTD if self.key_source == "value" else value_BTD[..., -self.rank :]

    def _emitted(self, out_BTE: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Split a sublayer's output rows: value [.., D], emitted key [.., R] (P-LR, normalised), query."""
        value_BTD = out_BTE[..., : self.d]
        key_BTR = self._emit_key(out_BTE[..., self.d : self.d + self.rank]) if self.key_source == "projected" else None
        query_BTR = out_BTE[..., -self.rank :] if self.dynamic_query else None
        return value_BTD, key_BTR, query_BTR

    def _summary(self, total: Tensor, count: int) -> Tensor:
        a = self.summary_exponent
        return total if a == 0.0 or count == 1 else total / (count**a)

    def summary_source(self, value_sum: Tensor, count: int, key_sum: Tensor | None, last: int) -> tuple[Tensor, Tensor]:
        """(value, raw key) of a source summarising `count` outputs (module docstring: keys)."""
        value = self._summary(value_sum, count)
        if self.key_source == "value":
            return value, value
        if self.value_projected:
            return value, self._project_value(value, last)
        raw = key_sum if self.key_source == "projected" else value_sum[..., -self.rank :]
        return value, (raw if self.key_norm else self._summary(raw, count))

    def _norm_key(self, key_BTR: Tensor) -> Tensor:
        """The read's key norm, per depth head, in the routing's compute dtype."""
        key_BTR = key_BTR.to(compute_dtype(key_BTR.dtype))
        return head_rms_norm(key_BTR, self.heads) if self.key_norm else key_BTR

    def site_query(self, queries_JR: Tensor, j: int, state: RoutingState) -> Tensor:
        """Site j's query: [R] static, or [B, T, R] with the gated dynamic query; query-normed if set."""
        query = queries_JR[j - 1]
        if self.dynamic_query:
            M = self.heads
            gate_M1 = self.query_gates[j - 1].view(M, 1)
            q_dyn = state.dynamic_query.unflatten(-1, (M, -1))
            query = (query.view(M, -1) + gate_M1 * q_dyn).flatten(-2)
        if self.query_norm:
            query = head_rms_norm(query.to(compute_dtype(query.dtype)), self.heads)
        return query

    # ---- the forward-pass protocol: start, then read(j) / write(i) alternately ----------------------
    def start(
        self, emb_BTD: Tensor, record: bool = False, gate_prefix: list | None = None, prefix_len: int = 0
    ) -> RoutingState:
        state = RoutingState(weights=[] if record else None, gate_prefix=gate_prefix, prefix_len=prefix_len)
        if self.kind != "attnres":
            state.stream = emb_BTD
            return state
        state.values.append(emb_BTD)
        state.keys.append(self._norm_key(self._embedding_key(emb_BTD)))
        state.counts.append(1)
        return state

    def write(self, state: RoutingState, i: int, out_BTE: Tensor) -> None:
        """Record sublayer i's raw output ([B, T, D], or [B, T, D + extra rows] for P-LR / dynamic query)."""
        if self.kind == "residual":
            state.stream = state.stream + out_BTE[..., : self.d]
            return
        if self.kind == "gated":
            self._gated_write(state, i, out_BTE[..., : self.d])
            return
        value_BTD, key_BTR, state.dynamic_query = self._emitted(out_BTE)
        self._add_to_partial(state, value_BTD, key_BTR, i)
        if not self.block_ends or i in self.block_ends:  # the block is complete (full: every output)
            value, key = self._partial_source(state)
            state.values.append(value)
            state.keys.append(self._norm_key(key))
            state.counts.append(state.partial_count)
            state.partial_value, state.partial_key, state.partial_count = None, None, 0

    @staticmethod
    def _add_to_partial(state: RoutingState, value_BTD: Tensor, key_BTR: Tensor | None, i: int) -> None:
        """Add sublayer i's output (and its emitted key) to the raw running sums of the current block."""
        if state.partial_count == 0:
            state.partial_value, state.partial_key = value_BTD, key_BTR
        else:
            state.partial_value = state.partial_value + value_BTD
            if key_BTR is not None:
                state.partial_key = state.partial_key + key_BTR
        state.partial_count += 1
        state.partial_last = i

    def _partial_source(self, state: RoutingState) -> tuple[Tensor, Tensor]:
        return self.summary_source(state.partial_value, state.partial_count, state.partial_key, state.partial_last)

    def read(self, state: RoutingState, j: int) -> Tensor:
        """Hidden state at read site j (0..2L) -> [B, T, D]."""
        if self.kind != "attnres":
            return state.stream
        if j == 0:
            return state.values[0]
        values, keys, counts = list(state.values), list(state.keys), list(state.counts)
        if state.partial_count:
            value, key = self._partial_source(state)
            values.append(value)
            keys.append(self._norm_key(key))
            counts.append(state.partial_count)
        query = self.site_query(self.queries, j, state)
        bias = None
        if self.count_prior != 0.0:
            bias = self.count_prior * torch.log(torch.tensor(counts, dtype=torch.float64, device=query.device))
        out, alpha = depth_read(
            torch.stack(values), torch.stack(keys), query,
            bias=bias, scale=self.scale, key_norm=False, heads=self.heads, return_weights=True,
        )
        if state.weights is not None:
            state.weights.append(alpha.detach().float())
        return out
