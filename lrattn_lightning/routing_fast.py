"""Depth routing, the fast path: the same parameters and results as `routing.DepthRouter`, less memory traffic.

The math is the reference's (routing.py); only the order of work changes. Two ideas:

1. Two-phase block routing (AttnRes report). The read sites between two block ends form a *group*:
   they all see the same completed sources C (embedding + finished block summaries). Phase 1 runs once
   per group, when the group's first site is read: the logits of all G queries of the group against C
   in one matmul, a float32 softmax over C, and the weighted sums for all G sites in one bmm:

       out_C[g] = sum_{s in C} alpha_{g,s} v_s        lse_C[g] = logsumexp_{s in C} logit_{g,s}

   Phase 2, at each site j of the group, merges the partial block source p (if non-empty) by an
   online-softmax update, which is the same softmax over C + {p}:

       w_p = sigmoid(l_p - lse_C)      h_j = out_C + w_p (v_p - out_C)      (per depth head)

   Full routing is block routing with one sublayer per block: the partial source is always empty at a
   read, every group has one site, and phase 2 is the identity.

2. Completed sources live in buffers preallocated at `start` (values token-major [BT, S_max, D] for
   the bmm, normalised keys source-major [S_max, BT, R] for the logits matmul), written once when a
   block completes: no stacking or copying of the growing source list at each read, keys normalised
   once. The buffers are outside autograd: `_StoreSource` writes a source and returns a dependency
   token, `_GroupRead` reads the buffers and in backward accumulates the source gradients into
   gradient buffers of the same shape; `_StoreSource.backward`, which autograd runs after every read
   of that source (the tokens order it), hands the accumulated gradient to the source, through the
   key normalisation. Saved for backward: the buffers once, the float32 weights alpha, nothing per site.

Under torch.compile the buffers and autograd Functions are replaced by plain tensor ops on the list of
sources (`_group_read_functional`), which Inductor fuses; the two-phase structure stays.

Shape legend: S sources, G sites of a group, B batch, T tokens (N = B*T), D = d_model,
R = key width r, M = depth heads, r = R/M, dh = D/M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrattn_lightning.config import ModelConfig
from lrattn_lightning.routing import RMS_EPS, DepthRouter, RoutingState, head_rms_norm


class _SourceBuffers:
    """The completed sources of one forward pass, outside autograd (see the module docstring)."""

    def __init__(self, n_max: int, N: int, D: int, R: int, heads: int, value_dtype: torch.dtype,
                 key_dtype: torch.dtype, device: torch.device, *, key_norm: bool, key_from_value: str | None):
        self.values_NSD = torch.empty(N, n_max, D, dtype=value_dtype, device=device)  # token-major, for bmm
        self.keys_SNR = torch.empty(n_max, N, R, dtype=key_dtype, device=device)  # normalised, source-major
        # raw keys that are not a slice of the value (P-LR / value_projected): kept for the norm's backward
        self.raw_keys_SNR = None if key_from_value or not key_norm else torch.empty_like(self.keys_SNR)
        self.counts: list[int] = []
        self.heads, self.key_norm, self.key_from_value = heads, key_norm, key_from_value
        # float32 gradient accumulators, source-major, allocated by the first backward
        self.grad_values_SND: Tensor | None = None
        self.grad_keys_SNR: Tensor | None = None

    def raw_key(self, s: int) -> Tensor:
        """Source s's key before normalisation, [N, R]."""
        if self.key_from_value == "value":
            return self.values_NSD[:, s]
        if self.key_from_value == "sliced":
            return self.values_NSD[:, s, -self.keys_SNR.shape[-1] :]
        return self.raw_keys_SNR[s]

    def grad_buffers(self) -> tuple[Tensor, Tensor]:
        if self.grad_values_SND is None:
            N, S, D = self.values_NSD.shape
            self.grad_values_SND = self.values_NSD.new_zeros((S, N, D), dtype=torch.float32)
            self.grad_keys_SNR = self.keys_SNR.new_zeros(self.keys_SNR.shape, dtype=torch.float32)
        return self.grad_values_SND, self.grad_keys_SNR


def _rms_norm_backward(grad_y: Tensor, x: Tensor, heads: int) -> Tensor:
    """d/dx of RMSNorm(x) per head, float32: rstd (dy - y mean(dy y)), y = x rstd. [N, R] -> [N, R]."""
    x = x.float().unflatten(-1, (heads, -1))
    grad_y = grad_y.unflatten(-1, (heads, -1))
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)
    y = x * rstd
    return (rstd * (grad_y - y * (grad_y * y).mean(-1, keepdim=True))).flatten(-2)


