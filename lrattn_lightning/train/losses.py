"""The training loss's parts, shared by training, validation and `lrattn eval`'s exact validation loss.

Per token i with logits x_i (V of them) and target t_i:

    lse_i = log sum_v exp(x_iv)          ce = mean_i (lse_i - x_it_i)          z = mean_i lse_i^2

The training loss is ce + z_loss * z (lit_module.py). Both terms need lse_i, so `token_losses` computes it
once (`FusedTokenLosses`): one read of the logits forward and one backward, where

    d loss / d x_iv = p_iv * (g_ce / N_ce * [i counted] + g_z * 2 lse_i / N) - [v = t_i] * g_ce / N_ce * [i counted]

with p_iv = exp(x_iv - lse_i) the softmax and N_ce the tokens the cross-entropy counts. The float32 working set
(float64 for float64 logits) is bounded: rows are taken in chunks of at most `chunk_bytes` of it, so a
100k vocabulary never holds a float32 copy of every token's logits. `reference_token_losses` is the readable
twin (two logsumexps, a float32 copy of the logits) the fused path is compared and benchmarked against.

`head_token_losses` goes one step further (the head fused in, as Liger's fused linear cross-entropy): from the
final features x (N, D) and the head's weight W (V, D) it forms the logits chunk by chunk, x_c W^T, takes each
chunk's lse and picked logit and drops it; backward forms each chunk again and turns its gradient G_c (as above)
into dL/dx_c = G_c W and the chunk's share of dL/dW = sum_c G_c^T x_c. The [N, V] logits never exist at once: at
paper-0.5b, batch 32, they are 13 GB in bfloat16 and their float32 gradient's working set as much again. The matmuls
run in the dtype autocast gives the head (as `head(x)` would), the softmax in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.routing._math import autocast_off

IGNORE_INDEX = -100  # F.cross_entropy's default: such a target is left out of the cross-entropy (not of z)
CHUNK_BYTES = 256 * 2**20  # the float32 working set of one chunk of rows (V = 100277: 669 rows)
MAX_CHUNKS = 32  # head_token_losses: at most this many chunks a call (fewer, larger matmuls; a short compiled graph)


def token_losses(logits: torch.Tensor, targets: torch.Tensor, *,
                 chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, mean z-loss term logsumexp^2) of logits (..., V) against targets (...), both
    float32 (float64 for float64 logits) whatever the logits' dtype. Targets equal to IGNORE_INDEX are left
    out of the cross-entropy, as F.cross_entropy does; the data never makes them."""
    logits_NV = logits.flatten(0, -2)
    targets_N = targets.flatten()
    if logits_NV.shape[0] != targets_N.shape[0]:
        raise InputError(f"token_losses: {tuple(logits.shape)} logits against {tuple(targets.shape)} targets")
    return FusedTokenLosses.apply(logits_NV, targets_N, rows_per_chunk(logits_NV, chunk_bytes))


def reference_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable twin of token_losses (the code before the fused path): a float32 copy, two logsumexps."""
    logits = logits.float().flatten(0, -2)
    ce = F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE_INDEX)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return ce, z


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16 / fp16 / fp32 logits, float64 for float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def rows_per_chunk(logits_NV: torch.Tensor, chunk_bytes: int) -> int:
    """How many rows of logits fit `chunk_bytes` of working set in the compute dtype (at least one)."""
    V = logits_NV.shape[-1]
    return max(1, chunk_bytes // (V * compute_dtype(logits_NV.dtype).itemsize))


def chunk_logsumexp(x_RV: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log sum_v exp(x_rv) per row in `dtype`, through one working copy of the rows in `dtype`, worked in place
    (torch.logsumexp of a bf16 chunk's float32 copy would hold a second float32 chunk)."""
    m_R = x_RV.amax(-1).to(dtype)
    m_R = torch.where(m_R.isinf(), 0, m_R)  # as torch.logsumexp: rows of -inf give -inf, a +inf gives +inf
    return shifted(x_RV, m_R).exp_().sum(-1).log_().add_(m_R)


