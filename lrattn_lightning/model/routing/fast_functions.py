"""The `fast` backend's machinery: per-pass source buffers outside autograd, and the autograd Functions
that write sources (`_StoreSource`), read a group of sites (`_GroupRead`) and merge a partial block
(`_PartialRead`). What they compute and why: attnres_fast.py. The logits, rstd and the priors come from
_math.py; the keys from the router's key source.

Shape legend: S sources, J = 2L read sites with queries (site j is column j-1), G sites of a group,
B batch, T tokens, N = B*T, D = d_model, R = key width r, M = depth heads, r = R/M, dh = D/M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lrattn_lightning.model.routing._math import compute_dtype, count_prior, logits, rstd, site_matmul
from lrattn_lightning.model.routing.keys import KeySource


@dataclass
class Plan:
    """What a forward pass needs to know about the routing, fixed at construction."""

    heads: int
    rank: int
    scale: float
    key_norm: bool
    keys: KeySource
    first_column: list[int]  # per source: the column (site - 1) of the first site that reads it
    counts: list[int]  # per source: the outputs it summarises
    prior: list[float]  # per source: beta * log(count) (all 0 without a count prior)
    count_prior: float = 0.0  # beta


class SourceBuffers:
    """The completed sources of one forward pass, outside autograd (see the module docstring)."""

    def __init__(self, plan: Plan, n_sources: int, n_sites: int, N: int, D: int, value_dtype: torch.dtype,
                 key_dtype: torch.dtype, device: torch.device):
        M, R = plan.heads, plan.rank
        self.plan = plan
        self.cdtype = cdtype = compute_dtype(value_dtype)
        self.values_SND = torch.empty(n_sources, N, D, dtype=value_dtype, device=device)
        self.logits_SNMJ = torch.empty(n_sources, N, M, n_sites, dtype=cdtype, device=device)
        # carried keys (P-LR / value_projected) are not a view of the value: keep the raw key for backward
        self.raw_keys_SNR = None
        if plan.keys.carried:
            self.raw_keys_SNR = torch.empty(n_sources, N, R, dtype=key_dtype, device=device)
        self.rstd_SNM1 = torch.empty(n_sources, N, M, 1, dtype=cdtype, device=device) if plan.key_norm else None
        self.n_stored = 0
        # float32 gradient accumulators, allocated by the first backward. Rows >= grad_rows have not
        # been written yet: a read's backward writes them instead of adding (no zero-fill pass).
        self.grad_values_SND: Tensor | None = None
        self.grad_rows = 0
        self.grad_logits_SNMJ: Tensor | None = None
        # (group, site index) -> grad of that site's softmax weights over the group's sources [S, N, M],
        # left by `PartialRead.backward`, which needs the same bmm, for `GroupRead.backward`
        self.grad_alpha_stash: dict[tuple[int, int], Tensor] = {}

    def raw_key(self, s: int) -> Tensor:
        """Source s's key before normalisation, [N, R]."""
        if self.plan.keys.carried:
            return self.raw_keys_SNR[s]
        return self.plan.keys.from_value(self.values_SND[s])

    def grad_buffers(self) -> tuple[Tensor, Tensor]:
        if self.grad_values_SND is None:
            self.grad_values_SND = torch.empty_like(self.values_SND, dtype=self.cdtype)
            self.grad_logits_SNMJ = torch.zeros_like(self.logits_SNMJ)
        return self.grad_values_SND, self.grad_logits_SNMJ

    def end_backward(self) -> None:
        """The last store's backward has run: the next backward (retain_graph) starts from scratch."""
        self.grad_rows = 0
        self.grad_alpha_stash.clear()

    def accumulate_value_grad(self, S: int, weights_SNM1: Tensor, grad_NMd: Tensor) -> None:
        """grad v_s += weights_s * grad for s < S, per depth head (rows not yet written are set, not added)."""
        S_all, N, D = self.grad_values_SND.shape
        grad_SNMd = self.grad_values_SND.view(S_all, N, self.plan.heads, D // self.plan.heads)
        done = min(self.grad_rows, S)
        if done < S:
            torch.mul(weights_SNM1[done:S], grad_NMd, out=grad_SNMd[done:S])
            self.grad_rows = S
        if done > 0:
            grad_SNMd[:done].addcmul_(weights_SNM1[:done], grad_NMd)


def _key_grads(grad_logits_NMJ: Tensor, logits_NMJ: Tensor, x_NMr: Tensor, rstd_NM1: Tensor | None,
               q_JMr: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Gradients of logit_j = scale rstd <x, q_j> + b (b constant) w.r.t. x [N, M, r] and q [J, M, r].

    With y = rstd x the normalised key: d logit_j / dx = scale rstd (q_j - y <y, q_j> / r), and
    sum_j g_j scale rstd <y, q_j> ... = (rstd^2 / r) sum_j g_j (logit_j - b) x: the norm's backward
    needs the logits, not another pass over x. Pass logits without b.
    """
    coef = grad_logits_NMJ * scale
    if rstd_NM1 is not None:
        coef = coef * rstd_NM1
    N, M, r = x_NMr.shape
    if M == 1:
        c = coef.reshape(N, -1)
        if c.shape[1] == 1:  # an outer product: elementwise beats a matmul with inner size 1
            grad_x = (c * q_JMr.view(1, r)).view(N, 1, r)
        else:
            grad_x = (c @ q_JMr.view(-1, r)).view(N, 1, r)
        grad_q = (c.t() @ x_NMr.view(N, r)).view(-1, 1, r)
    else:
        c_MNJ = coef.transpose(0, 1)
        grad_x = torch.bmm(c_MNJ, q_JMr.transpose(0, 1)).transpose(0, 1)
        grad_q = torch.bmm(c_MNJ.transpose(1, 2), x_NMr.transpose(0, 1)).transpose(0, 1)
    if rstd_NM1 is not None:
        along_x = (grad_logits_NMJ * logits_NMJ).sum(-1, keepdim=True) * rstd_NM1.square() / r  # [N, M, 1]
        grad_x = grad_x.addcmul_(x_NMr, along_x, value=-1.0)
    return grad_x, grad_q


class StoreSource(torch.autograd.Function):
    """Write completed source s (value [B, T, D], carried raw key [B, T, R] or None) -> a token.

    Forward: the value into the buffer, the logits of its normalised key against the queries of every
    site that will read it. Backward: the value gradient the reads accumulated, plus the key's (from the
    accumulated logit gradients, through the RMSNorm), and the gradient of those queries.
    """

    @staticmethod
    def forward(ctx, value_BTD: Tensor, key_BTR: Tensor | None, queries_JR: Tensor, buffers: SourceBuffers):
        plan, s = buffers.plan, buffers.n_stored
        buffers.n_stored += 1
        _, N, D = buffers.values_SND.shape
        buffers.values_SND[s].copy_(value_BTD.reshape(N, D))
        if key_BTR is not None:
            buffers.raw_keys_SNR[s].copy_(key_BTR.reshape(N, -1))
        cdtype = buffers.cdtype
        x_NMr = buffers.raw_key(s).to(cdtype).unflatten(-1, (plan.heads, -1))
        c0 = plan.first_column[s]
        dots_NMJ = site_matmul(x_NMr, queries_JR[c0:].to(cdtype).unflatten(-1, (plan.heads, -1)))
        rstd_NM1 = None
        if plan.key_norm:  # <RMSNorm(x), q> = rstd <x, q>: the normalised key is never materialised
            rstd_NM1 = rstd(x_NMr, plan.keys.eps_factor(plan.counts[s]))
            buffers.rstd_SNM1[s].copy_(rstd_NM1)
        logits_NMJ = logits(dots_NMJ, rstd=rstd_NM1, scale=plan.scale, prior=plan.prior[s])
        buffers.logits_SNMJ[s, :, :, c0:].copy_(logits_NMJ)
        ctx.save_for_backward(queries_JR)
        ctx.buffers, ctx.s = buffers, s
        ctx.value_meta = (value_BTD.shape, value_BTD.dtype)
        ctx.key_meta = None if key_BTR is None else (key_BTR.shape, key_BTR.dtype)
        return value_BTD.new_empty(())

    @staticmethod
    def backward(ctx, _grad_token: Tensor | None):
        (queries_JR,) = ctx.saved_tensors
        buffers, s = ctx.buffers, ctx.s
        plan = buffers.plan
        grad_values_SND, grad_logits_SNMJ = buffers.grad_buffers()
        c0 = plan.first_column[s]
        gl_NMJ = grad_logits_SNMJ[s, :, :, c0:]  # every read of source s has written its column by now
        logits_NMJ = buffers.logits_SNMJ[s, :, :, c0:]
        if plan.prior[s] != 0.0:
            logits_NMJ = logits_NMJ - plan.prior[s]
        q_JMr = queries_JR[c0:].to(buffers.cdtype).unflatten(-1, (plan.heads, -1))
        x_NMr = buffers.raw_key(s).to(buffers.cdtype).unflatten(-1, (plan.heads, -1))
        rstd_NM1 = buffers.rstd_SNM1[s] if plan.key_norm else None
        grad_x, grad_q = _key_grads(gl_NMJ, logits_NMJ, x_NMr, rstd_NM1, q_JMr, plan.scale)
        grad_x = grad_x.flatten(-2)
        grad_queries = queries_JR.new_zeros(queries_JR.shape, dtype=buffers.cdtype)
        grad_queries[c0:] = grad_q.reshape(grad_q.shape[0], -1)
        if s >= buffers.grad_rows:  # no read's backward reached this source
            grad_values_SND[s].zero_()
        grad_v, grad_key = grad_values_SND[s], None  # no read touches row s after this
        if ctx.key_meta is not None:
            k_shape, k_dtype = ctx.key_meta
            grad_key = grad_x.to(k_dtype).view(k_shape)
        else:  # the key is a view of the value (value / sliced): its gradient adds to that view
            plan.keys.from_value(grad_v).add_(grad_x)
        v_shape, v_dtype = ctx.value_meta
        grad_v = grad_v.to(v_dtype).view(v_shape)
        if s == 0:  # the embedding's store runs last: this backward is complete
            buffers.end_backward()
        return grad_v, grad_key, grad_queries.to(queries_JR.dtype), None



# ATen's CPU bmm falls back to a naive loop for tiny matrices (S * G * D < 400): below this source count
# the weighted sums are done with elementwise ops instead.
_SMALL_S = 3


def _weighted_sum(weights_SN1: Tensor, values_SND: Tensor) -> Tensor:
    """sum_s w_s v_s -> [N, D] (one head): a bmm over tokens, or elementwise for few sources."""
    S, N, D = values_SND.shape
    if S > _SMALL_S:
        return torch.bmm(weights_SN1.permute(1, 2, 0).contiguous(), values_SND.transpose(0, 1)).view(N, D)
    out = values_SND[0] * weights_SN1[0]
    for s in range(1, S):
        out.addcmul_(values_SND[s], weights_SN1[s])
    return out


def _grad_alpha(values_SND: Tensor, grad_ND: Tensor, heads: int) -> Tensor:
    """<grad, v_s> per token and depth head -> [S, N, M] in the compute dtype (one bmm for one head)."""
    S, N, D = values_SND.shape
    cdtype = compute_dtype(values_SND.dtype)
    if heads == 1 and S > _SMALL_S:
        return torch.bmm(grad_ND.view(N, 1, D), values_SND.permute(1, 2, 0)).view(N, S).t().to(cdtype).unsqueeze(-1)
    prod = values_SND.view(S, N, heads, D // heads) * grad_ND.view(N, heads, D // heads)
    return prod.sum(-1, dtype=cdtype)


class GroupRead(torch.autograd.Function):
    """Phase 1 of group k: the sites in columns c0:c1 against the S = k + 1 completed sources.

    -> out_g [N, D] (value dtype, one tensor per site so that each is freed on its own) for g < G,
    then lse_g [N, M] (float32) for g < G, then alpha [S, N, M, G] (float32, not differentiable).
    The sources' tokens are inputs only so that autograd runs this backward before
    `StoreSource.backward` of every source read here.
    """

    @staticmethod
    def forward(ctx, buffers: SourceBuffers, k: int, c0: int, c1: int, *tokens: Tensor):
        ctx.set_materialize_grads(False)
        S = k + 1
        values_SND = buffers.values_SND[:S]
        _, N, D = values_SND.shape
        M, G = buffers.plan.heads, c1 - c0
        logits_SNMG = buffers.logits_SNMJ[:S, :, :, c0:c1]
        lse_NMG = torch.logsumexp(logits_SNMG, dim=0)
        alpha_SNMG = torch.exp(logits_SNMG - lse_NMG)
        weights_SNMG = alpha_SNMG.to(values_SND.dtype)
        if S == 1:  # a softmax over one source: alpha = 1, every site reads the embedding
            outs = [values_SND[0].clone() for _ in range(G)]
        elif M == 1:  # [N, 1, S] @ [N, S, D] per site (the value buffer seen token-major, no copy)
            outs = [_weighted_sum(weights_SNMG[..., g], values_SND) for g in range(G)]
        else:  # [N, M, 1, S] @ [N, M, S, dh] per site; the rare multi-head case pays a copy
            v_NMSd = values_SND.view(S, N, M, D // M).permute(1, 2, 0, 3)
            weights_NGMS = weights_SNMG.permute(1, 3, 2, 0)
            outs = [torch.matmul(weights_NGMS[:, g, :, None], v_NMSd).reshape(N, D) for g in range(G)]
        ctx.save_for_backward(alpha_SNMG)
        ctx.buffers, ctx.k, ctx.c0, ctx.c1, ctx.n_tokens = buffers, k, c0, c1, len(tokens)
        ctx.mark_non_differentiable(alpha_SNMG)
        return (*outs, *lse_NMG.unbind(-1), alpha_SNMG)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        (alpha_SNMG,) = ctx.saved_tensors
        buffers, k, c0, c1 = ctx.buffers, ctx.k, ctx.c0, ctx.c1
        S = k + 1
        _, grad_logits_SNMJ = buffers.grad_buffers()
        values_SND = buffers.values_SND[:S]
        _, N, D = values_SND.shape
        M, G = buffers.plan.heads, c1 - c0
        weights_SNMG = alpha_SNMG.to(values_SND.dtype)
        grad_alpha = []
        for g, grad in enumerate(grads[:G]):
            stashed = buffers.grad_alpha_stash.pop((k, g), None)
            if grad is None:  # this site's output was not used
                grad_alpha.append(alpha_SNMG.new_zeros(S, N, M))
                continue
            gout_ND = grad.to(values_SND.dtype).contiguous().view(N, D)
            buffers.accumulate_value_grad(S, weights_SNMG[..., g, None], gout_ND.view(N, M, D // M))
            if stashed is not None:
                grad_alpha.append(stashed)
            elif S > 1:
                grad_alpha.append(_grad_alpha(values_SND, gout_ND, M))
            else:  # one source: alpha = 1 has no gradient
                grad_alpha.append(alpha_SNMG.new_zeros(S, N, M))
        grad_alpha_SNMG = torch.stack(grad_alpha, dim=-1)
        # softmax backward, plus the lse outputs' gradient (d lse / d logit = alpha)
        grad_logits = grad_alpha_SNMG - (alpha_SNMG * grad_alpha_SNMG).sum(0)
        grad_lse = grads[G : 2 * G]
        if any(g is not None for g in grad_lse):
            zeros_NM = alpha_SNMG.new_zeros(N, M)
            grad_logits = grad_logits + torch.stack([zeros_NM if g is None else g for g in grad_lse], dim=-1)
        grad_logits_SNMJ[:S, :, :, c0:c1] = grad_logits * alpha_SNMG
        return (None, None, None, None, *([None] * ctx.n_tokens))


class PartialRead(torch.autograd.Function):
    """Phase 2 at site j: merge the partial block p (value [B, T, D], raw key) into the group's softmax.

        l_p = s <q_j, RMSNorm(key_p)> + beta log c     w = sigmoid(l_p - lse_C)     h = out_C + w (v_p - out_C)

    -> h [B, T, D] and w [N, M] (not differentiable). Saves only v_p (and a carried key) and small
    tensors; out_C is not kept: <grad h, out_C> = sum_s alpha_s <grad h, v_s> comes from the bmm that
    the group's backward needs anyway, which this backward computes once and leaves in the stash.
    """

    @staticmethod
    def forward(ctx, out_ND, lse_NM, v_BTD, key_BTR, queries_JR, alpha_SNM, buffers: SourceBuffers,
                j: int, count: int, where: tuple[int, int]):
        plan, cdtype = buffers.plan, buffers.cdtype
        M, R = plan.heads, plan.rank
        N, D = out_ND.shape
        raw = key_BTR if key_BTR is not None else plan.keys.from_value(v_BTD)
        x_NMr = raw.reshape(N, M, R // M).to(cdtype)
        dots_NM1 = site_matmul(x_NMr, queries_JR[j - 1 : j].to(cdtype).view(1, M, -1))
        rstd_NM1 = rstd(x_NMr, plan.keys.eps_factor(count)) if plan.key_norm else None
        logit_NM1 = logits(dots_NM1, rstd=rstd_NM1, scale=plan.scale)  # without the prior (for backward)
        logit_NM = logits(logit_NM1.view(N, M), prior=count_prior(plan.count_prior, count))
        w_NM = torch.sigmoid(logit_NM - lse_NM)
        v_NMd = v_BTD.reshape(N, M, D // M)
        h = torch.lerp(out_ND.view(N, M, D // M), v_NMd, w_NM.unsqueeze(-1).to(v_BTD.dtype))
        ctx.save_for_backward(v_BTD, key_BTR, queries_JR, alpha_SNM, w_NM, rstd_NM1, logit_NM1)
        ctx.buffers, ctx.j, ctx.where = buffers, j, where
        ctx.mark_non_differentiable(w_NM)
        return h.view(v_BTD.shape), w_NM

    @staticmethod
    def backward(ctx, grad_h, _grad_w):
        v_BTD, key_BTR, queries_JR, alpha_SNM, w_NM, rstd_NM1, logit_NM1 = ctx.saved_tensors
        buffers, j = ctx.buffers, ctx.j
        plan = buffers.plan
        M, R = plan.heads, plan.rank
        S, N, _ = alpha_SNM.shape
        D = v_BTD.shape[-1]
        gh_ND = grad_h.to(v_BTD.dtype).contiguous().view(N, D)
        gh_NMd = gh_ND.view(N, M, D // M)
        w = w_NM.unsqueeze(-1).to(v_BTD.dtype)
        grad_v = (gh_NMd * w).view(N, D)
        grad_out = gh_ND - grad_v
        # <gh, v_p - out_C> with <gh, out_C> = sum_s alpha_s <gh, v_s>
        grad_alpha_SNM = _grad_alpha(buffers.values_SND[:S], gh_ND, M)
        dot_out = (alpha_SNM * grad_alpha_SNM).sum(0)
        dot_v = (gh_NMd * v_BTD.reshape(N, M, D // M)).sum(-1, dtype=buffers.cdtype)
        grad_logit = w_NM * (1 - w_NM) * (dot_v - dot_out)  # [N, M]
        # the group's site sees grad out_C = (1 - w) gh: its weights' gradient is this one scaled
        buffers.grad_alpha_stash[ctx.where] = grad_alpha_SNM * (1 - w_NM)
        # the partial key: l = s rstd <x, q_j> + beta log c
        raw = key_BTR if key_BTR is not None else plan.keys.from_value(v_BTD)
        x_NMr = raw.reshape(N, M, R // M).to(buffers.cdtype)
        q_1Mr = queries_JR[j - 1 : j].to(buffers.cdtype).view(1, M, -1)
        grad_x, grad_q = _key_grads(grad_logit.unsqueeze(-1), logit_NM1, x_NMr, rstd_NM1, q_1Mr, plan.scale)
        grad_x = grad_x.reshape(N, R)
        grad_key = None
        if key_BTR is not None:
            grad_key = grad_x.to(key_BTR.dtype).view(key_BTR.shape)
        else:
            plan.keys.from_value(grad_v).add_(grad_x.to(grad_v.dtype))
        grad_queries = torch.zeros_like(queries_JR, dtype=buffers.cdtype)
        grad_queries[j - 1] = grad_q.reshape(R)
        return (grad_out, -grad_logit, grad_v.view(v_BTD.shape), grad_key, grad_queries.to(queries_JR.dtype),
                None, None, None, None, None)

