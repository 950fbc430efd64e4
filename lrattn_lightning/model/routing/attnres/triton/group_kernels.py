"""The two-phase block reads' kernels (kernels.py: the math, the table layout): group_fwd / group_bwd (phase 1,
the completed sources once for all G sites of a block) and merge_fwd / merge_bwd (phase 2, a site's partial
block). Imports only triton and kernel_parts.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lrattn_lightning.model.routing.attnres.triton.kernel_parts import _layout, _load, _rstd, _source

# ---- two-phase block reads: the completed sources once for all G sites of a block (a group) -----------
# Phase 1 (group_fwd): the G static queries of a group's sites against the completed sources C (embedding +
# finished summaries), one online softmax per site, the sources read once:
#     out_g = sum_{s in C} softmax_s(l_gs) v_s        lse_g = logsumexp_{s in C} l_gs      (per depth head)
# Phase 2 (merge_fwd), at each site g whose block has a partial p: the online-softmax step over C + {p}
#     w = sigmoid(l_p - lse_g)        h = out_g + w (v_p - out_g)
# Backward of phase 2: d out_g = (1 - w) gh, dv_p = w gh, dl_p = <gh, v_p - out_g> w (1 - w), d lse_g = -dl_p.
# Backward of phase 1, with d out_g = g_g and d lse_g = gl_g from phase 2:
#     dl_gs = alpha_gs (<g_g, v_s> - <g_g, out_g> + gl_g)     dv_s = sum_g alpha_gs g_g
# and the key and query gradients of the single read, summed over g. Every tile holds the G sites at once
# ([BLOCK_N, BLOCK_G, BLOCK_E]; BLOCK_G >= G, masked), so each source is loaded once per group.


@triton.jit
def _group_source(vp, sv, kp, sk, eps, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale, key_norm,
                  KEY_MODE: tl.constexpr, ACC: tl.constexpr):
    """_source for the G queries Qt [BLOCK_G, W] at once: value, key, raw logits [BLOCK_N, BLOCK_G], rstd."""
    v, x = _load(vp, sv, kp, sk, rows, rmask, vcols, emask, kcols, kmask, KEY_MODE, ACC)
    rstd = _rstd(tl.sum(x * x, 1), K, eps, key_norm)
    return v, x, scale * rstd[:, None] * tl.sum(x[:, None, :] * Qt[None, :, :], 2), rstd


@triton.jit
def _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale, key_norm,
                 KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr):
    """Completed summary `s` of the pointer table against the G queries (_group_source)."""
    EP = 5 * S_t + 1
    vp = tl.load(meta + s).to(tl.pointer_type(VDT))
    kp = tl.load(meta + 2 * S_t + s).to(tl.pointer_type(KDT))
    eps = tl.load(fmeta + EP + 1 + s).to(ACC)
    return _group_source(vp, tl.load(meta + S_t + s), kp, tl.load(meta + 3 * S_t + s), eps, rows, rmask, vcols,
                         emask, kcols, kmask, Qt, K, scale, key_norm, KEY_MODE, ACC)


@triton.jit
def _group_online(m_i, l_i, acc, logit, v):
    m_new = tl.maximum(m_i, logit)
    corr = tl.exp(m_i - m_new)
    p = tl.exp(logit - m_new)
    return m_new, l_i * corr + p, acc * corr[:, :, None] + p[:, :, None] * v[:, None, :]


@triton.jit(do_not_specialize=["N", "heads", "S_t", "G"])
def group_fwd(ev, sev, ek, sek, meta, fmeta, q, out, lse, alpha, N, D, R, KOFF, heads, S_t, G, scale, key_norm,
              write_alpha, KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
    """Phase 1: out [G, N, D] and lse [G, N, heads] of the G sites q [G, R]; alpha [S_t + 1, N, heads, G]."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E, KEY_MODE)
    PR = 4 * S_t
    EP = PR + S_t + 1
    gs = tl.arange(0, BLOCK_G)
    gmask = gs < G
    ng = rmask[:, None] & gmask[None, :]
    NHG = N * heads * G  # the weights as in read_fwd: logits kept, exp(logit - lse) at the end
    a_ptr = alpha + (rows[:, None] * heads + h) * G + gs[None, :]
    amask = ng & write_alpha
    Qt = tl.load(q + gs[:, None] * R + kcols[None, :], mask=gmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    m_i = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32).to(ACC)
    l_i = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32).to(ACC)
    acc = tl.zeros([BLOCK_N, BLOCK_G, BLOCK_E], dtype=tl.float32).to(ACC)
    v, _, lraw, _ = _group_source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask, kcols,
                                  kmask, Qt, K, scale, key_norm, KEY_MODE, ACC)
    logit = lraw + tl.load(fmeta + PR).to(ACC)
    tl.store(a_ptr, logit, mask=amask)
    m_i, l_i, acc = _group_online(m_i, l_i, acc, logit, v)
    for s in range(S_t):
        v, _, lraw, _ = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                     key_norm, KEY_MODE, VDT, KDT, ACC)
        logit = lraw + tl.load(fmeta + PR + 1 + s).to(ACC)
        tl.store(a_ptr + (1 + s) * NHG, logit, mask=amask)
        m_i, l_i, acc = _group_online(m_i, l_i, acc, logit, v)
    lse_ng = m_i + tl.log(l_i)
    o_ptr = out + gs[None, :, None] * N * D + rows[:, None, None] * D + vcols[None, None, :]
    tl.store(o_ptr, (acc / l_i[:, :, None]).to(out.dtype.element_ty), mask=ng[:, :, None] & emask[None, None, :])
    tl.store(lse + gs[None, :] * N * heads + rows[:, None] * heads + h, lse_ng, mask=ng)
    tl.debug_barrier()
    for s in range((S_t + 1) * write_alpha):
        tl.store(a_ptr + s * NHG, tl.exp(tl.load(a_ptr + s * NHG, mask=ng, other=0.0) - lse_ng), mask=ng)


