"""Depth routing, the fast path: the same parameters and results as `routing.DepthRouter`, less memory traffic.

The math is the reference's (routing.py); only the order of work changes.

1. Logits at write time. Queries are static (one learned vector per read site), so the logits of a
   source against *every* later site are computed once, when the source is written: one
   [N, R] @ [R, J] matmul per source. With key norm, <RMSNorm(x), q> = rstd <x, q>: the normalised
   key is never materialised, and its backward needs only the stored logits (module helper
   `_key_grads`). The key gradients of all sites that read a source are folded in one matmul.

2. Two-phase block routing (AttnRes report). The read sites between two block ends form a *group*:
   they all see the same completed sources C (embedding + finished block summaries). Phase 1 runs once
   per group, when its first site is read: a float32 softmax over C for all G sites of the group and
   their weighted sums (a bmm over tokens per site, reading the value buffer in place):

       out_C[g] = sum_{s in C} alpha_{g,s} v_s        lse_C[g] = logsumexp_{s in C} logit_{g,s}

   Phase 2, at each site of the group, merges the partial block source p (if non-empty) by an
   online-softmax update, which is the same softmax over C + {p}:

       w_p = sigmoid(l_p - lse_C)      h_j = out_C + w_p (v_p - out_C)      (per depth head)

   Its backward needs <grad h, out_C> = sum_s alpha_s <grad h, v_s>: the bmm the group's backward
   needs anyway, so out_C is not saved and the bmm runs once. Full routing is block routing with one
   sublayer per block: the partial source is always empty at a read and phase 2 never runs.

3. Completed sources live in buffers allocated once per forward pass (values [S_max, N, D], logits
   [S_max, N, M, J]), written once: no stacking or copying of the growing source list at each read.
   The buffers are outside autograd. `_StoreSource` writes a source and returns a dependency token;
   `_GroupRead` takes the tokens of the sources it reads, so autograd runs every read's backward before
   the store's. In backward the reads accumulate value and logit gradients into buffers, and
   `_StoreSource.backward` turns them into the source's gradient (through the key norm) and the
   queries'. Saved for backward: the value buffer once, partial values, small float32 tensors.

Under torch.compile the buffers and autograd Functions give way to plain tensor ops (`_read_functional`):
logits at write time, then one softmax per site over completed + partial sources and the weighted sum as
a sum of terms, which Inductor fuses into one kernel and whose backward saves each source once.

Precision: logits, softmax weights and gradient accumulators are in the compute dtype
promote_types(dtype, float32) (float64 for a float64 model); "float32" below means that dtype.
RMSNorm's eps is finfo(compute dtype).eps. A sliced key of a mean/sqrt-mean block summary is the
slice of the *raw* sum (as the paper's code forms it); the value buffer holds the summary v / c^a, and
RMSNorm(c^a x) = x rstd with eps / c^(2a), so such a source's key norm uses that smaller eps.

Repeated backward (retain_graph=True): the accumulators are reset when the embedding's store runs its
backward, which autograd always runs last (every read depends on it).

Shape legend: S sources, J = 2L read sites with queries (site j is column j-1), G sites of a group,
B batch, T tokens, N = B*T, D = d_model, R = key width r, M = depth heads, r = R/M, dh = D/M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.attnres import DepthRouter, RoutingState, compute_dtype, head_rms_norm


@dataclass
class _Plan:
    """What a forward pass needs to know about the routing, fixed at construction."""

    heads: int
    rank: int
    scale: float
    key_norm: bool
    key_from_value: str | None  # "value" | "sliced" | None (keys carried: projected / value_projected)
    first_column: list[int]  # per source: the column (site - 1) of the first site that reads it
    log_count_bias: list[float]  # per source: beta * log(count) (all 0 without a count prior)
    counts: list[int]  # per source: the outputs it summarises
    count_prior: float = 0.0  # beta
    summary_exponent: float = 0.0  # a
    sliced_norm: bool = False  # sliced keys with key norm: the eps of a c-output summary is eps c^-2a

    def eps_factor(self, count: int) -> float:
        """A c-output summary's key norm eps / finfo.eps (c^-2a for sliced summaries, else 1)."""
        return count ** (-2 * self.summary_exponent) if self.sliced_norm else 1.0


