"""The `compiled` AttnRes backend: plain tensor ops for torch.compile, same parameters and results as `reference`.

Static queries: the logits of a source against every later site are computed when it is written,
scale * rstd(x) <x, q_j> + beta log c for all j at once ([N, m, J]; the normalised key is never
materialised). A read j takes column j - 1 of every completed source, adds the partial block's logit, and
forms one softmax over completed + partial sources and the weighted sum as a sum of terms (not a stacked
tensor): Inductor fuses it into one kernel, and autograd saves the sources themselves, which every site
shares, not a stack per site. The gated dynamic query (per token, known only at the read): each source
keeps its raw key and rstd, and the read takes the dot products with that site's query.

No autograd Functions and no buffers, so Dynamo traces it into one graph; it also runs eagerly (the parity
tests check it so). A key taken from a summary's value uses the summary eps rule (_math.py).

Shape legend (docs/method.md letters): S sources, J = 2L read sites, B batch, T tokens, N = B*T, D = d_model,
r = key width (the rank; d for key_source value), m = depth heads, k = r/m, e = D/m.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrattn_lightning.model.routing._math import (
    PartialBlock,
    compute_dtype,
    count_prior,
    logits,
    site_matmul,
)
from lrattn_lightning.model.routing.attnres.keys import key_rstd
from lrattn_lightning.model.routing.attnres.reference import AttnResRouter


@dataclass
class CompiledState:
    """One forward pass of the compiled backend."""

    embedding: Tensor  # site 0 reads it unchanged
    queries: Tensor  # [J, r], query-normed and gained if configured (static queries)
    shape: tuple[int, int, int]  # B, T, D
    values: list[Tensor] = field(default_factory=list)  # completed sources [B, T, D]
    logits: list[Tensor] = field(default_factory=list)  # static queries: per source [N, m, J]
    keys: list[tuple[Tensor, Tensor | None, float]] = field(default_factory=list)  # dynamic: (x [N, m, k], rstd, prior)
    partial: PartialBlock = field(default_factory=PartialBlock)
    dynamic_query: Tensor | None = None  # what the last written sublayer emitted [B, T, r]
    weights: list[Tensor] | None = None  # per site j = 1..2L when recording: alpha [S_j, B, T, m]


class CompiledAttnRes(AttnResRouter):
    """AttnRes in plain tensor ops (module docstring)."""

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> CompiledState:
        queries = self.queries if self.dynamic_query else self.static_queries()
        # (the PartialBlock is made here, not by a default factory, which Dynamo cannot trace)
        state = CompiledState(emb_BTD, queries, tuple(emb_BTD.shape), partial=self.new_partial(),
                              weights=[] if record else None)
        self._store(state, emb_BTD, self.key_source.embedding(emb_BTD), 1)
        return state

    def write(self, state: CompiledState, i: int, out_BTE: Tensor) -> None:
        value_BTD, key_BTr, state.dynamic_query = self.split_output(out_BTE)
        state.partial.add(value_BTD, key_BTr, i)
        if i in self.ends:  # the block is complete: summarise it once
            value, key = self.completed(state.partial)
            self._store(state, value, key, state.partial.count)
            state.partial.clear()

    def read(self, state: CompiledState, j: int) -> Tensor:
        if j == 0:
            return state.embedding
        B, T, D = state.shape
        N, m = B * T, self.heads
        values = list(state.values)
        query_Nmk = None
        if self.dynamic_query:
            query = self.site_query(self.queries, j, state.dynamic_query)
            query_Nmk = query.reshape(N, m, -1).to(compute_dtype(query.dtype))
            site_logits = [self._dynamic_logit(x, k, prior, query_Nmk) for x, k, prior in state.keys]
        else:
            site_logits = [x[..., j - 1] for x in state.logits]  # [N, m] each
        if state.partial.count:
            c = state.partial.count
            v_p, key = self.key_source.summary(state.partial)
            x_Nmk, rstd_Nm1 = self._key(v_p, key, c)
            prior = count_prior(self.count_prior, c)
            if query_Nmk is None:
                queries_1mk = state.queries[j - 1 : j].to(x_Nmk.dtype).unflatten(-1, (m, -1))
                site_logits.append(self._static_logits(x_Nmk, rstd_Nm1, queries_1mk, prior, partial=True)[..., 0])
            else:
                site_logits.append(self._dynamic_logit(x_Nmk, rstd_Nm1, prior, query_Nmk))
            values.append(v_p)
        alpha_SNm = torch.stack(site_logits).softmax(dim=0)
        cdtype = alpha_SNm.dtype
        weights = alpha_SNm.to(values[0].dtype).to(cdtype).unsqueeze(-1)  # rounded as bmm would use them
        out = None
        for s, v in enumerate(values):
            term = weights[s] * v.reshape(N, m, D // m).to(cdtype)
            out = term if out is None else out + term
        if state.weights is not None:
            state.weights.append(alpha_SNm.detach().view(-1, B, T, m).float())
        return out.to(values[0].dtype).view(B, T, D)

    # ---- sources ------------------------------------------------------------------------------------
    def _key(self, value_BTD: Tensor, key_BTr: Tensor, count: int) -> tuple[Tensor, Tensor | None]:
        """A source's raw key [N, m, k] in the compute dtype and its rstd [N, m, 1] (None without key norm).
        Value / sliced keys are read from the (summary) value, with the summary eps rule."""
        keys = self.key_source
        eps_factor = 1.0
        if not keys.carried:
            key_BTr, eps_factor = keys.from_value(value_BTD), keys.eps_factor(count)
        N = key_BTr.shape[0] * key_BTr.shape[1]
        x_Nmk = key_BTr.reshape(N, self.heads, -1).to(compute_dtype(key_BTr.dtype))
        return x_Nmk, (key_rstd(x_Nmk, eps_factor, self.full_norm) if self.key_norm else None)

    def _store(self, state: CompiledState, value: Tensor, key: Tensor, count: int) -> None:
        state.values.append(value)
        x_Nmk, rstd_Nm1 = self._key(value, key, count)
        prior = count_prior(self.count_prior, count)
        if self.dynamic_query:
            state.keys.append((x_Nmk, rstd_Nm1, prior))
            return
        queries_Jmk = state.queries.to(x_Nmk.dtype).unflatten(-1, (self.heads, -1))
        state.logits.append(self._static_logits(x_Nmk, rstd_Nm1, queries_Jmk, prior))

    def _static_logits(self, x_Nmk: Tensor, rstd_Nm1: Tensor | None, queries_Jmk: Tensor, prior: float,
                       partial: bool = False) -> Tensor:
        """A source's logits [N, m, J] against static queries [J, m, k]. The partial block's key against its
        one query, when carried (P-LR: the normalised emitted key of the block's first sublayer), is normalised
        first and dotted as a product and a sum, which Inductor fuses into one reduction: the backward then
        recomputes the key from the output rows it keeps anyway, where a matmul would make it save the key
        per read (compiled P-LR at `small`: 8 fewer [N, r] tensors saved, peak 240.4 -> 238.3 MB). A completed
        source keeps the matmul against all J queries (as a product-sum its backward is slower on CPU)."""
        if not (partial and self.key_source.carried):
            return logits(site_matmul(x_Nmk, queries_Jmk), rstd=rstd_Nm1, scale=self.scale, prior=prior)
        if rstd_Nm1 is not None:
            x_Nmk = x_Nmk * rstd_Nm1
        dots_Nm1 = (x_Nmk * queries_Jmk[0]).sum(-1, keepdim=True)
        return logits(dots_Nm1, scale=self.scale, prior=prior)

    def _dynamic_logit(self, x_Nmk: Tensor, rstd_Nm1: Tensor | None, prior: float, query_Nmk: Tensor) -> Tensor:
        """One source's logit [N, m] against a per-token query."""
        dots_Nm = (x_Nmk * query_Nmk).sum(-1)
        return logits(dots_Nm, rstd=None if rstd_Nm1 is None else rstd_Nm1[..., 0], scale=self.scale, prior=prior)
