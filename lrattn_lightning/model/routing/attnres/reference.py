"""Attention residuals (AttnRes, LR-AttnRes; docs/method.md §2-3): the parameters, and the readable `reference` backend.

A decoder with L layers has M = 2L residual-writing sublayers. o_0 is the embedding, o_i what sublayer i
writes. Read site j (0..2L) forms the hidden state that feeds sublayer j+1 (site 2L feeds the final
norm and the head). Site j >= 1 owns a pseudo-query q_j and reads

    k_s      = RMSNorm(key_s)                      per depth head, parameter-free (key_norm: rms)
    logit_s  = scale * <q_j, k_s> + beta * log(c_s)  c_s: outputs summarised by source s
    alpha_j  = softmax_s(logit)                     over sources s in S_j, in the compute dtype
    h_j      = sum_s alpha_{j,s} v_s                values are always the full d-dim sources

Full routing: S_j = {o_0 .. o_j}. Block routing: S_j = {o_0, completed block summaries, the partial block
if non-empty}; a summary over c outputs has value (sum o_i) / c^a, or sum_i RMS(o_i) once the block is complete
(block_summary rms: summary.py). Keys: keys.py. The formulas themselves (rstd, logits, summaries): _math.py.
Every RMSNorm is parameter-free with torch's default eps. With depth_head_norm full the key norm spans the
whole key once per source (MHAR) instead of each head's slice; with key_gain site j's normalised keys are
scaled by a learned gamma_j (init 1), folded into the query: <q_j, gamma_j * k> = <gamma_j * q_j, k>.

The query of site j: q_j (query: static), or q_j + g_j * q_dyn (query: gated_dynamic), q_dyn what the
most recent sublayer (written just before site j) emits in r extra output rows, g_j a zero-initialised
gate per depth head; RMS-normalised per depth head with query_norm; then times gamma_j with key_gain.

`AttnResRouter` holds what every backend shares (parameters, init, queries, block ends); the backends
(`reference` here, `fast` in fast.py, `compiled` in compiled.py) subclass it with their
own state and read/write code, and give the same results.

Shape legend (docs/method.md letters): M = 2L sublayers, S sources, B batch, T tokens, D = d_model,
r = key width (the rank; d for key_source value), m = depth heads, k = r/m, e = D/m.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import (
    PartialBlock,
    compute_dtype,
    count_prior,
    head_rms_norm,
    logits,
    rms_norm,
)
from lrattn_lightning.model.routing.attnres.keys import key_source
from lrattn_lightning.model.routing.attnres.options import key_dim, logit_scale
from lrattn_lightning.model.routing.attnres.summary import RmsPartialBlock
from lrattn_lightning.model.routing.router import Router


class AttnResRouter(Router):
    """The parameters of AttnRes routing (queries, query gates, key-source parameters) and their rules."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s, a = cfg.size, cfg.options
        self.d, self.n_sublayers, self.std = s.d_model, s.n_sublayers, s.init_std
        self.rank = key_dim(cfg)
        self.heads = a.depth_heads
        self.scale = logit_scale(cfg)
        self.key_norm = a.key_norm == "rms"
        self.norm_groups = a.norm_groups  # the key norm's slices: m (per head) or 1 (the whole key)
        self.full_norm = self.norm_groups != self.heads  # (m = 1: the two are one)
        self.has_key_gain = a.key_gain  # the parameter `key_gain` (keys.py)
        self.rms_summary = a.block_summary == "rms"
        self.query_norm = a.query_norm
        self.query_init = a.query_init
        self.dynamic_query = a.query == "gated_dynamic"
        self.count_prior = float(a.count_prior)
        self.ends = frozenset(cfg.block_ends() or range(1, s.n_sublayers + 1))  # full: every output a block
        self.queries = nn.Parameter(torch.zeros(self.n_sublayers, self.rank))  # site j uses row j-1
        if self.dynamic_query:
            self.query_gates = nn.Parameter(torch.zeros(self.n_sublayers, self.heads))  # g_j per depth head
        self.key_source = key_source(cfg)
        self.key_source.register(self)

    def reset_parameters(self) -> None:
        """docs/method.md init: queries zero (or N(0, std)), query gates zero, key gains one, every other key-source
        parameter N(0, std)."""
        if self.query_init == "zero":
            nn.init.zeros_(self.queries)
        else:
            nn.init.normal_(self.queries, std=self.std)
        for name, p in self.named_parameters():
            if name == "query_gates":
                nn.init.zeros_(p)
            elif name == "key_gain":
                nn.init.ones_(p)
            elif name != "queries":
                nn.init.normal_(p, std=self.std)

    def new_partial(self) -> PartialBlock:
        """An empty running block (rms summaries also sum the normalised outputs)."""
        return RmsPartialBlock() if self.rms_summary else PartialBlock()

    def completed(self, block: PartialBlock) -> tuple[Tensor, Tensor]:
        """(summary value, raw key) of a block that has just completed (a partial block's: key_source.summary)."""
        return self.key_source.summary(block.completed() if self.rms_summary else block)

    def split_output(self, out_BTE: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """A sublayer's output rows -> value [.., D], emitted key [.., r] (P-LR, normalised) or None, and the
        dynamic query's rows [.., r] or None."""
        query_BTr = out_BTE[..., -self.rank :] if self.dynamic_query else None
        return out_BTE[..., : self.d], self.key_source.emitted(out_BTE), query_BTr

    def site_query(self, queries_Jr: Tensor, j: int, dynamic_BTr: Tensor | None = None) -> Tensor:
        """Site j's query: [r] static, or [B, T, r] with the gated dynamic query; query-normed if set."""
        query = queries_Jr[j - 1]
        if self.dynamic_query:
            m = self.heads
            gate_m1 = self.query_gates[j - 1].view(m, 1)
            query = (query.view(m, -1) + gate_m1 * dynamic_BTr.unflatten(-1, (m, -1))).flatten(-2)
        if self.query_norm:
            query = head_rms_norm(query.to(compute_dtype(query.dtype)), self.heads)
        if self.has_key_gain:
            query = query * self.key_gain[j - 1]
        return query

    def static_queries(self) -> Tensor:
        """Every site's static query [J, r] (site j in row j - 1) as `site_query` forms it."""
        queries = self.queries
        if self.query_norm:
            queries = head_rms_norm(queries.to(compute_dtype(queries.dtype)), self.heads)
        if self.has_key_gain:
            queries = queries * self.key_gain
        return queries


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

    values [S, B, T, D], keys [S, B, T, r], query [r] or [m, k] (static) or [B, T, r] (per token),
    bias [S] or None -> [B, T, D] (and the weights alpha [S, B, T, m] in the compute dtype when
    return_weights). Logits and softmax in compute_dtype(values.dtype).
    """
    S, B, T, D = values.shape
    r = keys.shape[-1]
    if r % heads or D % heads:
        raise InputError(f"key width {r} and value width {D} must be divisible by heads={heads}")
    cdtype = compute_dtype(values.dtype)
    keys_SBTmk = keys.to(cdtype).unflatten(-1, (heads, r // heads))
    if key_norm:
        keys_SBTmk = rms_norm(keys_SBTmk)
    if query.dim() == 3:  # per token: [B, T, r]
        query_BTmk = query.to(cdtype).unflatten(-1, (heads, r // heads))
        dots_SBTm = torch.einsum("sbtmk,btmk->sbtm", keys_SBTmk, query_BTmk)
    else:
        query_mk = query.to(cdtype).reshape(heads, r // heads)
        dots_SBTm = torch.einsum("sbtmk,mk->sbtm", keys_SBTmk, query_mk)
    prior = 0.0 if bias is None else bias.to(cdtype).view(S, 1, 1, 1)
    alpha_SBTm = logits(dots_SBTm, scale=scale, prior=prior).softmax(dim=0)
    values_SBTme = values.unflatten(-1, (heads, D // heads))
    out_BTD = torch.einsum("sbtm,sbtme->btme", alpha_SBTm.to(values.dtype), values_SBTme).flatten(-2)
    return (out_BTD, alpha_SBTm) if return_weights else out_BTD


@dataclass
class ReferenceState:
    """What one forward pass has written so far (reference backend)."""

    values: list[Tensor] = field(default_factory=list)  # completed sources [B, T, D]
    keys: list[Tensor] = field(default_factory=list)  # their keys, already normalised [B, T, r]
    counts: list[int] = field(default_factory=list)  # outputs each completed source summarises
    partial: PartialBlock = field(default_factory=PartialBlock)
    dynamic_query: Tensor | None = None  # gated dynamic query: what the last written sublayer emitted
    weights: list[Tensor] | None = None  # per site j = 1..2L when recording: alpha [S_j, B, T, m]


class ReferenceAttnRes(AttnResRouter):
    """The readable backend: stacks the sources at every read and calls `depth_read`."""

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> ReferenceState:
        state = ReferenceState(partial=self.new_partial(), weights=[] if record else None)  # (traceable)
        state.values.append(emb_BTD)
        state.keys.append(self._norm_key(self.key_source.embedding(emb_BTD)))
        state.counts.append(1)
        return state

    def write(self, state: ReferenceState, i: int, out_BTE: Tensor) -> None:
        """Record sublayer i's raw output ([B, T, D], or [B, T, D + extra rows] for P-LR / dynamic query)."""
        value_BTD, key_BTr, state.dynamic_query = self.split_output(out_BTE)
        state.partial.add(value_BTD, key_BTr, i)
        if i in self.ends:  # the block is complete
            value, key = self.completed(state.partial)
            state.values.append(value)
            state.keys.append(self._norm_key(key))
            state.counts.append(state.partial.count)
            state.partial.clear()

    def read(self, state: ReferenceState, j: int) -> Tensor:
        """Hidden state at read site j (0..2L) -> [B, T, D]."""
        if j == 0:
            return state.values[0]
        values, keys, counts = list(state.values), list(state.keys), list(state.counts)
        if state.partial.count:
            value, key = self.key_source.summary(state.partial)
            values.append(value)
            keys.append(self._norm_key(key))
            counts.append(state.partial.count)
        query = self.site_query(self.queries, j, state.dynamic_query)
        bias = None
        if self.count_prior != 0.0:
            bias = torch.tensor([count_prior(self.count_prior, c) for c in counts], dtype=torch.float64,
                                device=query.device)
        out, alpha = depth_read(
            torch.stack(values), torch.stack(keys), query,
            bias=bias, scale=self.scale, key_norm=False, heads=self.heads, return_weights=True,
        )
        if state.weights is not None:
            state.weights.append(alpha.detach().float())
        return out

    def _norm_key(self, key_BTr: Tensor) -> Tensor:
        """The read's key norm, per depth head (or over the whole key), in the routing's compute dtype."""
        key_BTr = key_BTr.to(compute_dtype(key_BTr.dtype))
        return head_rms_norm(key_BTr, self.norm_groups) if self.key_norm else key_BTr
