"""float64 references written out, for the tests of the fast paths: RMSNorm (whole and per head), the fused loss's (ce, z) formula and the Polar
Express iteration of the paper's Muon, with the relative error and the bfloat16 bound they are compared at."""

from __future__ import annotations

import functools

import torch

from helpers.paths import GOLDEN_DIR
from lrattn_lightning.train.losses import IGNORE_INDEX

# RMSNorm epsilon of float32 tensors: torch's default finfo(float32).eps, as in the paper's code
EPS = torch.finfo(torch.float32).eps
BF16_BOUND = 2e-2  # five bfloat16 steps of the largest element: one flipped rounding per iteration at most


@functools.cache
def muon_golden() -> dict:
    """tests/golden/muon_reference.pt: the paper's Muon run and its Polar Express coefficients."""
    return torch.load(GOLDEN_DIR / "muon_reference.pt", weights_only=True)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest magnitude."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def formula64(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ce = mean over counted tokens of lse_i - x_it_i, z = mean over all tokens of lse_i^2, in float64."""
    x_NV = logits.double().flatten(0, -2)
    t_N = targets.flatten()
    lse_N = (x_NV - x_NV.max(-1, keepdim=True).values).exp().sum(-1).log() + x_NV.max(-1).values
    counted = t_N != IGNORE_INDEX
    picked_N = x_NV[counted].gather(1, t_N[counted][:, None]).squeeze(1)
    return (lse_N[counted] - picked_N).mean(), lse_N.pow(2).mean()


def polar_express_float64(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Polar Express iteration with every step in float64 (whatever `dtype` the optimiser asks for): X <- G /
    (1.02 ||G||_F + 1e-6) on the wide orientation, then X <- a X + (b A + c A^2) X with A = X X^T (the golden
    file's float64 run is the same). A matrix or a batch of them."""
    tall = g.size(-2) > g.size(-1)
    x = g.double().mT if tall else g.double()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in muon_golden()["polar_express_coefficients"]:
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def ref_rms_norm(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dimension, written out; eps defaults to finfo(x.dtype).eps."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_head_rms_norm(x: torch.Tensor, heads: int, eps: float | None = None) -> torch.Tensor:
    shape = x.shape
    return ref_rms_norm(x.reshape(*shape[:-1], heads, shape[-1] // heads), eps).reshape(shape)