class _StoreSource(torch.autograd.Function):
    """Write completed source s (value [B, T, D], raw key [B, T, R] or None) into the buffers -> a token.

    Backward hands source s the gradient the reads accumulated for it (and its key's, through the norm).
    """

    @staticmethod
    def forward(ctx, value_BTD: Tensor, key_BTR: Tensor | None, buffers: _SourceBuffers) -> Tensor:
        s = len(buffers.counts)
        N, D = buffers.values_NSD.shape[0], buffers.values_NSD.shape[-1]
        buffers.values_NSD[:, s].copy_(value_BTD.reshape(N, D))
        raw_NR = buffers.raw_key(s) if key_BTR is None else key_BTR.reshape(N, -1)
        if buffers.raw_keys_SNR is not None:
            buffers.raw_keys_SNR[s].copy_(raw_NR)
        buffers.keys_SNR[s].copy_(head_rms_norm(raw_NR, buffers.heads) if buffers.key_norm else raw_NR)
        ctx.buffers, ctx.s = buffers, s
        ctx.value_meta = (value_BTD.shape, value_BTD.dtype)
        ctx.key_meta = None if key_BTR is None else (key_BTR.shape, key_BTR.dtype)
        return value_BTD.new_empty(())

    @staticmethod
    def backward(ctx, _grad_token: Tensor | None):
        buffers, s = ctx.buffers, ctx.s
        (v_shape, v_dtype), R = ctx.value_meta, buffers.keys_SNR.shape[-1]
        grad_values_SND, grad_keys_SNR = buffers.grad_buffers()
        grad_v, grad_k = grad_values_SND[s], grad_keys_SNR[s]  # no read touches row s after this
        if buffers.key_norm:
            grad_k = _rms_norm_backward(grad_k, buffers.raw_key(s), buffers.heads)
        grad_key = None
        if ctx.key_meta is not None:
            k_shape, k_dtype = ctx.key_meta
            grad_key = grad_k.to(k_dtype).view(k_shape)
        elif buffers.key_from_value == "value":
            grad_v += grad_k
        else:  # sliced: the key is the last R dims of the value
            grad_v[:, -R:] += grad_k
        return grad_v.to(v_dtype).view(v_shape), grad_key, None


