"""The `fast` backend's machinery: per-pass source buffers outside autograd, and the autograd Functions
that write sources (`_StoreSource`), read a group of sites (`_GroupRead`) and merge a partial block
(`_PartialRead`). What they compute and why: fast.py. The logits, rstd and the priors come from
_math.py; the keys from the router's key source.

Shape legend (docs/method.md letters): S sources, J = 2L read sites with queries (site j is column j-1), G sites of
a group, B batch, T tokens, N = B*T, D = d_model, r = key width (the rank; d for key_source value),
m = depth heads, k = r/m, e = D/m.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lrattn_lightning.model.routing._math import compute_dtype, count_prior, logits, site_matmul
from lrattn_lightning.model.routing.attnres.keys import KeySource, key_rstd


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
    full_norm: bool = False  # the key norm spans the whole key (depth_head_norm full), not each head's slice


class SourceBuffers:
    """The completed sources of one forward pass, outside autograd (see the module docstring)."""

    def __init__(self, plan: Plan, n_sources: int, n_sites: int, N: int, D: int, value_dtype: torch.dtype,
                 key_dtype: torch.dtype, device: torch.device):
        m, r = plan.heads, plan.rank
        self.plan = plan
        self.cdtype = cdtype = compute_dtype(value_dtype)
        self.values_SND = torch.empty(n_sources, N, D, dtype=value_dtype, device=device)
        self.logits_SNmJ = torch.empty(n_sources, N, m, n_sites, dtype=cdtype, device=device)
        # carried keys (P-LR / value_projected) are not a view of the value: keep the raw key for backward
        self.raw_keys_SNr = None
        if plan.keys.carried:
            self.raw_keys_SNr = torch.empty(n_sources, N, r, dtype=key_dtype, device=device)
        self.rstd_SNm1 = torch.empty(n_sources, N, m, 1, dtype=cdtype, device=device) if plan.key_norm else None
        self.n_stored = 0
        # float32 gradient accumulators, allocated by the first backward. Rows >= grad_rows have not
        # been written yet: a read's backward writes them instead of adding (no zero-fill pass).
        self.grad_values_SND: Tensor | None = None
        self.grad_rows = 0
        self.grad_logits_SNmJ: Tensor | None = None
        # (group, site index) -> grad of that site's softmax weights over the group's sources [S, N, m],
        # left by `PartialRead.backward`, which needs the same bmm, for `GroupRead.backward`
        self.grad_alpha_stash: dict[tuple[int, int], Tensor] = {}

    def raw_key(self, s: int) -> Tensor:
        """Source s's key before normalisation, [N, r]."""
        if self.plan.keys.carried:
            return self.raw_keys_SNr[s]
        return self.plan.keys.from_value(self.values_SND[s])

    def grad_buffers(self) -> tuple[Tensor, Tensor]:
        if self.grad_values_SND is None:
            self.grad_values_SND = torch.empty_like(self.values_SND, dtype=self.cdtype)
            self.grad_logits_SNmJ = torch.zeros_like(self.logits_SNmJ)
        return self.grad_values_SND, self.grad_logits_SNmJ

    def end_backward(self) -> None:
        """The last store's backward has run: the next backward (retain_graph) starts from scratch."""
        self.grad_rows = 0
        self.grad_alpha_stash.clear()

    def accumulate_value_grad(self, S: int, weights_SNm1: Tensor, grad_Nme: Tensor) -> None:
        """grad v_s += weights_s * grad for s < S, per depth head (rows not yet written are set, not added)."""
        S_all, N, D = self.grad_values_SND.shape
        grad_SNme = self.grad_values_SND.view(S_all, N, self.plan.heads, D // self.plan.heads)
        done = min(self.grad_rows, S)
        if done < S:
            torch.mul(weights_SNm1[done:S], grad_Nme, out=grad_SNme[done:S])
            self.grad_rows = S
        if done > 0:
            grad_SNme[:done].addcmul_(weights_SNm1[:done], grad_Nme)


def _key_grads(grad_logits_NmJ: Tensor, logits_NmJ: Tensor, x_Nmk: Tensor, rstd_Nm1: Tensor | None,
               q_Jmk: Tensor, scale: float, full: bool = False) -> tuple[Tensor, Tensor]:
    """Gradients of logit_j = scale rstd <x, q_j> + b (b constant) w.r.t. x [N, m, k] and q [J, m, k].

    With y = rstd x the normalised key: d logit_j / dx = scale rstd (q_j - y <y, q_j> / k), and
    sum_j g_j scale rstd <y, q_j> ... = (rstd^2 / k) sum_j g_j (logit_j - b) x: the norm's backward
    needs the logits, not another pass over x. Pass logits without b. With the norm over the whole key
    (`full`: one rstd for all m heads) every head's logits reach every head's x: the sum runs over heads
    too and k becomes r = m k.
    """
    coef = grad_logits_NmJ * scale
    if rstd_Nm1 is not None:
        coef = coef * rstd_Nm1
    N, m, k = x_Nmk.shape
    if m == 1:
        c = coef.reshape(N, -1)
        if c.shape[1] == 1:  # an outer product: elementwise beats a matmul with inner size 1
            grad_x = (c * q_Jmk.view(1, k)).view(N, 1, k)
        else:
            grad_x = (c @ q_Jmk.view(-1, k)).view(N, 1, k)
        grad_q = (c.t() @ x_Nmk.view(N, k)).view(-1, 1, k)
    else:
        c_mNJ = coef.transpose(0, 1)
        grad_x = torch.bmm(c_mNJ, q_Jmk.transpose(0, 1)).transpose(0, 1)
        grad_q = torch.bmm(c_mNJ.transpose(1, 2), x_Nmk.transpose(0, 1)).transpose(0, 1)
    if rstd_Nm1 is not None:
        if full:
            along_x = (grad_logits_NmJ * logits_NmJ).sum((-2, -1), keepdim=True) * rstd_Nm1.square() / (m * k)
        else:
            along_x = (grad_logits_NmJ * logits_NmJ).sum(-1, keepdim=True) * rstd_Nm1.square() / k  # [N, m, 1]
        grad_x = grad_x.addcmul_(x_Nmk, along_x, value=-1.0)
    return grad_x, grad_q


class StoreSource(torch.autograd.Function):
    """Write completed source s (value [B, T, D], carried raw key [B, T, r] or None) -> a token.

    Forward: the value into the buffer, the logits of its normalised key against the queries of every
    site that will read it. Backward: the value gradient the reads accumulated, plus the key's (from the
    accumulated logit gradients, through the RMSNorm), and the gradient of those queries.
    """

    @staticmethod
    def forward(ctx, value_BTD: Tensor, key_BTr: Tensor | None, queries_Jr: Tensor, buffers: SourceBuffers):
        plan, s = buffers.plan, buffers.n_stored
        buffers.n_stored += 1
        _, N, D = buffers.values_SND.shape
        buffers.values_SND[s].copy_(value_BTD.reshape(N, D))
        if key_BTr is not None:
            buffers.raw_keys_SNr[s].copy_(key_BTr.reshape(N, -1))
        cdtype = buffers.cdtype
        x_Nmk = buffers.raw_key(s).to(cdtype).unflatten(-1, (plan.heads, -1))
        c0 = plan.first_column[s]
        dots_NmJ = site_matmul(x_Nmk, queries_Jr[c0:].to(cdtype).unflatten(-1, (plan.heads, -1)))
        rstd_Nm1 = None
        if plan.key_norm:  # <RMSNorm(x), q> = rstd <x, q>: the normalised key is never materialised
            rstd_Nm1 = key_rstd(x_Nmk, plan.keys.eps_factor(plan.counts[s]), plan.full_norm)
            buffers.rstd_SNm1[s].copy_(rstd_Nm1)
        logits_NmJ = logits(dots_NmJ, rstd=rstd_Nm1, scale=plan.scale, prior=plan.prior[s])
        buffers.logits_SNmJ[s, :, :, c0:].copy_(logits_NmJ)
        ctx.save_for_backward(queries_Jr)
        ctx.buffers, ctx.s = buffers, s
        ctx.value_meta = (value_BTD.shape, value_BTD.dtype)
        ctx.key_meta = None if key_BTr is None else (key_BTr.shape, key_BTr.dtype)
        return value_BTD.new_empty(())

    @staticmethod
    def backward(ctx, _grad_token: Tensor | None):
        (queries_Jr,) = ctx.saved_tensors
        buffers, s = ctx.buffers, ctx.s
        plan = buffers.plan
        grad_values_SND, grad_logits_SNmJ = buffers.grad_buffers()
        c0 = plan.first_column[s]
        gl_NmJ = grad_logits_SNmJ[s, :, :, c0:]  # every read of source s has written its column by now
        logits_NmJ = buffers.logits_SNmJ[s, :, :, c0:]
        if plan.prior[s] != 0.0:
            logits_NmJ = logits_NmJ - plan.prior[s]
        q_Jmk = queries_Jr[c0:].to(buffers.cdtype).unflatten(-1, (plan.heads, -1))
        x_Nmk = buffers.raw_key(s).to(buffers.cdtype).unflatten(-1, (plan.heads, -1))
        rstd_Nm1 = buffers.rstd_SNm1[s] if plan.key_norm else None
        grad_x, grad_q = _key_grads(gl_NmJ, logits_NmJ, x_Nmk, rstd_Nm1, q_Jmk, plan.scale, plan.full_norm)
        grad_x = grad_x.flatten(-2)
        grad_queries = queries_Jr.new_zeros(queries_Jr.shape, dtype=buffers.cdtype)
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
        return grad_v, grad_key, grad_queries.to(queries_Jr.dtype), None



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
    """<grad, v_s> per token and depth head -> [S, N, m] in the compute dtype (one bmm for one head)."""
    S, N, D = values_SND.shape
    cdtype = compute_dtype(values_SND.dtype)
    if heads == 1 and S > _SMALL_S:
        return torch.bmm(grad_ND.view(N, 1, D), values_SND.permute(1, 2, 0)).view(N, S).t().to(cdtype).unsqueeze(-1)
    prod = values_SND.view(S, N, heads, D // heads) * grad_ND.view(N, heads, D // heads)
    return prod.sum(-1, dtype=cdtype)


class GroupRead(torch.autograd.Function):
    """Phase 1 of group k: the sites in columns c0:c1 against the S = k + 1 completed sources.

    -> out_g [N, D] (value dtype, one tensor per site so that each is freed on its own) for g < G,
    then lse_g [N, m] (float32) for g < G, then alpha [S, N, m, G] (float32, not differentiable).
    The sources' tokens are inputs only so that autograd runs this backward before
    `StoreSource.backward` of every source read here.
    """

    @staticmethod
    def forward(ctx, buffers: SourceBuffers, grp: int, c0: int, c1: int, *tokens: Tensor):
        ctx.set_materialize_grads(False)
        S = grp + 1
        values_SND = buffers.values_SND[:S]
        _, N, D = values_SND.shape
        m, G = buffers.plan.heads, c1 - c0
        logits_SNmG = buffers.logits_SNmJ[:S, :, :, c0:c1]
        lse_NmG = torch.logsumexp(logits_SNmG, dim=0)
        alpha_SNmG = torch.exp(logits_SNmG - lse_NmG)
        weights_SNmG = alpha_SNmG.to(values_SND.dtype)
        if S == 1:  # a softmax over one source: alpha = 1, every site reads the embedding
            outs = [values_SND[0].clone() for _ in range(G)]
        elif m == 1:  # [N, 1, S] @ [N, S, D] per site (the value buffer seen token-major, no copy)
            outs = [_weighted_sum(weights_SNmG[..., g], values_SND) for g in range(G)]
        else:  # [N, m, 1, S] @ [N, m, S, e] per site; the rare multi-head case pays a copy
            v_NmSe = values_SND.view(S, N, m, D // m).permute(1, 2, 0, 3)
            weights_NGmS = weights_SNmG.permute(1, 3, 2, 0)
            outs = [torch.matmul(weights_NGmS[:, g, :, None], v_NmSe).reshape(N, D) for g in range(G)]
        ctx.save_for_backward(alpha_SNmG)
        ctx.buffers, ctx.grp, ctx.c0, ctx.c1, ctx.n_tokens = buffers, grp, c0, c1, len(tokens)
        ctx.mark_non_differentiable(alpha_SNmG)
        return (*outs, *lse_NmG.unbind(-1), alpha_SNmG)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        (alpha_SNmG,) = ctx.saved_tensors
        buffers, grp, c0, c1 = ctx.buffers, ctx.grp, ctx.c0, ctx.c1
        S = grp + 1
        _, grad_logits_SNmJ = buffers.grad_buffers()
        values_SND = buffers.values_SND[:S]
        _, N, D = values_SND.shape
        m, G = buffers.plan.heads, c1 - c0
        weights_SNmG = alpha_SNmG.to(values_SND.dtype)
        grad_alpha = []
        for g, grad in enumerate(grads[:G]):
            stashed = buffers.grad_alpha_stash.pop((grp, g), None)
            if grad is None:  # this site's output was not used
                grad_alpha.append(alpha_SNmG.new_zeros(S, N, m))
                continue
            gout_ND = grad.to(values_SND.dtype).contiguous().view(N, D)
            buffers.accumulate_value_grad(S, weights_SNmG[..., g, None], gout_ND.view(N, m, D // m))
            if stashed is not None:
                grad_alpha.append(stashed)
            elif S > 1:
                grad_alpha.append(_grad_alpha(values_SND, gout_ND, m))
            else:  # one source: alpha = 1 has no gradient
                grad_alpha.append(alpha_SNmG.new_zeros(S, N, m))
        grad_alpha_SNmG = torch.stack(grad_alpha, dim=-1)
        # softmax backward, plus the lse outputs' gradient (d lse / d logit = alpha)
        grad_logits = grad_alpha_SNmG - (alpha_SNmG * grad_alpha_SNmG).sum(0)
        grad_lse = grads[G : 2 * G]
        if any(g is not None for g in grad_lse):
            zeros_Nm = alpha_SNmG.new_zeros(N, m)
            grad_logits = grad_logits + torch.stack([zeros_Nm if g is None else g for g in grad_lse], dim=-1)
        grad_logits_SNmJ[:S, :, :, c0:c1] = grad_logits * alpha_SNmG
        return (None, None, None, None, *([None] * ctx.n_tokens))


class PartialRead(torch.autograd.Function):
    """Phase 2 at site j: merge the partial block p (value [B, T, D], raw key) into the group's softmax.

        l_p = s <q_j, RMSNorm(key_p)> + beta log c     w = sigmoid(l_p - lse_C)     h = out_C + w (v_p - out_C)

    -> h [B, T, D] and w [N, m] (not differentiable). Saves only v_p (and a carried key) and small
    tensors; out_C is not kept: <grad h, out_C> = sum_s alpha_s <grad h, v_s> comes from the bmm that
    the group's backward needs anyway, which this backward computes once and leaves in the stash.
    """

    @staticmethod
    def forward(ctx, out_ND, lse_Nm, v_BTD, key_BTr, queries_Jr, alpha_SNm, buffers: SourceBuffers,
                j: int, count: int, where: tuple[int, int]):
        plan, cdtype = buffers.plan, buffers.cdtype
        m, r = plan.heads, plan.rank
        N, D = out_ND.shape
        raw = key_BTr if key_BTr is not None else plan.keys.from_value(v_BTD)
        x_Nmk = raw.reshape(N, m, r // m).to(cdtype)
        dots_Nm1 = site_matmul(x_Nmk, queries_Jr[j - 1 : j].to(cdtype).view(1, m, -1))
        rstd_Nm1 = key_rstd(x_Nmk, plan.keys.eps_factor(count), plan.full_norm) if plan.key_norm else None
        logit_Nm1 = logits(dots_Nm1, rstd=rstd_Nm1, scale=plan.scale)  # without the prior (for backward)
        logit_Nm = logits(logit_Nm1.view(N, m), prior=count_prior(plan.count_prior, count))
        w_Nm = torch.sigmoid(logit_Nm - lse_Nm)
        # under autocast the buffers hold the embedding's float32 and v_p is a bfloat16 sum: h is float32, as
        # the reference's stack of the two would be
        hdtype = torch.promote_types(out_ND.dtype, v_BTD.dtype)
        v_Nme = v_BTD.reshape(N, m, D // m).to(hdtype)
        h = torch.lerp(out_ND.view(N, m, D // m).to(hdtype), v_Nme, w_Nm.unsqueeze(-1).to(hdtype))
        ctx.save_for_backward(v_BTD, key_BTr, queries_Jr, alpha_SNm, w_Nm, rstd_Nm1, logit_Nm1)
        ctx.buffers, ctx.j, ctx.where, ctx.out_dtype = buffers, j, where, out_ND.dtype
        ctx.mark_non_differentiable(w_Nm)
        return h.view(v_BTD.shape), w_Nm

    @staticmethod
    def backward(ctx, grad_h, _grad_w):
        v_BTD, key_BTr, queries_Jr, alpha_SNm, w_Nm, rstd_Nm1, logit_Nm1 = ctx.saved_tensors
        buffers, j = ctx.buffers, ctx.j
        plan = buffers.plan
        m, r = plan.heads, plan.rank
        S, N, _ = alpha_SNm.shape
        D = v_BTD.shape[-1]
        hdtype = torch.promote_types(ctx.out_dtype, v_BTD.dtype)  # h's dtype (forward)
        gh_ND = grad_h.to(hdtype).contiguous().view(N, D)
        gh_Nme = gh_ND.view(N, m, D // m)
        w = w_Nm.unsqueeze(-1).to(hdtype)
        grad_v = (gh_Nme * w).view(N, D)
        grad_out = gh_ND - grad_v
        # <gh, v_p - out_C> with <gh, out_C> = sum_s alpha_s <gh, v_s>
        values_SND = buffers.values_SND[:S]
        grad_alpha_SNm = _grad_alpha(values_SND, gh_ND.to(values_SND.dtype), m)
        dot_out = (alpha_SNm * grad_alpha_SNm).sum(0)
        dot_v = (gh_Nme * v_BTD.reshape(N, m, D // m).to(hdtype)).sum(-1, dtype=buffers.cdtype)
        grad_logit = w_Nm * (1 - w_Nm) * (dot_v - dot_out)  # [N, m]
        # the group's site sees grad out_C = (1 - w) gh: its weights' gradient is this one scaled
        buffers.grad_alpha_stash[ctx.where] = grad_alpha_SNm * (1 - w_Nm)
        # the partial key: l = s rstd <x, q_j> + beta log c
        raw = key_BTr if key_BTr is not None else plan.keys.from_value(v_BTD)
        x_Nmk = raw.reshape(N, m, r // m).to(buffers.cdtype)
        q_1mk = queries_Jr[j - 1 : j].to(buffers.cdtype).view(1, m, -1)
        grad_x, grad_q = _key_grads(grad_logit.unsqueeze(-1), logit_Nm1, x_Nmk, rstd_Nm1, q_1mk, plan.scale,
                                    plan.full_norm)
        grad_x = grad_x.reshape(N, r)
        grad_key = None
        if key_BTr is not None:
            grad_key = grad_x.to(key_BTr.dtype).view(key_BTr.shape)
        else:
            plan.keys.from_value(grad_v).add_(grad_x.to(grad_v.dtype))
        grad_queries = torch.zeros_like(queries_Jr, dtype=buffers.cdtype)
        grad_queries[j - 1] = grad_q.reshape(r)
        return (grad_out.to(ctx.out_dtype), -grad_logit, grad_v.to(v_BTD.dtype).view(v_BTD.shape), grad_key,
                grad_queries.to(queries_Jr.dtype), None, None, None, None, None)