# Inference passes with fewer tokens than this (batch x new tokens) take the plain-tensor path.
FUNCTIONAL_BELOW_TOKENS = 512


class _SourceBuffers:
    """The completed sources of one forward pass, outside autograd (see the module docstring)."""

    def __init__(self, plan: _Plan, n_sources: int, n_sites: int, N: int, D: int, value_dtype: torch.dtype,
                 key_dtype: torch.dtype, device: torch.device):
        M, R = plan.heads, plan.rank
        self.plan = plan
        self.cdtype = cdtype = compute_dtype(value_dtype)
        self.eps = torch.finfo(cdtype).eps
        self.values_SND = torch.empty(n_sources, N, D, dtype=value_dtype, device=device)
        self.logits_SNMJ = torch.empty(n_sources, N, M, n_sites, dtype=cdtype, device=device)
        # carried keys (P-LR / value_projected) are not a slice of the value: keep the raw key for backward
        self.raw_keys_SNR = None
        if plan.key_from_value is None:
            self.raw_keys_SNR = torch.empty(n_sources, N, R, dtype=key_dtype, device=device)
        self.rstd_SNM1 = torch.empty(n_sources, N, M, 1, dtype=cdtype, device=device) if plan.key_norm else None
        self.n_stored = 0
        # float32 gradient accumulators, allocated by the first backward. Rows >= grad_rows have not
        # been written yet: a read's backward writes them instead of adding (no zero-fill pass).
        self.grad_values_SND: Tensor | None = None
        self.grad_rows = 0
        self.grad_logits_SNMJ: Tensor | None = None
        # (group, site index) -> grad of that site's softmax weights over the group's sources [S, N, M],
        # left by `_PartialRead.backward`, which needs the same bmm, for `_GroupRead.backward`
        self.grad_alpha_stash: dict[tuple[int, int], Tensor] = {}

    def raw_key(self, s: int) -> Tensor:
        """Source s's key before normalisation, [N, R]."""
        if self.plan.key_from_value == "value":
            return self.values_SND[s]
        if self.plan.key_from_value == "sliced":
            return self.values_SND[s, :, -self.plan.rank :]
        return self.raw_keys_SNR[s]

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


def _site_matmul(keys_NMr: Tensor, queries_JMr: Tensor) -> Tensor:
    """[N, M, r] x [J, M, r] -> [N, M, J]: every key against every query, per depth head."""
    N, M, r = keys_NMr.shape
    if M == 1:
        return (keys_NMr.view(N, r) @ queries_JMr.view(-1, r).t()).view(N, 1, -1)
    return torch.bmm(keys_NMr.transpose(0, 1), queries_JMr.permute(1, 2, 0)).transpose(0, 1)


def _rstd(x_NMr: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x^2) + eps) per depth head, [N, M, 1] in x's dtype, in one pass (a vector norm)."""
    norm = torch.linalg.vector_norm(x_NMr, dim=-1, keepdim=True)
    return (norm.square_().div_(x_NMr.shape[-1]).add_(eps)).rsqrt_()


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


