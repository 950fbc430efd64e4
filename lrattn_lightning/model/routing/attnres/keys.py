"""Key sources (docs/method.md §3): where a source's routing key comes from, with its parameters and costs.

The key of a source summarising c outputs o_i (a single output: c = 1), as the paper's code forms it:
    value                  key = the summary value                       (standard AttnRes, r = d)
    sliced                 key = (sum o_i)[..., -r:]                     (S-LR; / c^a only without key norm)
    projected              key = sum_i RMSNorm(k_i), k_i the r extra output rows of sublayer i, normalised
                           per depth head where emitted                  (P-LR; / c^a only without key norm)
    value_projected        key = W_last RMSNorm(summary value)           (W_last: the block's most recent
                                                                          sublayer's projection)
    value_projected_shared the same with one W shared by every source
The embedding's key (`embedding_key`): value / sliced as above (for those key sources), or for the others
projected (P-LR: RMSNorm(W_0 o_0); value_projected: W_0 RMSNorm(o_0)), static (a learned r-vector s) or
projected_plus_static (the sum). A key here is *raw*: the read's key norm (key_norm: rms) comes after,
per depth head or over the whole key (`depth_head_norm`; `key_rstd`), with MHAR's learned gain (`key_gain`:
gamma_j per read site, [2L, r], init 1; <q_j, gamma_j * RMSNorm(k)> = <gamma_j * q_j, RMSNorm(k)>, so the
backends fold it into the query) counted here as a key parameter.

Each class declares its parameters and counts them (params, forward FLOPs per token: model/accounting.py
asks these). The parameters are registered on the router under flat names (`embedding_key_proj`,
`embedding_key_static`, `value_key_proj.N`): the checkpoint names, which the reference mapping
(tools/fidelity/) also uses. Every key parameter is initialised N(0, std) by the router.

Shape legend (docs/method.md letters): B batch, T tokens, D = d_model, r = key width (the rank).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import (
    PartialBlock,
    head_rms_norm,
    rms_norm,
    rstd,
    summarise,
    summary_eps_factor,
)
from lrattn_lightning.model.routing.attnres.options import key_dim


class KeySource:
    """The value itself as key (standard AttnRes): no parameters."""

    carried = False  # True: the key is not a view of the value (it must be kept beside it)

    def __init__(self, cfg: ModelConfig):
        s, a = cfg.size, cfg.options
        self.d, self.r, self.heads = s.d_model, key_dim(cfg), a.depth_heads
        self.n_layers, self.n_sublayers, self.d_mlp = s.n_layers, s.n_sublayers, s.d_mlp
        self.key_norm = a.key_norm == "rms"
        self.norm_groups = a.norm_groups  # the key norm's slices: m (per head) or 1 (full)
        self.key_gain = a.key_gain
        self.exponent = a.summary_exponent
        self.embedding_key = a.embedding_key
        self.owner: nn.Module | None = None

    def register(self, owner: nn.Module) -> None:
        """Create the parameters on `owner` (the router) under their checkpoint names."""
        self.owner = owner
        if self.key_gain:
            owner.key_gain = nn.Parameter(torch.ones(self.n_sublayers, self.r))  # gamma_j, site j in row j - 1

    def num_params(self) -> int:
        return self.n_sublayers * self.r if self.key_gain else 0

    def flops(self) -> int:
        """Forward FLOPs per token that forming the keys adds."""
        return 0

    # ---- keys -------------------------------------------------------------------------------------
    def from_value(self, value_BTD: Tensor) -> Tensor:
        """The key as a view of the value (value / sliced key sources only)."""
        return value_BTD

    def eps_factor(self, count: int) -> float:
        """Key norm eps / finfo.eps for a c-output summary's key taken `from_value` (_math docstring)."""
        return 1.0

    def embedding(self, emb_BTD: Tensor) -> Tensor:
        """The embedding's raw key."""
        return self.from_value(emb_BTD)

    def emitted(self, out_BTE: Tensor) -> Tensor | None:
        """The key a sublayer emits in extra output rows (P-LR), else None."""
        return None

    def summary(self, block: PartialBlock) -> tuple[Tensor, Tensor]:
        """(summary value, raw key) of a block's running sums."""
        value = summarise(block.value, block.count, self.exponent)
        return value, value


class SlicedKeys(KeySource):
    """S-LR: the last r dimensions of the value."""

    def from_value(self, value_BTD: Tensor) -> Tensor:
        return value_BTD[..., -self.r :]

    def eps_factor(self, count: int) -> float:
        return summary_eps_factor(count, self.exponent) if self.key_norm else 1.0

    def summary(self, block: PartialBlock) -> tuple[Tensor, Tensor]:
        value = summarise(block.value, block.count, self.exponent)
        raw = block.value[..., -self.r :]
        return value, (raw if self.key_norm else summarise(raw, block.count, self.exponent))


