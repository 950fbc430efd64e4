"""LAuReL, the learned augmented residual layer (Menghani et al., arXiv 2411.07501; docs/method.md §10; `routing: laurel`).

Every sublayer i = 1..2L (attention and MLP alike) writes back through its own learned residual. With x the
stream entering the sublayer and f = o_i what it computes from RMSNorm(x):

    rw      x' = a f + b x
    lr      x' = f + x + x A B                      A [d, r], B [r, d]: a rank-r term of the stream itself
    rw_lr   x' = a f + b (x + x A B)                (`mode`, default rw_lr; r: `rank`, default 16)

    (a, b) = 2 softmax(w), w [2] per sublayer       the same in rw and rw_lr; lr has no w (a = b = 1)

This is wdlctc/hyper-connection-factory's `LAuReL` connection (its defaults: rw_lr, r = 16): the low-rank term
reads x, the raw stream before the sublayer (not its pre-norm), so x A B augments the skip path; the head reads
the plain stream (no final mixing). Initialisation as there: w = 0 (a = b = 1 exactly), B = 0 and A "column
orthogonal", A[j, j mod r] = 1/sqrt(r d), else 0; so every entry starts as the baseline exactly (B = 0 alone
does that; A's start only shapes B's first gradients). Gemma 3n's `Gemma3nTextLaurelBlock` is another LR form,
not built here: around attention only, with n = the pre-normed input, it adds n + RMSNorm(n A B) (a gain) to the
attention's residual sum and scales the whole by 1/sqrt(2). The small math runs in float32 (float64 for float64 models) with autocast
off; the factory runs x A B in the autocast dtype and (a, b) in the parameters' float32 cast to the stream's.

    params/sublayer  rw 2          lr 2 d r          rw_lr 2 + 2 d r
    FLOPs/token      the module computes per sublayer x A (2 d r), (x A) B (2 d r), x + x A B (d), a f + b s (3 d);
                     the baseline's own add x + f (d, outside the core count) is not added, so per sublayer
                     rw 2 d          lr 4 d r + d       rw_lr 4 d r + 3 d          (times 2L)
                     (docs/method.md's ~4 d r + 5 d counts a f + b s as two multiply-adds, 4 d, and keeps the baseline's add)

Depth routing is per token: KV-cache decoding needs no cache of its own. AdamW takes every parameter under
muon_adamw, A and B too: the factory trains them so (its recipe has no Muon; the connection's parameters get
AdamW without weight decay, as our AdamW group's default), and its published comparison is what an entry
reproduces; they are small per-sublayer tables stored stacked [M, d, r] / [M, r, d], not the core's matrices.
Diagnostics ("mixing"): a recording pass keeps one heatmap row per sublayer: (a, b) where the mode has them,
then, where it has the low-rank term, |x A B| / |x|, the augment's size relative to the stream (L2 norms over
d, per token; 0 at the start).

Shape legend: B batch, T tokens, D = d_model, r = rank, M = 2L sublayers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig, SizeConfig
from lrattn_lightning.model.options import PositiveInt
from lrattn_lightning.model.routing._math import autocast_off, compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router

LaurelMode = Literal["rw", "lr", "rw_lr"]
DEFAULT_RANK = 16  # the factory's default


@dataclass
class LaurelState:
    stream: Tensor  # x [B, T, D], the plain stream the next sublayer reads
    weights: list[Tensor] | None = field(default=None)  # recording: per sublayer [(a, b) | |xAB|/|x|] as [S, B, T, 1]


class LaurelRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.options
        self.d, self.M, self.r = cfg.size.d_model, cfg.size.n_sublayers, a.rank
        self.rw, self.lr = a.mode in ("rw", "rw_lr"), a.mode in ("lr", "rw_lr")
        if self.rw:
            self.mix_logits = nn.Parameter(torch.empty(self.M, 2))  # w: (a, b) = 2 softmax(w)
        if self.lr:
            self.down = nn.Parameter(torch.empty(self.M, self.d, self.r))  # A
            self.up = nn.Parameter(torch.empty(self.M, self.r, self.d))  # B
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.rw:
                self.mix_logits.zero_()
            if self.lr:
                self.down.zero_()
                rows = torch.arange(self.d)
                self.down[:, rows, rows % self.r] = 1.0 / math.sqrt(self.r * self.d)
                self.up.zero_()

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> LaurelState:
        return LaurelState(emb_BTD, [] if record else None)

    def read(self, state: LaurelState, j: int) -> Tensor:
        return state.stream

    def write(self, state: LaurelState, i: int, out_BTE: Tensor) -> None:
        x, f = state.stream, out_BTE[..., : self.d]
        dtype = torch.promote_types(x.dtype, f.dtype)  # what the plain residual x + f would be
        row = []
        with autocast_off(x.device):
            ct = compute_dtype(dtype)
            xc, fc = x.to(ct), f.to(ct)
            skip = xc
            if self.lr:
                augment = (xc @ self.down[i - 1].to(ct)) @ self.up[i - 1].to(ct)  # x A B [B, T, D]
                skip = xc + augment
            if self.rw:
                ab = 2 * self.mix_logits[i - 1].to(ct).softmax(0)
                new = ab[0] * fc + ab[1] * skip
                row.append(ab.detach().float().view(2, 1, 1, 1))
            else:
                new = fc + skip
            if self.lr and state.weights is not None:
                size = augment.detach().norm(dim=-1) / xc.detach().norm(dim=-1).clamp_min(torch.finfo(ct).tiny)
                row.append(size.float().unsqueeze(0).unsqueeze(-1))  # [1, B, T, 1]
        state.stream = new.to(dtype)
        if state.weights is not None:
            shape = torch.broadcast_shapes(*(w.shape[1:] for w in row))
            state.weights.append(torch.cat([w.expand(w.shape[0], *shape) for w in row]))


@dataclass(frozen=True)
class LaurelOptions(KindOptions):
    """`laurel: {mode: rw_lr, rank: 16}` (flat: laurel_mode, laurel_rank)."""

    flat_names: ClassVar[dict[str, str]] = {"mode": "laurel_mode", "rank": "laurel_rank"}
    mode: LaurelMode = "rw_lr"  # rw: learned (a, b); lr: + x A B; rw_lr: both (the factory's default)
    rank: PositiveInt = DEFAULT_RANK  # r of the low-rank term (lr, rw_lr)

    def clipped_to(self, size: SizeConfig) -> dict[str, Any]:
        return {"rank": size.d_model} if self.mode != "rw" and self.rank > size.d_model else {}

    def rules(self, where: str) -> None:
        mode, rank = self.name_of("mode"), self.name_of("rank")
        if self.mode == "rw" and self.rank != DEFAULT_RANK:
            raise self.error(where, "rank", f"{mode} rw has no low-rank term; remove {rank}={self.rank} (over an "
                                            f"`extends`, reset it to {DEFAULT_RANK}) or choose {mode} lr or rw_lr")


class LaurelKind(UnkeyedKind):
    name = "laurel"
    Options = LaurelOptions

    @staticmethod
    def _modes(cfg: ModelConfig) -> tuple[bool, bool]:
        mode = cfg.options.mode
        return mode in ("rw", "rw_lr"), mode in ("lr", "rw_lr")

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        r, d, rank = cfg.options.rank, cfg.size.d_model, cfg.options.name_of("rank")
        if self._modes(cfg)[1] and r > d:
            raise cfg.options.error(where, "rank", f"{rank}={r} exceeds d_model={d}; choose {rank} <= {d}")

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return LaurelRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        rw, lr = self._modes(cfg)
        return cfg.size.n_sublayers * (2 * rw + 2 * cfg.size.d_model * cfg.options.rank * lr)

    def added_flops(self, cfg: ModelConfig) -> int:
        rw, lr = self._modes(cfg)
        d, r = cfg.size.d_model, cfg.options.rank
        return cfg.size.n_sublayers * ((4 * d * r + d) * lr + 2 * d * rw)

    def adamw_names(self, router: nn.Module) -> None:
        return None  # every parameter, A and B too (the module docstring says why)

    def code_paths(self, options: LaurelOptions) -> list[str]:
        return []


KIND = LaurelKind()