class _StoreSource(torch.autograd.Function):
    """Write completed source s (value [B, T, D], carried raw key [B, T, R] or None) -> a token.

    Forward: the value into the buffer, the logits of its normalised key against the queries of every
    site that will read it. Backward: the value gradient the reads accumulated, plus the key's (from the
    accumulated logit gradients, through the RMSNorm), and the gradient of those queries.
    """

    @staticmethod
    def forward(ctx, value_BTD: Tensor, key_BTR: Tensor | None, queries_JR: Tensor, buffers: _SourceBuffers):
        plan, s = buffers.plan, buffers.n_stored
        buffers.n_stored += 1
        _, N, D = buffers.values_SND.shape
        buffers.values_SND[s].copy_(value_BTD.reshape(N, D))
        if key_BTR is not None:
            buffers.raw_keys_SNR[s].copy_(key_BTR.reshape(N, -1))
        cdtype = buffers.cdtype
        x_NMr = buffers.raw_key(s).to(cdtype).unflatten(-1, (plan.heads, -1))
        c0 = plan.first_column[s]
        logits_NMJ = _site_matmul(x_NMr, queries_JR[c0:].to(cdtype).unflatten(-1, (plan.heads, -1)))
        if plan.key_norm:  # <RMSNorm(x), q> = rstd <x, q>: the normalised key is never materialised
            rstd = _rstd(x_NMr, buffers.eps * plan.eps_factor(plan.counts[s]))
            buffers.rstd_SNM1[s].copy_(rstd)
            logits_NMJ = logits_NMJ * rstd
        if plan.scale != 1.0:
            logits_NMJ = logits_NMJ * plan.scale
        if plan.log_count_bias[s] != 0.0:
            logits_NMJ = logits_NMJ + plan.log_count_bias[s]
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
        if plan.log_count_bias[s] != 0.0:
            logits_NMJ = logits_NMJ - plan.log_count_bias[s]
        q_JMr = queries_JR[c0:].to(buffers.cdtype).unflatten(-1, (plan.heads, -1))
        x_NMr = buffers.raw_key(s).to(buffers.cdtype).unflatten(-1, (plan.heads, -1))
        rstd = buffers.rstd_SNM1[s] if plan.key_norm else None
        grad_x, grad_q = _key_grads(gl_NMJ, logits_NMJ, x_NMr, rstd, q_JMr, plan.scale)
        grad_x = grad_x.flatten(-2)
        grad_queries = queries_JR.new_zeros(queries_JR.shape, dtype=buffers.cdtype)
        grad_queries[c0:] = grad_q.reshape(grad_q.shape[0], -1)
        if s >= buffers.grad_rows:  # no read's backward reached this source
            grad_values_SND[s].zero_()
        grad_v, grad_key = grad_values_SND[s], None  # no read touches row s after this
        if ctx.key_meta is not None:
            k_shape, k_dtype = ctx.key_meta
            grad_key = grad_x.to(k_dtype).view(k_shape)
        elif plan.key_from_value == "value":
            grad_v += grad_x
        else:  # sliced: the key is the last R dims of the value
            grad_v[:, -plan.rank :] += grad_x
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


class _GroupRead(torch.autograd.Function):
    """Phase 1 of group k: the sites in columns c0:c1 against the S = k + 1 completed sources.

    -> out_g [N, D] (value dtype, one tensor per site so that each is freed on its own) for g < G,
    then lse_g [N, M] (float32) for g < G, then alpha [S, N, M, G] (float32, not differentiable).
    The sources' tokens are inputs only so that autograd runs this backward before
    `_StoreSource.backward` of every source read here.
    """

    @staticmethod
    def forward(ctx, buffers: _SourceBuffers, k: int, c0: int, c1: int, *tokens: Tensor):
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


