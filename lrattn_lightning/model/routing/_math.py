"""The routing math every AttnRes backend calls: key norm, logits, block summaries (docs/method.md §2-3).

    rstd(x)          = 1 / sqrt(mean(x^2) + eps)            per depth head; eps = finfo(compute dtype).eps
    logit_{j,s}      = scale * rstd(x_s) * <x_s, q_j> + beta * log(c_s)
    summary value    = (o_i + ... + o_k) / c^a               c outputs; a = 0 sum, 1 mean, 1/2 sqrt_mean

<RMSNorm(x), q> = rstd(x) <x, q>: a backend may skip materialising the normalised key. The eps rule of a
summary's key read from its *value*: a sliced key is the slice of the raw sum c^a y (y the stored summary
value), and RMSNorm(c^a y) = y * rstd(y) with eps / c^(2a), so that key's rstd takes `summary_eps_factor`.

Routing computes in `compute_dtype`: float32 for bf16 and float32 models, float64 for float64 ones.
Shape legend (docs/method.md letters): N = B*T tokens, r = key width (the rank), m = depth heads, k = r/m,
J = 2L read sites.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing computes in: at least float32, float64 for float64 models."""
    return torch.promote_types(dtype, torch.float32)


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A region outside autocast on `device` (the routing reads in their compute dtype). The meta device, which
    autocast does not know, has nothing to disable: a step on meta tensors (tests/train/test_no_sync.py: any read of
    a device value raises there) runs every kind."""
    return contextlib.nullcontext() if device.type == "meta" else torch.autocast(device.type, enabled=False)


def rms_norm(x: Tensor) -> Tensor:
    """Parameter-free RMSNorm over the last dimension, eps = finfo(x.dtype).eps (torch's default)."""
    return F.rms_norm(x, (x.shape[-1],))


def head_rms_norm(x_r: Tensor, heads: int) -> Tensor:
    """RMSNorm of each of `heads` equal slices of the last dimension; same shape out."""
    if heads == 1:
        return rms_norm(x_r)
    return rms_norm(x_r.unflatten(-1, (heads, -1))).flatten(-2)


def rstd(x_Nmk: Tensor, eps_factor: float = 1.0) -> Tensor:
    """1 / sqrt(mean(x^2) + eps * eps_factor) per depth head -> [N, m, 1] in x's dtype (a vector norm)."""
    eps = torch.finfo(x_Nmk.dtype).eps * eps_factor
    norm = torch.linalg.vector_norm(x_Nmk, dim=-1, keepdim=True)
    return (norm.square() / x_Nmk.shape[-1] + eps).rsqrt()


def summary_eps_factor(count: int, exponent: float) -> float:
    """eps / finfo.eps for the key norm of a c-output summary's slice read from its value: c^-2a."""
    return count ** (-2 * exponent)


def logits(dots: Tensor, *, rstd: Tensor | None = None, scale: float = 1.0, prior: float | Tensor = 0.0) -> Tensor:
    """scale * rstd * <x, q> + prior, from the dot products <x, q> (rstd None: keys already normalised)."""
    if rstd is not None:
        dots = dots * rstd
    if scale != 1.0:
        dots = dots * scale
    if isinstance(prior, Tensor) or prior != 0.0:
        dots = dots + prior
    return dots


def count_prior(beta: float, count: int) -> float:
    """The prior beta * log(c) of a source summarising c outputs."""
    return beta * math.log(count)


def site_matmul(keys_Nmk: Tensor, queries_Jmk: Tensor) -> Tensor:
    """<x, q_j> for every key against every query, per depth head: [N, m, k] x [J, m, k] -> [N, m, J]."""
    N, m, k = keys_Nmk.shape
    if m == 1:
        return (keys_Nmk.view(N, k) @ queries_Jmk.view(-1, k).t()).view(N, 1, -1)
    return torch.bmm(keys_Nmk.transpose(0, 1), queries_Jmk.permute(1, 2, 0)).transpose(0, 1)


def summarise(total: Tensor, count: int, exponent: float) -> Tensor:
    """A block's summary of c outputs from their raw sum: total / c^a."""
    return total if exponent == 0.0 or count == 1 else total / (count**exponent)


@dataclass
class PartialBlock:
    """Raw running sums of the current block's outputs (full routing: a block of one output)."""

    value: Tensor | None = None  # sum of the values [B, T, D]
    key: Tensor | None = None  # sum of the emitted keys [B, T, r] (P-LR), else None
    count: int = 0
    last: int = 0  # the block's most recent sublayer (its projection keys value_projected)

    def add(self, value_BTD: Tensor, key_BTr: Tensor | None, i: int) -> None:
        """Add sublayer i's output (and its emitted key)."""
        if self.count == 0:
            self.value, self.key = value_BTD, key_BTr
        else:
            self.value = self.value + value_BTD
            if key_BTr is not None:
                self.key = self.key + key_BTr
        self.count += 1
        self.last = i

    def clear(self) -> None:
        self.value, self.key, self.count = None, None, 0