class _GroupRead(torch.autograd.Function):
    """Phase 1 of a group: queries [G, R] against the S completed sources in the buffers.

    -> out_g [N, D] (value dtype) for g < G, then lse_g [N, M] (float32) for g < G, then alpha
    [S, N, M, G] (float32, not differentiable). The sources' tokens are inputs only so that autograd
    runs this backward before `_StoreSource.backward` of every source read here.
    """

    @staticmethod
    def forward(ctx, queries_GR: Tensor, buffers: _SourceBuffers, S: int, scale: float, bias: Tensor | None, *tokens: Tensor):
        ctx.set_materialize_grads(False)
        M, G = buffers.heads, queries_GR.shape[0]
        keys_SNR = buffers.keys_SNR[:S]
        _, N, R = keys_SNR.shape
        values_NSD = buffers.values_NSD[:, :S]
        D = values_NSD.shape[-1]
        q_MrG = queries_GR.float().view(G, M, R // M).permute(1, 2, 0)
        if M == 1:
            logits = (keys_SNR.reshape(S * N, R).float() @ q_MrG[0]).view(S, N, 1, G)
        else:
            k_MnR = keys_SNR.reshape(S * N, M, R // M).float().transpose(0, 1)
            logits = torch.bmm(k_MnR, q_MrG).permute(1, 0, 2).reshape(S, N, M, G)
        if scale != 1.0:
            logits = logits * scale
        if bias is not None:
            logits = logits + bias.view(S, 1, 1, 1)
        lse_NMG = torch.logsumexp(logits, dim=0)
        alpha_SNMG = torch.exp(logits - lse_NMG)
        weights = alpha_SNMG.to(values_NSD.dtype)
        if S == 1:  # a softmax over one source: alpha = 1, every site reads the embedding
            out_NGD = values_NSD.expand(N, G, D).clone()
        elif M == 1:  # [N, G, S] @ [N, S, D]
            out_NGD = torch.bmm(weights.view(S, N, G).permute(1, 2, 0).contiguous(), values_NSD)
        else:  # [N, M, G, S] @ [N, M, S, dh] -> [N, M, G, dh]; the rare multi-head case pays a copy
            v_NMSd = values_NSD.unflatten(-1, (M, D // M)).transpose(1, 2)
            out_NGD = torch.matmul(weights.permute(1, 2, 3, 0), v_NMSd).permute(0, 2, 1, 3).reshape(N, G, D)
        ctx.save_for_backward(queries_GR, alpha_SNMG)
        ctx.buffers, ctx.S, ctx.scale, ctx.n_tokens = buffers, S, scale, len(tokens)
        ctx.mark_non_differentiable(alpha_SNMG)
        return (*out_NGD.unbind(1), *lse_NMG.unbind(-1), alpha_SNMG)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        queries_GR, alpha_SNMG = ctx.saved_tensors
        buffers, S, scale = ctx.buffers, ctx.S, ctx.scale
        grad_values_SND, grad_keys_SNR = buffers.grad_buffers()
        M, G = buffers.heads, queries_GR.shape[0]
        values_NSD = buffers.values_NSD[:, :S]
        N, _, D = values_NSD.shape
        R = buffers.keys_SNR.shape[-1]
        zeros_ND = None
        grad_out = []
        for g in grads[:G]:
            if g is None:
                zeros_ND = values_NSD.new_zeros(N, D) if zeros_ND is None else zeros_ND
                g = zeros_ND
            grad_out.append(g.to(values_NSD.dtype))
        gout_NGD = grad_out[0].unsqueeze(1) if G == 1 else torch.stack(grad_out, dim=1)
        weights_SNMG = alpha_SNMG.to(values_NSD.dtype)
        if S == 1:  # alpha = 1: no gradient through the softmax weights
            grad_alpha_SNMG = alpha_SNMG.new_zeros(())
            grad_values_SND[0] += gout_NGD.sum(1)
        elif M == 1:
            grad_alpha_SNMG = torch.bmm(gout_NGD, values_NSD.transpose(1, 2)).float().permute(2, 0, 1).unsqueeze(2)
            for g, gout in enumerate(grad_out):  # grad v_s += alpha_{g,s} grad out_g, in place
                grad_values_SND[:S].addcmul_(weights_SNMG[:, :, 0, g, None], gout)
        else:
            v_NMSd = values_NSD.unflatten(-1, (M, D // M)).transpose(1, 2)
            gout_NMGd = gout_NGD.view(N, G, M, D // M).transpose(1, 2)
            grad_alpha_SNMG = torch.matmul(gout_NMGd, v_NMSd.transpose(-1, -2)).float().permute(3, 0, 1, 2)
            grad_v = torch.matmul(weights_SNMG.permute(1, 2, 0, 3), gout_NMGd)  # [N, M, S, dh]
            grad_values_SND[:S] += grad_v.permute(2, 0, 1, 3).reshape(S, N, D)
        # softmax backward, plus the lse outputs' gradient (d lse / d logit = alpha)
        grad_logits = grad_alpha_SNMG - (alpha_SNMG * grad_alpha_SNMG).sum(0)
        grad_lse = [g for g in grads[G : 2 * G]]
        if any(g is not None for g in grad_lse):
            zeros_NM = alpha_SNMG.new_zeros(N, M)
            grad_logits = grad_logits + torch.stack([zeros_NM if g is None else g for g in grad_lse], dim=-1)
        grad_logits = grad_logits * alpha_SNMG
        if scale != 1.0:
            grad_logits = grad_logits * scale
        keys_SNR = buffers.keys_SNR[:S]
        q = queries_GR.float()
        if M == 1:
            gl = grad_logits.reshape(S * N, G)
            grad_q = gl.t() @ keys_SNR.reshape(S * N, R).float()
            grad_keys_SNR[:S].view(S * N, R).addmm_(gl, q)
        else:
            r = R // M
            gl_MnG = grad_logits.reshape(S * N, M, G).transpose(0, 1)
            k_MnR = keys_SNR.reshape(S * N, M, r).float().transpose(0, 1)
            grad_q = torch.bmm(gl_MnG.transpose(1, 2), k_MnR).transpose(0, 1).reshape(G, R)
            grad_k = torch.bmm(gl_MnG, q.view(G, M, r).transpose(0, 1))  # [M, S*N, r]
            grad_keys_SNR[:S] += grad_k.transpose(0, 1).reshape(S, N, R)
        return (grad_q.to(queries_GR.dtype), None, None, None, None, *([None] * ctx.n_tokens))


@dataclass
class FastRoutingState(RoutingState):
    """RoutingState plus the fast path's buffers and the current group's phase-1 results."""

    embedding: Tensor | None = None  # site 0 reads it unchanged
    buffers: _SourceBuffers | None = None
    tokens: list[Tensor] = field(default_factory=list)
    group: int = -1
    group_out: list[Tensor] = field(default_factory=list)  # per site g of the group: [N, D]
    group_lse: list[Tensor] = field(default_factory=list)  # per site g: [N, M] float32
    group_alpha: Tensor | None = None  # [S, N, M, G] float32, detached
    shape: tuple[int, int, int] = (0, 0, 0)  # B, T, D


class FastDepthRouter(DepthRouter):
    """DepthRouter with the two-phase, buffered read (module docstring); parameters are the reference's.

    Residual and gated routing keep the reference code (a plain add and the gate).
    """

    def __init__(self, cfg: ModelConfig, *, functional: bool | None = None):
        super().__init__(cfg)
        # functional: None picks the buffered autograd Functions in eager mode and plain ops under
        # torch.compile; True/False forces one (the parity tests run both in eager mode).
        self.functional = functional
        if self.kind != "attnres":
            return
        M = self.n_sublayers
        ends = cfg.block_ends() or list(range(1, M + 1))  # full routing: every sublayer is a block
        self.ends = frozenset(ends)
        self.n_completed_max = 1 + len(ends)
        bounds = [0, *ends]
        self.group_sites: list[list[int]] = []
        self.site_group: dict[int, tuple[int, int]] = {}  # j -> (group k, index g in the group)
        for k in range(len(bounds)):
            hi = bounds[k + 1] if k + 1 < len(bounds) else M + 1
            sites = list(range(max(bounds[k], 1), hi))
            self.group_sites.append(sites)
            for g, j in enumerate(sites):
                self.site_group[j] = (k, g)
        self.key_from_value = None if self.carries_keys else self.key_source  # "value" | "sliced" | None
        self.source_counts = [1] + [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def _use_functional(self) -> bool:
        if self.functional is not None:
            return self.functional
        return torch.compiler.is_compiling()

    # ---- the forward-pass protocol ----------------------------------------------------------------
    def start(self, emb_BTD: Tensor, record: bool = False) -> RoutingState:
        if self.kind != "attnres":
            return super().start(emb_BTD, record)
        state = FastRoutingState(weights=[] if record else None)
        B, T, D = emb_BTD.shape
        state.shape, state.embedding = (B, T, D), emb_BTD
        key_BTR = self._embedding_key(emb_BTD) if self.carries_keys else None
        if self._use_functional():
            self._store_functional(state, emb_BTD, key_BTR, 1)
        else:
            key_dtype = emb_BTD.dtype if key_BTR is None else key_BTR.dtype
            state.buffers = _SourceBuffers(
                self.n_completed_max, B * T, D, self.rank, self.heads, emb_BTD.dtype, key_dtype, emb_BTD.device,
                key_norm=self.key_norm, key_from_value=self.key_from_value,
            )
            self._store(state, emb_BTD, key_BTR, 1)
        return state

    def write(self, state: RoutingState, i: int, out_BTE: Tensor) -> None:
        if self.kind != "attnres":
            return super().write(state, i, out_BTE)
        value_BTD = out_BTE[..., : self.d]
        key_BTR = None
        if self.key_source == "projected":
            key_BTR = out_BTE[..., self.d :]
        elif self.carries_keys:
            key_BTR = self._projected_value_key(value_BTD, i)
        if state.partial_count == 0:
            state.partial_value, state.partial_key = value_BTD, key_BTR
        else:
            state.partial_value = state.partial_value + value_BTD
            if key_BTR is not None:
                state.partial_key = state.partial_key + key_BTR
        state.partial_count += 1
        if i in self.ends:
            c = state.partial_count
            value = self._summary(state.partial_value, c) if c > 1 else state.partial_value
            key = None
            if self.carries_keys:
                key = self._summary(state.partial_key, c) if c > 1 else state.partial_key
            if self._use_functional():
                self._store_functional(state, value, key, c)
            else:
                self._store(state, value, key, c)
            state.partial_value, state.partial_key, state.partial_count = None, None, 0

    def read(self, state: RoutingState, j: int) -> Tensor:
        if self.kind != "attnres":
            return super().read(state, j)
        if j == 0:
            return state.embedding
        k, g = self.site_group[j]
        if state.group != k:
            self._phase_one(state, k)
        B, T, D = state.shape
        N, M = B * T, self.heads
        out_ND = state.group_out[g]
        alpha_SNM = state.group_alpha[..., g]
        if state.partial_count == 0:
            h_BTD = out_ND.view(B, T, D)
            if state.weights is not None:
                state.weights.append(alpha_SNM.detach().view(-1, B, T, M))
            return h_BTD
        # phase 2: merge the partial block p into the group's softmax (online-softmax update)
        c = state.partial_count
        v_p = self._summary(state.partial_value, c)
        key = self._summary(state.partial_key, c) if self.carries_keys else self._value_key(v_p)
        k_p = self._norm_key(key).reshape(N, M, self.rank // M).float()
        q = self._queries(j, j)[0].float().view(M, -1)
        logit_NM = (k_p * q).sum(-1) * self.scale
        if self.count_prior != 0.0:
            logit_NM = logit_NM + self.count_prior * math.log(c)
        w_NM = torch.sigmoid(logit_NM - state.group_lse[g])
        h = torch.lerp(out_ND.view(N, M, D // M), v_p.reshape(N, M, D // M), w_NM.unsqueeze(-1).to(v_p.dtype))
        if state.weights is not None:
            w = w_NM.detach()
            alpha = torch.cat((alpha_SNM.detach() * (1 - w), w[None]))
            state.weights.append(alpha.view(-1, B, T, M))
        return h.view(B, T, D)

    # ---- helpers ------------------------------------------------------------------------------------
    def _queries(self, first: int, last: int) -> Tensor:
        """Queries of sites first..last (rows first-1..last-1), query-normed if configured -> [G, R]."""
        q = self.queries[first - 1 : last]
        return head_rms_norm(q, self.heads) if self.query_norm else q

    def _store(self, state: FastRoutingState, value: Tensor, key: Tensor | None, count: int) -> None:
        state.tokens.append(_StoreSource.apply(value, key, state.buffers))
        state.buffers.counts.append(count)

    def _store_functional(self, state: FastRoutingState, value: Tensor, key: Tensor | None, count: int) -> None:
        state.values.append(value)
        state.keys.append(self._norm_key(key if key is not None else self._value_key(value)))
        state.counts.append(count)

    def _phase_one(self, state: FastRoutingState, k: int) -> None:
        sites = self.group_sites[k]
        S = k + 1
        queries = self._queries(sites[0], sites[-1])
        bias = None
        if self.count_prior != 0.0:  # as the reference: beta * log(count) in float32
            counts = torch.tensor(self.source_counts[:S], dtype=torch.float32, device=queries.device)
            bias = self.count_prior * torch.log(counts)
        if self._use_functional():
            out, lse, alpha = self._group_read_functional(state, queries, S, bias)
        else:
            assert len(state.buffers.counts) == S, "sources are stored in block order"
            outputs = _GroupRead.apply(queries, state.buffers, S, self.scale, bias, *state.tokens)
            G = queries.shape[0]
            out, lse, alpha = outputs[:G], outputs[G : 2 * G], outputs[-1]
        state.group, state.group_out, state.group_lse, state.group_alpha = k, out, lse, alpha

    def _group_read_functional(self, state: FastRoutingState, queries_GR: Tensor, S: int, bias: Tensor | None):
        """Phase 1 in plain tensor ops (for torch.compile): same outputs as `_GroupRead`."""
        M, G = self.heads, queries_GR.shape[0]
        B, T, D = state.shape
        N = B * T
        keys_SNMr = torch.stack(state.keys[:S]).reshape(S, N, M, 1, -1).float()
        q_MGr = queries_GR.float().view(G, M, -1).transpose(0, 1)
        logits = (keys_SNMr * q_MGr).sum(-1) * self.scale  # [S, N, M, G]
        if bias is not None:
            logits = logits + bias.view(S, 1, 1, 1)
        lse_NMG = torch.logsumexp(logits, dim=0)
        alpha_SNMG = torch.exp(logits - lse_NMG)
        values_SNMd = torch.stack(state.values[:S]).reshape(S, N, M, 1, D // M)
        # float32 products and sum, as bmm accumulates; Inductor fuses the upcast (no float copy of values)
        weights = alpha_SNMG.to(values_SNMd.dtype).float().unsqueeze(-1)
        out = (weights * values_SNMd.float()).sum(0).to(values_SNMd.dtype)  # [N, M, G, dh]
        return out.transpose(1, 2).reshape(N, G, D).unbind(1), lse_NMG.unbind(-1), alpha_SNMG.detach()