@triton.jit
def _group_bwd_source(v, x, lraw, rstd, prior, dvp, dkp, rows, rmask, vcols, emask, kcols, kmask, K, D, R, Qt, g3,
                      delta, lse_ng, glse, scale, dQt, key_norm, KEY_MODE: tl.constexpr):
    """One completed source's value and key gradients over the G sites (written); the queries' share added."""
    a = tl.exp(lraw + prior - lse_ng)  # [BLOCK_N, BLOCK_G]
    dl = a * (tl.sum(g3 * v[:, None, :], 2) - delta + glse)
    dv = tl.sum(a[:, :, None] * g3, 1)
    c1 = scale * rstd[:, None] * dl
    dx = tl.sum(c1[:, :, None] * Qt[None, :, :], 1)
    dx = dx - tl.where(key_norm, tl.sum(dl * lraw, 1) * rstd * rstd / K, 0.0)[:, None] * x  # (as in read_bwd)
    if KEY_MODE == 0:
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        tl.store(dkp + rows[:, None] * R + kcols[None, :], dx.to(dkp.dtype.element_ty),
                 mask=rmask[:, None] & kmask[None, :])
    tl.store(dvp + rows[:, None] * D + vcols[None, :], dv.to(dvp.dtype.element_ty),
             mask=rmask[:, None] & emask[None, :])
    return dQt + tl.sum(c1[:, :, None] * x[:, None, :], 0)


