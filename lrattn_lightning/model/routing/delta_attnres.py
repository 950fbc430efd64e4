"""Delta Attention Residuals (Luo, Cai, Hu 2026, SPEC §9; `routing: delta_attnres`).

The plain residual stream is kept, and a softmax read over the *deltas* (the embedding o_0 and each
sublayer's output o_i) is added to what each sublayer sees:

    s_j      = o_0 + o_1 + ... + o_j                                  the residual stream after sublayer j
    k_i      = RMSNorm(o_i; eps) * g_j                                a learned norm weight per read site
    h_j      = s_j + sum_{i in S_j} softmax_i(<q_j, k_i>) o_i         S_j = {o_0 .. o_j} (+ the null source)

read before sublayer j + 1 (j = 0..2L-1); the head reads the plain stream s_2L. This is the public code's
`delta` mode (wdlctc/delta-attention-residuals-code, `delta_attn_res`, gate type `bias`: the read is used
as it is): the embedding is source 0 once the first sublayer has written, so the first sublayer reads
o_0 itself; the norm is an RMSNorm with a learned weight (initialised to 1, eps 1e-6 as its default
config) per read site; the query is a learned d-vector per site, initialised N(0, init_std) as the public
code's Linear init leaves it (not zero); no logit scale. `null_source: true` prepends a learned zero-initialised
d-vector to every read's sources (the public code's identity option: a softmax that picks it adds nothing;
it also gives site 0 a read). Without it site 0 has no sources and no parameters (the public code holds
an unused query there). Its block mode (`delta_block`) is not built here.

    params = sites x (2 d [+ d with the null source])     sites = 2L - 1 (2L with the null source)
    FLOPs/token = sum_j |S_j| (2 d + 2 d + d) + d         logits, weighted sum, the norm weight; the add

Depth routing is per token: KV-cache decoding needs no cache of its own. Every parameter is one d-vector per
site, so AdamW takes them all under muon_adamw. Diagnostics ("depth_weights"): a recording pass keeps each
read's softmax over its sources, [S_j, B, T, 1] (the null source first), as AttnRes does; the read is added to
the plain stream, so these weights say how the added term is made, not how much of the stream it is.

Shape legend: S sources, B batch, T tokens, D = d_model, J read sites.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.core.errors import config_error
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, RoutingKind

NORM_EPS = 1e-6  # the public code's RMSNorm eps (its config default)


@dataclass
class DeltaState:
    stream: Tensor  # s_j, the plain residual stream [B, T, D]
    deltas: list[Tensor] = field(default_factory=list)  # o_0, o_1, ... once a sublayer has written
    weights: list[Tensor] | None = None  # recording: per read site, the softmax over its sources [S, B, T, 1]


class DeltaAttnResRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d, self.std, self.null = cfg.size.d_model, cfg.size.init_std, cfg.options.null_source
        sites = cfg.size.n_sublayers if self.null else cfg.size.n_sublayers - 1  # reads j = first..2L-1
        self.first = 0 if self.null else 1
        self.queries = nn.Parameter(torch.empty(sites, self.d))
        self.key_norm_weight = nn.Parameter(torch.empty(sites, self.d))
        if self.null:
            self.null_sources = nn.Parameter(torch.empty(sites, self.d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.queries.normal_(std=self.std)
            self.key_norm_weight.fill_(1.0)
            if self.null:
                self.null_sources.zero_()

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> DeltaState:
        return DeltaState(emb_BTD, weights=[] if record else None)

    def write(self, state: DeltaState, i: int, out_BTE: Tensor) -> None:
        out = out_BTE[..., : self.d]
        if not state.deltas:
            state.deltas.append(state.stream)  # the embedding joins the sources with the first output
        state.deltas.append(out)
        state.stream = state.stream + out

    def read(self, state: DeltaState, j: int) -> Tensor:
        if j < self.first or j >= self.queries.shape[0] + self.first:  # site 0 without null; the final read
            return state.stream
        site = j - self.first
        sources = list(state.deltas)
        if self.null:
            sources.insert(0, self.null_sources[site].expand_as(state.stream))
        dtype = compute_dtype(state.stream.dtype)
        with torch.autocast(state.stream.device.type, enabled=False):  # the read in float32 (float64 models: 64)
            V = torch.stack([s.to(dtype) for s in sources])  # [S, B, T, D]
            K = F.rms_norm(V, (self.d,), eps=NORM_EPS) * self.key_norm_weight[site].to(dtype)
            alpha = (K * self.queries[site].to(dtype)).sum(-1).softmax(dim=0)  # [S, B, T]
            added = (alpha.unsqueeze(-1) * V).sum(0)
        if state.weights is not None:
            state.weights.append(alpha.detach().float().unsqueeze(-1))
        return state.stream + added.to(state.stream.dtype)


@dataclass(frozen=True)
class DeltaAttnResOptions(KindOptions):
    null_source: bool = False  # a zero source the softmax can pick, so the added term can vanish

    def validate(self, where: str) -> None:
        if not isinstance(self.null_source, bool):
            raise config_error(where, "null_source", f"must be true or false, got {self.null_source!r}")


class DeltaAttnResKind(RoutingKind):
    name = "delta_attnres"
    Options = DeltaAttnResOptions
    diagnostics = "depth_weights"

    def diagnostic_axes(self, cfg: ModelConfig) -> dict:
        null = cfg.options.null_source
        sources = max(self._sources(cfg))
        first = 0 if null else 1
        return {"site_labels": [str(j) for j in range(first, cfg.size.n_sublayers)],
                "source_labels": (["null"] if null else []) + [str(i) for i in range(sources - int(null))],
                "site_axis": "read site j (its read is added to the stream sublayer j + 1 sees)",
                "source_axis": "source (null: the learned zero source; 0 = embedding, i = sublayer i's output)",
                "value": "mean softmax weight", "embedding_column": 1 if null else 0}

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return DeltaAttnResRouter(cfg)

    @staticmethod
    def _sources(cfg: ModelConfig) -> list[int]:
        """|S_j| for the read sites j = first..2L-1."""
        null = int(cfg.options.null_source)
        first = 0 if null else 1
        return [(j + 1 if j else 0) + null for j in range(first, cfg.size.n_sublayers)]

    def routing_params(self, cfg: ModelConfig) -> int:
        return len(self._sources(cfg)) * cfg.size.d_model * (3 if cfg.options.null_source else 2)

    def added_flops(self, cfg: ModelConfig) -> int:
        d = cfg.size.d_model
        return sum(n * 5 * d + d for n in self._sources(cfg))

    def adamw_names(self, router: nn.Module) -> None:
        return None  # one d-vector per site, each: AdamW


KIND = DeltaAttnResKind()