class _CarriedKeys(KeySource):
    """Keys kept beside the values; the embedding's key is projected, static or both."""

    carried = True

    @property
    def embedding_projected(self) -> bool:
        return self.embedding_key in ("projected", "projected_plus_static")

    @property
    def embedding_static(self) -> bool:
        return self.embedding_key in ("static", "projected_plus_static")

    def register(self, owner: nn.Module) -> None:
        super().register(owner)
        if self.embedding_static:
            owner.embedding_key_static = nn.Parameter(torch.zeros(self.r))

    def num_params(self) -> int:
        return super().num_params() + (self.r if self.embedding_static else 0)

    def _projected_embedding(self, emb_BTD: Tensor) -> Tensor:
        raise NotImplementedError

    def embedding(self, emb_BTD: Tensor) -> Tensor:
        parts = []
        if self.embedding_projected:
            parts.append(self._projected_embedding(emb_BTD))
        if self.embedding_static:
            parts.append(self.owner.embedding_key_static.to(emb_BTD.dtype).expand(*emb_BTD.shape[:-1], self.r))
        return sum(parts[1:], parts[0])


class ProjectedKeys(_CarriedKeys):
    """P-LR: r extra output rows of every sublayer's output projection, normalised where emitted."""

    def register(self, owner: nn.Module) -> None:
        if self.embedding_projected:
            owner.embedding_key_proj = nn.Linear(self.d, self.r, bias=False)
        super().register(owner)

    def _matrix_params(self) -> int:
        """The key rows (attention d -> d + r, MLP h -> d + r per layer) and the embedding's projection."""
        return self.n_layers * self.r * (self.d + self.d_mlp) + (self.r * self.d if self.embedding_projected else 0)

    def num_params(self) -> int:
        return super().num_params() + self._matrix_params()

    def flops(self) -> int:
        return 2 * self._matrix_params()

    def emit(self, key_BTr: Tensor) -> Tensor:
        """An emitted key, RMS-normalised per depth head or whole (with key norm)."""
        return head_rms_norm(key_BTr, self.norm_groups) if self.key_norm else key_BTr

    def emitted(self, out_BTE: Tensor) -> Tensor:
        # a copy of the r key rows: the norm's backward then holds [B, T, r], not a view that would keep the
        # whole [B, T, d + r] output alive until backward (P-LR's memory overhead was mostly that)
        return self.emit(out_BTE[..., self.d : self.d + self.r].contiguous())

    def _projected_embedding(self, emb_BTD: Tensor) -> Tensor:
        return self.emit(self.owner.embedding_key_proj(emb_BTD))

    def summary(self, block: PartialBlock) -> tuple[Tensor, Tensor]:
        value = summarise(block.value, block.count, self.exponent)
        return value, (block.key if self.key_norm else summarise(block.key, block.count, self.exponent))


class ValueProjectedKeys(_CarriedKeys):
    """Linear(d, r) of RMSNorm(value): one projection per sublayer (+ the embedding's when projected)."""

    shared = False

    @property
    def n_projections(self) -> int:
        return 1 if self.shared else self.n_sublayers + int(self.embedding_projected)

    def register(self, owner: nn.Module) -> None:
        super().register(owner)
        owner.value_key_proj = nn.ModuleList(nn.Linear(self.d, self.r, bias=False) for _ in range(self.n_projections))

    def num_params(self) -> int:
        return super().num_params() + self.n_projections * self.r * self.d

    def flops(self) -> int:  # one projection per source: the embedding (when projected) and each summary
        return 2 * (self.n_sublayers + int(self.embedding_projected)) * self.r * self.d

    def project(self, value_BTD: Tensor, index: int) -> Tensor:
        """W_index RMSNorm(v); index 0 is the embedding, i the sublayer i."""
        if self.shared:
            proj = self.owner.value_key_proj[0]
        else:
            proj = self.owner.value_key_proj[index - (0 if self.embedding_projected else 1)]
        return proj(rms_norm(value_BTD))

    def _projected_embedding(self, emb_BTD: Tensor) -> Tensor:
        return self.project(emb_BTD, 0)

    def summary(self, block: PartialBlock) -> tuple[Tensor, Tensor]:
        value = summarise(block.value, block.count, self.exponent)
        return value, self.project(value, block.last)


class SharedValueProjectedKeys(ValueProjectedKeys):
    """value_projected with one projection shared by all sources."""

    shared = True


def key_rstd(x_Nmk: Tensor, eps_factor: float, full: bool) -> Tensor:
    """The key norm's rstd [N, m, 1]: per depth head, or over the whole key (full), the same for every head."""
    if not full:
        return rstd(x_Nmk, eps_factor)
    N, m, k = x_Nmk.shape
    return rstd(x_Nmk.reshape(N, 1, m * k), eps_factor).expand(N, m, 1)


KEY_SOURCES: dict[str, type[KeySource]] = {
    "value": KeySource,
    "sliced": SlicedKeys,
    "projected": ProjectedKeys,
    "value_projected": ValueProjectedKeys,
    "value_projected_shared": SharedValueProjectedKeys,
}


def key_source(cfg: ModelConfig) -> KeySource:
    """The key source of an AttnRes config (without parameters until `register`)."""
    return KEY_SOURCES[cfg.options.key_source](cfg)