@triton.jit(do_not_specialize=["N", "heads", "S_t", "G"])
def group_bwd(ev, sev, ek, sek, meta, fmeta, q, out, lse, gout, glse, dev, dek, dq, N, D, R, KOFF, heads, S_t, G,
              scale, key_norm, KEY_MODE: tl.constexpr, VDT: tl.constexpr, KDT: tl.constexpr,
              ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_G: tl.constexpr):
    """Phase 1's gradients: dv (and dk) of every completed source; dq [tiles, G, R] per tile (summed outside)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         KEY_MODE)
    PR = 4 * S_t
    EP = PR + S_t + 1
    DV = EP + S_t + 1
    DK = DV + S_t
    gs = tl.arange(0, BLOCK_G)
    gmask = gs < G
    ng = rmask[:, None] & gmask[None, :]
    m3 = ng[:, :, None] & emask[None, None, :]
    o_off = gs[None, :, None] * N * D + rows[:, None, None] * D + vcols[None, None, :]
    g3 = tl.load(gout + o_off, mask=m3, other=0.0).to(ACC)
    delta = tl.sum(g3 * tl.load(out + o_off, mask=m3, other=0.0).to(ACC), 2)  # <g_g, out_g>
    l_off = gs[None, :] * N * heads + rows[:, None] * heads + h
    lse_ng = tl.load(lse + l_off, mask=ng, other=0.0)
    gl = tl.load(glse + l_off, mask=ng, other=0.0).to(ACC)
    qmask = gmask[:, None] & kmask[None, :]
    Qt = tl.load(q + gs[:, None] * R + kcols[None, :], mask=qmask, other=0.0).to(ACC)
    dQt = tl.zeros_like(Qt)
    v, x, lraw, rstd = _group_source(ev, sev, ek, sek, tl.load(fmeta + EP).to(ACC), rows, rmask, vcols, emask,
                                     kcols, kmask, Qt, K, scale, key_norm, KEY_MODE, ACC)
    dQt = _group_bwd_source(v, x, lraw, rstd, tl.load(fmeta + PR).to(ACC), dev, dek, rows, rmask, vcols, emask,
                            kcols, kmask, K, D, R, Qt, g3, delta, lse_ng, gl, scale, dQt, key_norm, KEY_MODE)
    for s in range(S_t):
        v, x, lraw, rstd = _group_table(meta, fmeta, s, S_t, rows, rmask, vcols, emask, kcols, kmask, Qt, K, scale,
                                        key_norm, KEY_MODE, VDT, KDT, ACC)
        dvp = tl.load(meta + DV + s).to(tl.pointer_type(VDT))
        dkp = tl.load(meta + DK + s).to(tl.pointer_type(KDT))
        dQt = _group_bwd_source(v, x, lraw, rstd, tl.load(fmeta + PR + 1 + s).to(ACC), dvp, dkp, rows, rmask, vcols,
                                emask, kcols, kmask, K, D, R, Qt, g3, delta, lse_ng, gl, scale, dQt, key_norm,
                                KEY_MODE)
    tl.store(dq + pid_n * G * R + gs[:, None] * R + kcols[None, :], dQt, mask=qmask)


@triton.jit(do_not_specialize=["N", "heads"], do_not_specialize_on_alignment=["lsec"])
def merge_fwd(pv, spv, pk, spk, fmeta, q, outc, lsec, out, w, N, D, R, KOFF, heads, scale, key_norm,
              KEY_MODE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """Phase 2 at one site: h = out_c + w (v_p - out_c), w = sigmoid(l_p - lse_c); w [N, heads] kept."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         KEY_MODE)
    qt = tl.load(q + rows[:, None] * 0 + kcols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC)
    v, _, lraw, _ = _source(pv, spv, pk, spk, tl.load(fmeta + 1).to(ACC), rows, rmask, vcols, emask, kcols, kmask,
                            qt, K, scale, key_norm, KEY_MODE, ACC)
    omask = rmask[:, None] & emask[None, :]
    o = tl.load(outc + rows[:, None] * D + vcols[None, :], mask=omask, other=0.0).to(ACC)
    lse_n = tl.load(lsec + rows * heads + h, mask=rmask, other=0.0)
    wp = 1.0 / (1.0 + tl.exp(lse_n - (lraw + tl.load(fmeta).to(ACC))))
    tl.store(out + rows[:, None] * D + vcols[None, :], (o + wp[:, None] * (v - o)).to(out.dtype.element_ty),
             mask=omask)
    tl.store(w + rows * heads + h, wp, mask=rmask)


@triton.jit(do_not_specialize=["N", "heads"])
def merge_bwd(pv, spv, pk, spk, fmeta, q, outc, w, gout, doutc, dlsec, dpv, dpk, dq, N, D, R, KOFF, heads, scale,
              key_norm, KEY_MODE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """Phase 2's gradients: d out_c, d lse_c, the partial's dv (and dk); dq [tiles, R] per tile."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows, rmask, vcols, emask, kcols, kmask, K = _layout(pid_n, h, N, D, R, KOFF, heads, BLOCK_N, BLOCK_E,
                                                         KEY_MODE)
    qmask = rmask[:, None] & kmask[None, :]
    qt = tl.load(q + rows[:, None] * 0 + kcols[None, :], mask=qmask, other=0.0).to(ACC)
    v, x, lraw, rstd = _source(pv, spv, pk, spk, tl.load(fmeta + 1).to(ACC), rows, rmask, vcols, emask, kcols,
                               kmask, qt, K, scale, key_norm, KEY_MODE, ACC)
    omask = rmask[:, None] & emask[None, :]
    o_off = rows[:, None] * D + vcols[None, :]
    o = tl.load(outc + o_off, mask=omask, other=0.0).to(ACC)
    g = tl.load(gout + o_off, mask=omask, other=0.0).to(ACC)
    wp = tl.load(w + rows * heads + h, mask=rmask, other=0.0).to(ACC)
    dl = tl.sum(g * (v - o), 1) * wp * (1.0 - wp)  # d loss / d l_p
    tl.store(doutc + o_off, ((1.0 - wp)[:, None] * g).to(doutc.dtype.element_ty), mask=omask)
    tl.store(dlsec + rows * heads + h, -dl, mask=rmask)
    dv = wp[:, None] * g
    c1 = scale * rstd * dl
    dx = c1[:, None] * qt
    dx = dx - tl.where(key_norm, dl * lraw * rstd * rstd / K, 0.0)[:, None] * x  # (as in read_bwd)
    if KEY_MODE == 0:
        dv = dv + tl.where(kmask[None, :], dx, 0.0)
    else:
        tl.store(dpk + rows[:, None] * R + kcols[None, :], dx.to(dpk.dtype.element_ty), mask=qmask)
    tl.store(dpv + o_off, dv.to(dpv.dtype.element_ty), mask=omask)
    tl.store(dq + pid_n * R + kcols, tl.sum(c1[:, None] * x, 0), mask=kmask)
