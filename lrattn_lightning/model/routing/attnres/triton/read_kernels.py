"""The single depth read's kernels (kernels.py: the math, the table layout): read_fwd, the online softmax over a
read's sources, and read_bwd, its gradients in chunks of CH columns. Imports only triton and kernel_parts.py."""

from __future__ import annotations

import triton
import triton.language as tl

from lrattn_lightning.model.routing.attnres.triton.kernel_parts import _layout, _rstd, _source


@triton.jit
def _online(m_i, l_i, acc, logit, v):
    """One source into the running softmax (max m, sum l, weighted sum acc)."""
    m_new = tl.maximum(m_i, logit)
    corr = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * corr + p, acc * corr[:, None] + p[:, None] * v


@triton.jit
def _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale, key_norm,
                  KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr):
    """Source `s` of the pointer table: its value and raw logit (_source)."""
    vp = tl.load(meta + s).to(tl.pointer_type(VDT))
    kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
    eps = tl.load(fmeta + EP + 1 + s).to(ACC)
    v, _, lraw, _ = _source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), eps, rows, rmask,
                            vcols, emask, kcols, kmask, qt, K, scale, key_norm, KEY_MODE, ACC)
    return v, lraw


@triton.jit(do_not_specialize=["N", "heads", "S_t"])
def read_fwd(ev, sev, ek, sek, meta, fmeta, q, sq, out, lse, alpha, N, D, R, KOFF, heads, S_t, scale, key_norm,
             write_alpha, KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """out = sum_s softmax_s(logit) v_s and lse per (token, head); alpha [S, N, heads] when write_alpha."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E, KEY_MODE)
    S = S_t + 1
    PR = 4 * S_t  # slot i's prior at fmeta[PR + i], its eps at fmeta[EP + i]
    EP = PR + S
    # the routing weights (diagnostics): each slot's logit kept in alpha as it is computed, turned into
    # exp(logit - lse) at the end (masked off unless write_alpha: a runtime flag, one kernel for both)
    NH = N * heads
    a_ptr = alpha + rows * heads + h
    amask = rmask & write_alpha
    qt = tl.load(q + rows[:, None] * sq + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32).to(ACC)
    l_i = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32).to(ACC)
    # one online softmax over the embedding, then the table (completed summaries, the partial block last)
    v, x, lraw, _ = _source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                            kmask, qt, K, scale, key_norm, KEY_MODE, ACC)
    logit = lraw + tl.load(fmeta + PR).to(ACC)
    tl.store(a_ptr, logit, mask=amask)
    m_i, l_i, acc = _online(m_i, l_i, acc, logit, v)
    for s in range(S_t):
        v, lraw = _table_source(meta, fmeta, s, S_t, EP, rows, rmask, vcols, emask, kcols, kmask, qt, K, scale,
                                key_norm, KEY_MODE, VDT, KDT, ACC)
        logit = lraw + tl.load(fmeta + PR + 1 + s).to(ACC)
        tl.store(a_ptr + (1 + s) * NH, logit, mask=amask)
        m_i, l_i, acc = _online(m_i, l_i, acc, logit, v)
    lse_n = m_i + tl.log(l_i)
    tl.store(out + rows[:, None] * D + vcols[None, :], (acc / l_i[:, None]).to(out.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    tl.store(lse + rows * heads + h, lse_n, mask=rmask)
    tl.debug_barrier()  # (the logits are read back, possibly by other threads)
    for s in range(S * write_alpha):
        tl.store(a_ptr + s * NH, tl.exp(tl.load(a_ptr + s * NH, mask=rmask, other=0.0) - lse_n), mask=rmask)


# ---- the backward read, in chunks of CH columns: no tensor wider than a [BLOCK_N, CH] tile ----------------
# Per source, two passes over its columns: the first sums <g, v>, <x, q> and <x, x> (the row's reductions),
# the second writes dv = alpha g, and on the key's columns dk = scale rstd dl q - dl (l - b) rstd^2 x / k
# (plus alpha g where the key lies in the value: there dk is the value's gradient on those columns). The
# query's gradient accumulates across sources in its output, read back by the program that wrote it.


@triton.jit
def _tile(p, stride, rows, rmask, cols, cmask, ACC: tl.constexpr):
    """[BLOCK_N, CH] of rows `rows` and columns `cols` of a row-major tensor, in ACC (masked: 0)."""
    return tl.load(p + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                   other=0.0).to(ACC)


@triton.jit
def _bwd_source(vp, sv, kp, sk, dvp, dkp, sdk, prior, eps, rows, rmask, pid_n, h, E, VE, K, KOFF, D, R, q, sq, gout,
                dq, lse_n, delta, scale, key_norm, key_in_value, query_per_token, FIRST: tl.constexpr,
                ACC: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """One source's value and key gradients (written) and its share of the query's gradient (added to dq)."""
    cc = tl.arange(0, CH)
    # pass 1: <g, v> over the value's own columns [0, VE) (all E, or those left of a key lying in the value),
    # then over the key's columns <x, q>, <x, x>, and <g, x> where the key is part of the value
    gv = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
    for c0 in range(0, VE, CH):
        cm = c0 + cc < VE
        g = _tile(gout, D, rows, rmask, h * E + c0 + cc, cm, ACC)
        gv += tl.sum(g * _tile(vp, sv, rows, rmask, h * E + c0 + cc, cm, ACC), 1)
    xq = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
    xx = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)
    for c0 in range(0, K, CH):
        cm = c0 + cc < K
        x = _tile(kp, sk, rows, rmask, h * K + c0 + cc, cm, ACC)
        xq += tl.sum(x * _tile(q, sq, rows, rmask, h * K + c0 + cc, cm, ACC), 1)
        xx += tl.sum(x * x, 1)
        gv += tl.sum(_tile(gout, D, rows, rmask, KOFF + h * K + c0 + cc, cm & key_in_value, ACC) * x, 1)
    rstd = _rstd(xx, K, eps, key_norm)
    lraw = scale * rstd * xq
    a = tl.exp(lraw + prior - lse_n)
    dl = a * (gv - delta)  # d loss / d logit
    c1 = scale * rstd * dl
    c2 = tl.where(key_norm, dl * lraw * rstd * rstd / K, 0.0)  # through rstd: d rstd / dx = -rstd^3 x / k
    # pass 2: the gradients
    for c0 in range(0, VE, CH):
        cm = c0 + cc < VE
        g = _tile(gout, D, rows, rmask, h * E + c0 + cc, cm, ACC)
        tl.store(dvp + rows[:, None] * D + (h * E + c0 + cc)[None, :], (a[:, None] * g).to(dvp.dtype.element_ty),
                 mask=rmask[:, None] & cm[None, :])
    for c0 in range(0, K, CH):
        cm = c0 + cc < K
        kc = h * K + c0 + cc
        x = _tile(kp, sk, rows, rmask, kc, cm, ACC)
        dx = c1[:, None] * _tile(q, sq, rows, rmask, kc, cm, ACC) - c2[:, None] * x
        gk = _tile(gout, D, rows, rmask, KOFF + kc, cm & key_in_value, ACC)  # 0 for a key of its own
        tl.store(dkp + rows[:, None] * sdk + kc[None, :], (a[:, None] * gk + dx).to(dkp.dtype.element_ty),
                 mask=rmask[:, None] & cm[None, :])
        dqx = c1[:, None] * x
        if query_per_token:
            dq_p = dq + rows[:, None] * R + kc[None, :]
            dq_m = rmask[:, None] & cm[None, :]
            if not FIRST:
                dqx += tl.load(dq_p, mask=dq_m, other=0.0)
            tl.store(dq_p, dqx, mask=dq_m)
        else:
            dqs = tl.sum(dqx, 0)
            if not FIRST:
                dqs += tl.load(dq + pid_n * R + kc, mask=cm, other=0.0)
            tl.store(dq + pid_n * R + kc, dqs, mask=cm)
    tl.debug_barrier()  # (the next source reads dq back, possibly in other threads)


@triton.jit(do_not_specialize=["N", "heads", "S_t", "E", "VE", "K"])
def read_bwd(ev, sev, ek, sek, meta, fmeta, q, sq, out, lse, gout, dev, dek, sdk, dq,
             N, D, R, KOFF, heads, S_t, E, VE, K, scale, key_norm, key_in_value, query_per_token,
             VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """Gradients of one read: dv (and dk) of every source; dq per token, or per tile (the caller sums tiles).
    E, K: a head's value and key widths; VE: the value's columns left of its key (E - K when the key lies in
    the value, key_in_value: KOFF its first column, and dk points into dv) or E."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    S = S_t + 1
    PR = 4 * S_t
    EP = PR + S
    DV = EP + S  # the table's dv pointers, then its dk pointers
    DK = DV + S_t
    cc = tl.arange(0, CH)
    delta = tl.zeros([BLOCK_N], dtype=tl.float32).to(ACC)  # <g, h> = sum_s alpha_s <g, v_s>
    for c0 in range(0, E, CH):
        cm = c0 + cc < E
        delta += tl.sum(_tile(gout, D, rows, rmask, h * E + c0 + cc, cm, ACC)
                        * _tile(out, D, rows, rmask, h * E + c0 + cc, cm, ACC), 1)
    lse_n = tl.load(lse + rows * heads + h, mask=rmask, other=0.0)
    _bwd_source(ev, sev, ek, sek, dev, dek, sdk, tl.load(fmeta + PR).to(ACC), tl.load(fmeta + EP).to(ACC), rows,
                rmask, pid_n, h, E, VE, K, KOFF, D, R, q, sq, gout, dq, lse_n, delta, scale, key_norm, key_in_value,
                query_per_token, True, ACC, BLOCK_N, CH)
    for s in range(S_t):
        vp = tl.load(meta + s).to(tl.pointer_type(VDT))
        kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
        dvp = tl.load(meta + DV + s).to(tl.pointer_type(VDT))
        dkp = tl.load(meta + DK + s).to(tl.pointer_type(KDT))
        _bwd_source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), dvp, dkp, sdk,
                    tl.load(fmeta + PR + 1 + s).to(ACC), tl.load(fmeta + EP + 1 + s).to(ACC), rows, rmask, pid_n,
                    h, E, VE, K, KOFF, D, R, q, sq, gout, dq, lse_n, delta, scale, key_norm, key_in_value,
                    query_per_token, False, ACC, BLOCK_N, CH)