class _PartialRead(torch.autograd.Function):
    """Phase 2 at site j: merge the partial block p (value [B, T, D], raw key) into the group's softmax.

        l_p = s <q_j, RMSNorm(key_p)> + beta log c     w = sigmoid(l_p - lse_C)     h = out_C + w (v_p - out_C)

    -> h [B, T, D] and w [N, M] (not differentiable). Saves only v_p (and a carried key) and small
    tensors; out_C is not kept: <grad h, out_C> = sum_s alpha_s <grad h, v_s> comes from the bmm that
    the group's backward needs anyway, which this backward computes once and leaves in the stash.
    """

    @staticmethod
    def forward(ctx, out_ND, lse_NM, v_BTD, key_BTR, queries_JR, alpha_SNM, buffers: _SourceBuffers,
                j: int, count: int, where: tuple[int, int]):
        plan, cdtype = buffers.plan, buffers.cdtype
        M, R = plan.heads, plan.rank
        N, D = out_ND.shape
        raw = key_BTR if key_BTR is not None else (v_BTD if plan.key_from_value == "value" else v_BTD[..., -R:])
        x_NMr = raw.reshape(N, M, R // M).to(cdtype)
        logit_NM1 = _site_matmul(x_NMr, queries_JR[j - 1 : j].to(cdtype).view(1, M, -1))
        rstd = None
        if plan.key_norm:
            rstd = _rstd(x_NMr, buffers.eps * plan.eps_factor(count))
            logit_NM1 = logit_NM1 * rstd
        if plan.scale != 1.0:
            logit_NM1 = logit_NM1 * plan.scale
        logit_NM = logit_NM1.view(N, M)
        if plan.count_prior != 0.0:
            logit_NM = logit_NM + plan.count_prior * math.log(count)
        w_NM = torch.sigmoid(logit_NM - lse_NM)
        v_NMd = v_BTD.reshape(N, M, D // M)
        h = torch.lerp(out_ND.view(N, M, D // M), v_NMd, w_NM.unsqueeze(-1).to(v_BTD.dtype))
        ctx.save_for_backward(v_BTD, key_BTR, queries_JR, alpha_SNM, w_NM, rstd, logit_NM1)
        ctx.buffers, ctx.j, ctx.where = buffers, j, where
        ctx.mark_non_differentiable(w_NM)
        return h.view(v_BTD.shape), w_NM

    @staticmethod
    def backward(ctx, grad_h, _grad_w):
        v_BTD, key_BTR, queries_JR, alpha_SNM, w_NM, rstd, logit_NM1 = ctx.saved_tensors
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
        raw = key_BTR if key_BTR is not None else (v_BTD if plan.key_from_value == "value" else v_BTD[..., -R:])
        x_NMr = raw.reshape(N, M, R // M).to(buffers.cdtype)
        q_1Mr = queries_JR[j - 1 : j].to(buffers.cdtype).view(1, M, -1)
        grad_x, grad_q = _key_grads(grad_logit.unsqueeze(-1), logit_NM1, x_NMr, rstd, q_1Mr, plan.scale)
        grad_x = grad_x.reshape(N, R)
        grad_key = None
        if key_BTR is not None:
            grad_key = grad_x.to(key_BTR.dtype).view(key_BTR.shape)
        elif plan.key_from_value == "value":
            grad_v += grad_x.to(grad_v.dtype)
        else:
            grad_v[:, -R:] += grad_x.to(grad_v.dtype)
        grad_queries = torch.zeros_like(queries_JR, dtype=buffers.cdtype)
        grad_queries[j - 1] = grad_q.reshape(R)
        return (grad_out, -grad_logit, grad_v.view(v_BTD.shape), grad_key, grad_queries.to(queries_JR.dtype),
                None, None, None, None, None)


@dataclass
class FastRoutingState(RoutingState):
    """RoutingState plus the fast path's buffers and the current group's phase-1 results."""

    functional: bool = False  # this pass takes the plain-tensor path (see FastDepthRouter._use_functional)
    embedding: Tensor | None = None  # site 0 reads it unchanged
    queries: Tensor | None = None  # [J, R], query-normed if configured (computed once per pass)
    buffers: _SourceBuffers | None = None
    tokens: list[Tensor] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)  # functional path: per source [N, M, J] float32
    group: int = -1
    group_out: list[Tensor] | tuple[Tensor, ...] = ()  # per site g of the group: [N, D]
    group_lse: list[Tensor] | tuple[Tensor, ...] = ()  # per site g: [N, M] float32
    group_alpha: Tensor | None = None  # [S, N, M, G] float32, detached
    shape: tuple[int, int, int] = (0, 0, 0)  # B, T, D


class FastDepthRouter(DepthRouter):
    """DepthRouter computed as in the module docstring; parameters and results are the reference's.

    Residual and gated routing, and the gated dynamic query (per-token queries: logits cannot be
    computed at write time), keep the readable code.
    """

    def __init__(self, cfg: ModelConfig, *, functional: bool | None = None):
        super().__init__(cfg)
        # functional: None picks the buffered autograd Functions in eager mode and plain tensor ops under
        # torch.compile; True/False forces one (the parity tests run both in eager mode).
        self.functional = functional
        self.readable = self.kind != "attnres" or self.dynamic_query
        if self.readable:
            return
        M = self.n_sublayers
        ends = cfg.block_ends() or list(range(1, M + 1))  # full routing: every sublayer is a block
        self.ends = frozenset(ends)
        bounds = [0, *ends]
        self.group_sites: list[list[int]] = []  # group k: the sites reading sources 0..k (k blocks done)
        self.site_group: dict[int, tuple[int, int]] = {}  # j -> (group k, index g in the group)
        for k in range(len(bounds)):
            hi = bounds[k + 1] if k + 1 < len(bounds) else M + 1
            sites = list(range(max(bounds[k], 1), hi))
            self.group_sites.append(sites)
            for g, j in enumerate(sites):
                self.site_group[j] = (k, g)
        counts = [1] + [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.plan = _Plan(
            heads=self.heads, rank=self.rank, scale=self.scale, key_norm=self.key_norm,
            key_from_value=None if self.carries_keys else self.key_source,
            first_column=[max(b, 1) - 1 for b in bounds],
            log_count_bias=[self.count_prior * math.log(c) for c in counts],
            counts=counts, count_prior=self.count_prior, summary_exponent=self.summary_exponent,
            sliced_norm=self.key_source == "sliced" and self.key_norm,
        )

    def _use_functional(self, n_tokens: int) -> bool:
        """Plain tensor ops under torch.compile (Inductor fuses them) and for small inference passes such
        as KV-cache decoding (bound by per-op overhead, where fewer Python-level calls win); the buffered
        Functions otherwise (bound by memory traffic)."""
        if self.functional is not None:
            return self.functional
        if torch.compiler.is_compiling():
            return True
        return not torch.is_grad_enabled() and n_tokens < FUNCTIONAL_BELOW_TOKENS

    # ---- the forward-pass protocol ----------------------------------------------------------------
    def start(
        self, emb_BTD: Tensor, record: bool = False, gate_prefix: list | None = None, prefix_len: int = 0
    ) -> RoutingState:
        if self.readable:
            return super().start(emb_BTD, record, gate_prefix, prefix_len)
        state = FastRoutingState(weights=[] if record else None)
        B, T, D = emb_BTD.shape
        state.shape, state.embedding = (B, T, D), emb_BTD
        queries = self.queries
        if self.query_norm:
            queries = head_rms_norm(queries.to(compute_dtype(queries.dtype)), self.heads)
        state.queries = queries
        key_BTR = self._embedding_key(emb_BTD) if self.carries_keys else None
        state.functional = self._use_functional(B * T)
        if not state.functional:
            key_dtype = emb_BTD.dtype if key_BTR is None else key_BTR.dtype
            state.buffers = _SourceBuffers(
                self.plan, len(self.group_sites), self.n_sublayers, B * T, D, emb_BTD.dtype, key_dtype, emb_BTD.device
            )
        self._store(state, emb_BTD, key_BTR)
        return state

    def write(self, state: RoutingState, i: int, out_BTE: Tensor) -> None:
        if self.readable:
            return super().write(state, i, out_BTE)
        value_BTD, key_BTR, _ = self._emitted(out_BTE)
        self._add_to_partial(state, value_BTD, key_BTR, i)
        if i in self.ends:  # the block is complete: summarise it once
            value, key = self._partial_source(state)
            self._store(state, value, key if self.carries_keys else None)
            state.partial_value, state.partial_key, state.partial_count = None, None, 0

    def read(self, state: RoutingState, j: int) -> Tensor:
        if self.readable:
            return super().read(state, j)
        if j == 0:
            return state.embedding
        if state.functional:
            return self._read_functional(state, j)
        k, g = self.site_group[j]
        if state.group != k:
            self._phase_one(state, k)
        B, T, D = state.shape
        M = self.heads
        out_ND = state.group_out[g]
        alpha_SNM = state.group_alpha[..., g]
        if state.partial_count == 0:
            if state.weights is not None:
                state.weights.append(alpha_SNM.view(-1, B, T, M).float())
            return out_ND.view(B, T, D)
        # phase 2: merge the partial block p into the group's softmax (online-softmax update)
        c = state.partial_count
        v_p, key_p = self._partial_source(state)
        h, w_NM = _PartialRead.apply(out_ND, state.group_lse[g], v_p, key_p if self.carries_keys else None,
                                     state.queries, alpha_SNM, state.buffers, j, c, (k, g))
        if state.weights is not None:
            state.weights.append(torch.cat((alpha_SNM * (1 - w_NM), w_NM[None])).view(-1, B, T, M).float())
        return h

    # ---- sources and phase 1 ------------------------------------------------------------------------
    def _store(self, state: FastRoutingState, value: Tensor, key: Tensor | None) -> None:
        if state.functional:
            s = len(state.logits)
            state.values.append(value)
            eps_factor = self.plan.eps_factor(self.plan.counts[s])
            logits = self._key_logits(key if key is not None else self._slice_key(value), state.queries, eps_factor)
            bias = self.plan.log_count_bias[s]
            state.logits.append(logits + bias if bias != 0.0 else logits)
        else:
            state.tokens.append(_StoreSource.apply(value, key, state.queries, state.buffers))

    def _phase_one(self, state: FastRoutingState, k: int) -> None:
        sites = self.group_sites[k]
        S, c0, c1 = k + 1, sites[0] - 1, sites[-1]
        if state.buffers.n_stored != S:
            raise RuntimeError(f"group {k} read with {state.buffers.n_stored} sources stored, expected {S}")
        outputs = _GroupRead.apply(state.buffers, k, c0, c1, *state.tokens)
        G = c1 - c0
        out, lse, alpha = outputs[:G], outputs[G : 2 * G], outputs[-1]
        state.group, state.group_out, state.group_lse, state.group_alpha = k, out, lse, alpha

    # ---- the functional path (torch.compile) ------------------------------------------------------------
    def _key_logits(self, key_BTR: Tensor, queries_JR: Tensor, eps_factor: float) -> Tensor:
        """s rstd <x, q_j> for every site j -> [N, M, J] in the compute dtype (the normalised key is not
        materialised); eps_factor scales the key norm's eps (module docstring: sliced summaries)."""
        N, M = key_BTR.shape[0] * key_BTR.shape[1], self.heads
        cdtype = compute_dtype(key_BTR.dtype)
        x_NMr = key_BTR.reshape(N, M, -1).to(cdtype)
        logits = _site_matmul(x_NMr, queries_JR.to(cdtype).unflatten(-1, (M, -1)))
        if self.key_norm:
            eps = torch.finfo(cdtype).eps * eps_factor
            logits = logits * torch.rsqrt(x_NMr.square().mean(-1, keepdim=True) + eps)
        return logits * self.scale if self.scale != 1.0 else logits

    def _read_functional(self, state: FastRoutingState, j: int) -> Tensor:
        """Site j in plain tensor ops: one softmax over the completed sources and the partial block, and
        the weighted sum as a sum of terms (not a stacked tensor): Inductor fuses it into one kernel and
        autograd saves the sources themselves, which all sites share, not a stack per site."""
        B, T, D = state.shape
        N, M = B * T, self.heads
        values = list(state.values)
        logits = [x[..., j - 1] for x in state.logits]  # [N, M] each
        if state.partial_count:
            c = state.partial_count
            v_p, key = self._partial_source(state)
            if not self.carries_keys:
                key = self._slice_key(v_p)
            logit = self._key_logits(key, state.queries[j - 1 : j], self.plan.eps_factor(c))[..., 0]
            values.append(v_p)
            logits.append(logit + self.count_prior * math.log(c) if self.count_prior != 0.0 else logit)
        alpha_SNM = torch.stack(logits).softmax(dim=0)
        cdtype = alpha_SNM.dtype
        weights = alpha_SNM.to(values[0].dtype).to(cdtype).unsqueeze(-1)  # rounded as bmm would use them
        out = None
        for s_, v in enumerate(values):
            term = weights[s_] * v.reshape(N, M, D // M).to(cdtype)
            out = term if out is None else out + term
        if state.weights is not None:
            state.weights.append(alpha_SNM.detach().view(-1, B, T, M).float())
        return out.to(values[0].dtype).view(B, T, D)
