"""The Muon update of one weight matrix: momentum, orthogonalisation, neuron-wise normalisation, scale.

For W (m x n) with gradient G, momentum buffer M and momentum mu:

    M <- mu M + (1 - mu) G                         (an EMA of the gradients)
    U <- (1 - mu) G + mu M    (nesterov)   or   U <- M
    O <- orth(U) ~ P Q^T, where U = P S Q^T is the SVD: every singular value pushed towards 1
    O <- O / sqrt(v) * ||O||_F / ||O / sqrt(v)||_F  (optional, "NorMuon"): v is an EMA (beta2) of the mean
         square of O over each row (m >= n) or each column (m < n); the rescale keeps ||O||_F
    W <- W - lr * scale(m, n) * O    with scale = sqrt(max(1, m / n))  ("original")
                                       or 0.2 * sqrt(max(m, n))        ("match_rms_adamw", update RMS ~ AdamW's)

Two orthogonalisers, both odd matrix polynomials p(X) = a X + b (X X^T) X + c (X X^T)^2 X applied to X
normalised so that its spectral norm is at most 1; on singular values p acts as a scalar quintic:
  * Polar Express (Amsel et al. 2025, arXiv:2505.16932): five quintics, each the minimax approximation of 1
    on the interval the previous ones left, for l = 1e-3, cushion 0.02, safety factor 1.02 (not on the last).
    It maps every singular value in [1e-3, 1] into [0.859, 1.141]. The paper's reference code runs it in
    bfloat16 between iterations and float32 inside each one; so does this.
  * Newton-Schulz with one fixed quintic (3.4445, -4.7750, 2.0315), five times, all in bfloat16:
    torch.optim.Muon's orthogonaliser (on random matrices the singular values end in about [0.68, 1.14]).

Both return bfloat16, as their originals do; the normalisation statistics are taken of that bfloat16 O.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from lrattn_lightning.core.errors import InputError

Orthogonalizer = Literal["polar_express", "newton_schulz"]
UpdateScale = Literal["original", "match_rms_adamw"]

# (a, b, c) per Polar Express iteration: the paper's composition for l = 1e-3, cushion 0.02, safety 1.02
# (tests/test_optim.py derives them again from the minimax conditions).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_STEPS = 5


def polar_express(g: torch.Tensor) -> torch.Tensor:
    """Polar Express on a matrix; bfloat16 result of the same shape."""
    x = g.bfloat16()
    wide = x.mT if g.size(-2) > g.size(-1) else x  # iterate on the wide orientation: X X^T is the small Gram
    # ||X||_F bounds the spectral norm; the 2 % cushion keeps rounding from pushing it past 1
    x = wide / (wide.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        xf = x.float()
        gram = xf @ xf.mT  # (m, m)
        poly = b * gram + c * (gram @ gram)
        x = (a * xf + poly @ xf).bfloat16()  # a X + (b A + c A^2) X
    return x.mT if g.size(-2) > g.size(-1) else x


def newton_schulz(g: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration; bfloat16 result of the same shape."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    tall = g.size(0) > g.size(1)
    x = g.bfloat16()
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(NEWTON_SCHULZ_STEPS):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x.T if tall else x


ORTHOGONALIZERS = {"polar_express": polar_express, "newton_schulz": newton_schulz}


def update_scale(rule: str, shape: torch.Size) -> float:
    m, n = shape[-2], shape[-1]
    if rule == "original":
        return math.sqrt(max(1.0, m / n))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    raise InputError(f"scale: '{rule}' is not one of {', '.join(get_args(UpdateScale))}")


def variance_shape(shape: torch.Size) -> tuple[int, int]:
    """One second-moment entry per row (tall or square) or per column (wide)."""
    m, n = shape[-2], shape[-1]
    return (m, 1) if m >= n else (1, n)


def normalize_neurons(o: torch.Tensor, variance: torch.Tensor, beta2: float) -> torch.Tensor:
    """O / sqrt(v), rescaled to O's Frobenius norm; updates the EMA v of O's row (or column) mean squares."""
    norm = o.norm(dim=(-2, -1), keepdim=True)
    reduce = -1 if variance.size(-1) == 1 else -2  # mean over each row's columns, or each column's rows
    variance.lerp_(o.square().mean(dim=reduce, keepdim=True).to(variance.dtype), 1 - beta2)
    out = o * variance.clamp(min=1e-10).rsqrt()
    return out * (norm / out.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-10))


def muon_direction(grad: torch.Tensor, state: dict, group: dict, whole=None) -> torch.Tensor:
    """The orthogonalised (and optionally normalised) direction O for one matrix, before lr and scale.
    `state` holds the momentum buffer (and the variance EMA); `group` the options. Under FSDP grad and the
    buffer are this rank's rows and `whole(u)` gathers the whole matrix, whose O every rank then computes."""
    momentum = group["momentum"]
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)
    u = grad.lerp(buf, momentum) if group["nesterov"] else buf
    if whole is not None:
        u = whole(u)
    o = ORTHOGONALIZERS[group["orthogonalizer"]](u)
    if group["variance_beta2"] is not None:
        o = normalize_neurons(o, state["variance"], group["variance_beta2"])
    return o