def shifted(x_RV: torch.Tensor, m_R: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x - m[:, None] in m's dtype as one new (or `out`) array: the subtraction writes it where x already has that
    dtype (one pass); bf16 rows are copied up first and shifted in place (on CPU a mixed-dtype subtraction would
    hold a float32 copy of x besides its result)."""
    if x_RV.dtype == m_R.dtype:
        return torch.sub(x_RV, m_R[:, None], out=out)
    p = x_RV.to(m_R.dtype, copy=True).sub_(m_R[:, None])
    return p if out is None else out.copy_(p)


class FusedTokenLosses(torch.autograd.Function):
    """(ce, z) from one logsumexp per row, forward and backward in chunks of `rows` rows (module docstring)."""

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor, rows: int):
        N = logits_NV.shape[0]
        dtype = compute_dtype(logits_NV.dtype)
        lse_N = torch.cat([chunk_logsumexp(logits_NV[s:s + rows], dtype) for s in range(0, N, rows)])
        counted_N = targets_N != IGNORE_INDEX
        safe_N = torch.where(counted_N, targets_N, 0)
        picked_N = logits_NV.gather(1, safe_N[:, None]).squeeze(1).to(dtype)  # x_it_i
        ce, z = _losses(lse_N, picked_N, counted_N)
        ctx.save_for_backward(logits_NV, safe_N, counted_N, lse_N)
        ctx.rows = rows
        return ce, z

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, g_z: torch.Tensor):
        logits_NV, safe_N, counted_N, lse_N = ctx.saved_tensors
        N, rows = logits_NV.shape[0], ctx.rows
        w_ce_N, coef_N = _coefficients(counted_N, lse_N, g_ce, g_z)
        grad_NV = torch.empty_like(logits_NV)
        in_place = logits_NV.dtype == lse_N.dtype  # float32 / float64 logits: work in the gradient's own rows
        for s in range(0, N, rows):
            e = min(s + rows, N)
            # (rows, V) in the compute dtype, x - lse written by the subtraction (into the gradient's own rows for
            # float logits: no working set beyond it; one float32 chunk for bf16 ones, the promotion's result),
            # then worked in place
            p = _logits_grad(logits_NV[s:e], lse_N[s:e], coef_N[s:e], safe_N[s:e], w_ce_N[s:e],
                             out=grad_NV[s:e] if in_place else None)
            if not in_place:
                grad_NV[s:e] = p
            del p  # before the next chunk's copy
        return grad_NV, None, None


def _losses(lse_N: torch.Tensor, picked_N: torch.Tensor, counted_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce, z) from each row's lse and target logit: ce over the counted rows, z over all."""
    return torch.where(counted_N, lse_N - picked_N, 0).sum() / counted_N.sum(), lse_N.square().mean()


def _coefficients(counted_N: torch.Tensor, lse_N: torch.Tensor, g_ce: torch.Tensor,
                  g_z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_ce, coef) of the backward: g_ce / N_ce on counted rows (else 0), and w_ce + g_z 2 lse / N."""
    w_ce_N = counted_N.to(lse_N.dtype) * (g_ce / counted_N.sum())
    return w_ce_N, w_ce_N + lse_N * (2.0 * g_z / lse_N.shape[0])


def _logits_grad(x_RV: torch.Tensor, lse_R: torch.Tensor, coef_R: torch.Tensor, safe_R: torch.Tensor,
                 w_ce_R: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d x for a chunk of rows, in the compute dtype: exp(x - lse) coef - [v = t] w_ce, worked in place in
    the array the subtraction writes (`out`, or a new one)."""
    p = shifted(x_RV, lse_R, out=out)
    p.exp_().mul_(coef_R[:, None])
    return p.scatter_add_(1, safe_R[:, None], -w_ce_R[:, None])


def head_token_losses(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                      chunk_bytes: int = CHUNK_BYTES, max_chunks: int = MAX_CHUNKS) -> tuple[torch.Tensor, torch.Tensor]:
    """token_losses(features @ weight.T, targets) without the logits (module docstring): features (..., D), the
    head's weight (V, D). Chunks of rows_per_chunk rows, or more where that would make more than `max_chunks`."""
    x_ND, targets_N = features.flatten(0, -2), targets.flatten()
    if x_ND.shape[0] != targets_N.shape[0] or x_ND.shape[1] != weight.shape[1]:
        raise InputError(f"head_token_losses: {tuple(features.shape)} features, {tuple(weight.shape)} head weight, "
                         f"{tuple(targets.shape)} targets")
    device = x_ND.device.type
    mm_dtype = (torch.get_autocast_dtype(device) if device != "meta" and torch.is_autocast_enabled(device)
                else torch.promote_types(x_ND.dtype, weight.dtype))
    N, V = x_ND.shape[0], weight.shape[0]
    rows = max(1, chunk_bytes // (V * compute_dtype(mm_dtype).itemsize), -(-N // max_chunks))
    return FusedHeadTokenLosses.apply(x_ND, weight, targets_N, rows, mm_dtype)


class FusedHeadTokenLosses(torch.autograd.Function):
    """(ce, z) of x W^T from one chunk of logits at a time, forward and backward (head_token_losses). The matmuls
    run in `mm_dtype` (autocast's, resolved by the caller: backward runs outside autocast), with autocast off."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w_VD: torch.Tensor, targets_N: torch.Tensor, rows: int,
                mm_dtype: torch.dtype):
        N, dtype = x_ND.shape[0], compute_dtype(mm_dtype)
        counted_N = targets_N != IGNORE_INDEX
        safe_N = torch.where(counted_N, targets_N, 0)
        with autocast_off(x_ND.device):
            x, w = x_ND.to(mm_dtype), w_VD.to(mm_dtype)
            lse, picked = [], []
            for s in range(0, N, rows):
                logits_RV = x[s:s + rows] @ w.T  # (R, V), dropped after this chunk
                lse.append(chunk_logsumexp(logits_RV, dtype))
                picked.append(logits_RV.gather(1, safe_N[s:s + rows, None]).squeeze(1).to(dtype))
                del logits_RV
            lse_N, picked_N = torch.cat(lse), torch.cat(picked)
        ce, z = _losses(lse_N, picked_N, counted_N)
        ctx.save_for_backward(x_ND, w_VD, safe_N, counted_N, lse_N)
        ctx.rows, ctx.mm_dtype = rows, mm_dtype
        return ce, z

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, g_z: torch.Tensor):
        x_ND, w_VD, safe_N, counted_N, lse_N = ctx.saved_tensors
        N, rows, mm_dtype = x_ND.shape[0], ctx.rows, ctx.mm_dtype
        w_ce_N, coef_N = _coefficients(counted_N, lse_N, g_ce, g_z)
        with autocast_off(x_ND.device):
            x, w = x_ND.to(mm_dtype), w_VD.to(mm_dtype)
            grad_x = torch.empty_like(x)
            grad_w = torch.zeros(w.shape, dtype=lse_N.dtype, device=w.device)  # summed over chunks in float32
            for s in range(0, N, rows):
                e = min(s + rows, N)
                p = _logits_grad(x[s:e] @ w.T, lse_N[s:e], coef_N[s:e], safe_N[s:e], w_ce_N[s:e])  # (R, V)
                g_RV = p.to(mm_dtype)  # the logits' gradient, in the dtype autograd would hand the head's backward
                del p
                grad_x[s:e] = g_RV @ w
                grad_w += g_RV.T @ x[s:e]
                del g_RV
        return grad_x.to(x_ND.dtype), grad_w.to(w_VD.dtype), None, None, None
