"""The `compiled` AttnRes backend: plain tensor ops for torch.compile, same parameters and results as `reference`.

Static queries: the logits of a source against every later site are computed when it is written,
scale * rstd(x) <x, q_j> + beta log c for all j at once ([N, M, J]; the normalised key is never
materialised). A read j takes column j - 1 of every completed source, adds the partial block's logit, and
forms one softmax over completed + partial sources and the weighted sum as a sum of terms (not a stacked
tensor): Inductor fuses it into one kernel, and autograd saves the sources themselves, which every site
shares, not a stack per site. The gated dynamic query (per token, known only at the read): each source
keeps its raw key and rstd, and the read takes the dot products with that site's query.

No autograd Functions and no buffers, so Dynamo traces it into one graph; it also runs eagerly (the parity
tests check it so). A key taken from a summary's value uses the summary eps rule (_math.py).

Shape legend: S sources, J = 2L read sites, B batch, T tokens, N = B*T, D = d_model, R = key width r,
M = depth heads, r = R/M.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrattn_lightning.model.routing._math import (
    PartialBlock,
    compute_dtype,
    count_prior,
    head_rms_norm,
    logits,
    rstd,
    site_matmul,
)
from lrattn_lightning.model.routing.attnres import AttnResRouter


@dataclass
class CompiledState:
    """One forward pass of the compiled backend."""

    embedding: Tensor  # site 0 reads it unchanged
    queries: Tensor  # [J, R], query-normed if configured (static queries)
    shape: tuple[int, int, int]  # B, T, D
    values: list[Tensor] = field(default_factory=list)  # completed sources [B, T, D]
    logits: list[Tensor] = field(default_factory=list)  # static queries: per source [N, M, J]
    keys: list[tuple[Tensor, Tensor | None, float]] = field(default_factory=list)  # dynamic: (x [N, M, r], rstd, prior)
    partial: PartialBlock = field(default_factory=PartialBlock)
    dynamic_query: Tensor | None = None  # what the last written sublayer emitted [B, T, R]
    weights: list[Tensor] | None = None  # per site j = 1..2L when recording: alpha [S_j, B, T, M]


class CompiledAttnRes(AttnResRouter):
    """AttnRes in plain tensor ops (module docstring)."""

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None) -> CompiledState:
        queries = self.queries
        if self.query_norm and not self.dynamic_query:
            queries = head_rms_norm(queries.to(compute_dtype(queries.dtype)), self.heads)
        # (the PartialBlock is made here, not by a default factory, which Dynamo cannot trace)
        state = CompiledState(emb_BTD, queries, tuple(emb_BTD.shape), partial=PartialBlock(),
                              weights=[] if record else None)
        self._store(state, emb_BTD, self.key_source.embedding(emb_BTD), 1)
        return state

    def write(self, state: CompiledState, i: int, out_BTE: Tensor) -> None:
        value_BTD, key_BTR, state.dynamic_query = self.split_output(out_BTE)
        state.partial.add(value_BTD, key_BTR, i)
        if i in self.ends:  # the block is complete: summarise it once
            value, key = self.key_source.summary(state.partial)
            self._store(state, value, key, state.partial.count)
            state.partial.clear()

    def read(self, state: CompiledState, j: int) -> Tensor:
        if j == 0:
            return state.embedding
        B, T, D = state.shape
        N, M = B * T, self.heads
        values = list(state.values)
        query_NMr = None
        if self.dynamic_query:
            query = self.site_query(self.queries, j, state.dynamic_query)
            query_NMr = query.reshape(N, M, -1).to(compute_dtype(query.dtype))
            site_logits = [self._dynamic_logit(x, r, prior, query_NMr) for x, r, prior in state.keys]
        else:
            site_logits = [x[..., j - 1] for x in state.logits]  # [N, M] each
        if state.partial.count:
            c = state.partial.count
            v_p, key = self.key_source.summary(state.partial)
            x_NMr, rstd_NM1 = self._key(v_p, key, c)
            prior = count_prior(self.count_prior, c)
            if query_NMr is None:
                dots_NM1 = site_matmul(x_NMr, state.queries[j - 1 : j].to(x_NMr.dtype).unflatten(-1, (M, -1)))
                site_logits.append(logits(dots_NM1, rstd=rstd_NM1, scale=self.scale, prior=prior)[..., 0])
            else:
                site_logits.append(self._dynamic_logit(x_NMr, rstd_NM1, prior, query_NMr))
            values.append(v_p)
        alpha_SNM = torch.stack(site_logits).softmax(dim=0)
        cdtype = alpha_SNM.dtype
        weights = alpha_SNM.to(values[0].dtype).to(cdtype).unsqueeze(-1)  # rounded as bmm would use them
        out = None
        for s, v in enumerate(values):
            term = weights[s] * v.reshape(N, M, D // M).to(cdtype)
            out = term if out is None else out + term
        if state.weights is not None:
            state.weights.append(alpha_SNM.detach().view(-1, B, T, M).float())
        return out.to(values[0].dtype).view(B, T, D)

    # ---- sources ------------------------------------------------------------------------------------
    def _key(self, value_BTD: Tensor, key_BTR: Tensor, count: int) -> tuple[Tensor, Tensor | None]:
        """A source's raw key [N, M, r] in the compute dtype and its rstd [N, M, 1] (None without key norm).
        Value / sliced keys are read from the (summary) value, with the summary eps rule."""
        keys = self.key_source
        eps_factor = 1.0
        if not keys.carried:
            key_BTR, eps_factor = keys.from_value(value_BTD), keys.eps_factor(count)
        N = key_BTR.shape[0] * key_BTR.shape[1]
        x_NMr = key_BTR.reshape(N, self.heads, -1).to(compute_dtype(key_BTR.dtype))
        return x_NMr, (rstd(x_NMr, eps_factor) if self.key_norm else None)

    def _store(self, state: CompiledState, value: Tensor, key: Tensor, count: int) -> None:
        state.values.append(value)
        x_NMr, rstd_NM1 = self._key(value, key, count)
        prior = count_prior(self.count_prior, count)
        if self.dynamic_query:
            state.keys.append((x_NMr, rstd_NM1, prior))
            return
        queries_JMr = state.queries.to(x_NMr.dtype).unflatten(-1, (self.heads, -1))
        state.logits.append(logits(site_matmul(x_NMr, queries_JMr), rstd=rstd_NM1, scale=self.scale, prior=prior))

    def _dynamic_logit(self, x_NMr: Tensor, rstd_NM1: Tensor | None, prior: float, query_NMr: Tensor) -> Tensor:
        """One source's logit [N, M] against a per-token query."""
        dots_NM = (x_NMr * query_NMr).sum(-1)
        return logits(dots_NM, rstd=None if rstd_NM1 is None else rstd_NM1[..., 0], scale=self.scale, prior=prior)
