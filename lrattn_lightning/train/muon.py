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

The dtype of the iteration (`dtype`, the optimiser's `orthogonalizer_dtype`, LRAttnModule's `muon_dtype`):
  * bfloat16: the originals' rounding, exactly (the recipe parity tests run it); the result is bfloat16 and the
    normalisation statistics are taken of that bfloat16 O;
  * float32: the same polynomials with every step in float32 (no rounding to bfloat16 anywhere), in the Gram
    form (below) where that takes fewer flops: the faster one without native bfloat16, and for Polar Express
    everywhere (its bfloat16 path multiplies in float32 too); O differs from bfloat16's by a median 10 % on real
    directions, from a float64 evaluation by 1e-5..1e-4 of its largest element (docs/benchmarks.md "Muon in
    float32 and batched").

The Gram form (float32 only). Each iteration is X_{k+1} = P_k X_k with P_k = a I + b A_k + c A_k^2 a polynomial
in A_k = X_k X_k^T, so P_k commutes with A_k and A_{k+1} = P_k A_k P_k: the iteration runs on the small (m, m)
Gram matrix, accumulating Q = P_{k-1} ... P_0, and touches the wide X (m, n) only to form a Gram matrix and to
apply Q. In exact arithmetic that is the same polynomial of X_0. In float32, Q's rounding grows with its norm (up
to ~1000 after five iterations: the product of the a's), to 2e-4..2e-3 of the result's largest element on
gradient-like spectra, so the form restarts once: X_2 = Q X_0 after two iterations, then three on X_2's Gram,
which keeps it within ~3x of the direct float32 evaluation (1e-5..1e-4; bfloat16's rounding: 1e-2..1). Five
iterations cost 28 m^3 + 8 m^2 n flops against 10 m^3 + 20 m^2 n, fewer where n > 1.5 m: 0.60-0.77x on the
(128, 352..704) matrices of `small` (a square one keeps the direct form, where the Gram form would cost 1.2x).
`resolve_muon_dtype` turns `auto` into one of them for a device.

Both orthogonalisers take a matrix (m, n) or a batch of same-shape matrices (B, m, n), each orthogonalised on its
own: the optimiser stacks a group's same-shape matrices into one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, get_args

import torch

from lrattn_lightning.core.errors import InputError

Orthogonalizer = Literal["polar_express", "newton_schulz"]
UpdateScale = Literal["original", "match_rms_adamw"]
OrthogonalizerDtype = Literal["bfloat16", "float32"]  # what an iteration runs in
MuonDtype = Literal["auto", "bfloat16", "float32"]  # the setting: auto resolves per device (resolve_muon_dtype)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# (a, b, c) per Polar Express iteration: the paper's composition for l = 1e-3, cushion 0.02, safety 1.02
# (tests/train/test_optim.py derives them again from the minimax conditions).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)
NEWTON_SCHULZ_STEPS = 5
GRAM_RESTART = 2  # the Gram form forms X again after this many iterations (module docstring)
GRAM_MIN_ASPECT = 1.5  # float32 takes the Gram form for a wide X (m, n) with n > 1.5 m: fewer flops there


def polar_express(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Polar Express on a matrix (m, n) or a batch (B, m, n); a result of the same shape in `dtype`.
    bfloat16: the reference's sequence, rounded to bfloat16 between iterations and float32 inside each; float32:
    float32 throughout (iterate_float32)."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    wide = x.mT if tall else x  # iterate on the wide orientation: X X^T is the small Gram
    # ||X||_F bounds the spectral norm; the 2 % cushion keeps rounding from pushing it past 1
    x = wide / (wide.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    if dtype == torch.float32:
        x = iterate_float32(x, POLAR_EXPRESS_COEFFS)
        return x.mT if tall else x
    for a, b, c in POLAR_EXPRESS_COEFFS:
        xf = x.float()
        gram = xf @ xf.mT  # (B, m, m)
        poly = b * gram + c * (gram @ gram)
        x = (a * xf + poly @ xf).to(dtype)  # a X + (b A + c A^2) X
    return x.mT if tall else x


def iterate_float32(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """X <- (a I + b A + c A^2) X with A = X X^T, once per (a, b, c), for a wide X (m <= n) in float32: in the Gram
    form where it takes fewer flops (n > 1.5 m, module docstring), else directly (direct_iteration)."""
    if x.size(-1) > GRAM_MIN_ASPECT * x.size(-2):
        return gram_iteration(x, coeffs)
    return direct_iteration(x, coeffs)


def direct_iteration(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, once per (a, b, c), in X's dtype: three GEMMs an iteration with the
    sums inside them (torch.optim.Muon's sequence)."""
    for a, b, c in coeffs:
        gram = x @ x.mT
        x = _addmm(x, _addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def gram_iteration(x: torch.Tensor, coeffs: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """X <- (a I + b A + c A^2) X with A = X X^T, once per (a, b, c), for a wide X (m <= n), on the Gram matrix:
    A_{k+1} = P_k A_k P_k and Q_{k+1} = P_k Q_k, then Q X; restarted from X_2 = Q_2 X_0 after the first two
    iterations (module docstring)."""
    for phase in (coeffs[:GRAM_RESTART], coeffs[GRAM_RESTART:]):
        if not phase:
            continue
        gram, q = x @ x.mT, None
        for i, (a, b, c) in enumerate(phase):
            poly = _addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
            poly.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
            q = poly if q is None else poly @ q
            if i < len(phase) - 1:
                gram = poly @ (gram @ poly)
        x = q @ x
    return x


def _addmm(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """beta * bias + alpha * m1 @ m2 in one call: torch.addmm on matrices (torch.optim.Muon's), baddbmm on batches."""
    return (torch.addmm if m1.ndim == 2 else torch.baddbmm)(bias, m1, m2, beta=beta, alpha=alpha)


def newton_schulz(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration on a matrix (m, n) or a batch (B, m, n), every step in
    `dtype` (bfloat16: torch's sequence; float32: iterate_float32); a result of the same shape in `dtype`."""
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    x = x.mT if tall else x
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    iterate = iterate_float32 if dtype == torch.float32 else direct_iteration
    x = iterate(x, (NEWTON_SCHULZ_COEFFS,) * NEWTON_SCHULZ_STEPS)
    return x.mT if tall else x


ORTHOGONALIZERS = {"polar_express": polar_express, "newton_schulz": newton_schulz}


# ---- which dtype `auto` means on a device ------------------------------------------------------------------------
# What decides "native bfloat16": a CUDA (or ROCm) device that computes it (compute capability >= 8.0); a CPU with
# AMX tiles (Sapphire Rapids and later) or AVX-512 BF16 (Cooper Lake, Zen 4 and later), which oneDNN's bfloat16
# matmuls use. torch.backends.cpu.get_cpu_capability() says only AVX512 / AVX2, not whether BF16 is among them;
# the CPU probes are private in torch (2.13), so where one is missing it counts as False.
TORCH_PROBES: dict[str, Callable[[], bool]] = {
    "cuda_bf16": lambda: torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False),
    "cpu_amx": lambda: bool(getattr(torch.cpu, "_is_amx_tile_supported", bool)()),
    "cpu_avx512_bf16": lambda: bool(getattr(torch.cpu, "_is_avx512_bf16_supported", bool)()),
}


def native_bfloat16(device_type: str, probes: Mapping[str, Callable[[], bool]] = TORCH_PROBES) -> bool:
    """Whether a device of this type computes bfloat16 natively (`probes`: torch's, or a test's)."""
    if device_type == "cuda":
        return probes["cuda_bf16"]()
    if device_type == "cpu":
        return probes["cpu_amx"]() or probes["cpu_avx512_bf16"]()
    return False  # mps, xpu, ...: float32 until measured


def resolve_muon_dtype(setting: str, device_type: str,
                       probes: Mapping[str, Callable[[], bool]] = TORCH_PROBES) -> OrthogonalizerDtype:
    """The orthogonalisers' dtype for `setting` (auto | bfloat16 | float32) on a device: auto is bfloat16 where the
    device computes it natively, float32 elsewhere, where emulated bfloat16 matmuls cost several times float32
    ones. Natively, Newton-Schulz's bfloat16 matmuls are the faster ones; Polar Express keeps float32 matmuls
    inside its bfloat16 iterations (the reference's rounding), so there bfloat16 buys the paper's numbers, not
    speed (docs/benchmarks.md "Muon in float32 and batched")."""
    if setting not in get_args(MuonDtype):
        raise InputError(f"muon_dtype: '{setting}' is not one of {', '.join(get_args(MuonDtype))}")
    if setting != "auto":
        return setting  # type: ignore[return-value]
    return "bfloat16" if native_bfloat16(device_type, probes) else "float32"


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


def momentum_direction(grad: torch.Tensor, buf: torch.Tensor, group: dict) -> torch.Tensor:
    """U, the direction to orthogonalise: M <- mu M + (1 - mu) G (in place), then U = (1 - mu) G + mu M (nesterov)
    or M itself."""
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if group["nesterov"] else buf


def orthogonalize(u: torch.Tensor, group: dict) -> torch.Tensor:
    """O for a matrix or a batch of same-shape matrices, by the group's orthogonaliser in its dtype."""
    return ORTHOGONALIZERS[group["orthogonalizer"]](u, DTYPES[group["orthogonalizer_dtype"]])
