"""Delta Attention Residuals (Luo, Cai, Hu 2026, docs/method.md §9-10; `routing: delta_attnres`).

The plain residual stream is kept, and a softmax read over *deltas* is added to what each sublayer sees:

    s_j      = o_0 + o_1 + ... + o_j                                  the residual stream after sublayer j
    k_i      = RMSNorm(v_i; eps) * g_j                                a learned norm weight per read site
    h_j      = s_j + sum_{i in S_j} softmax_i(<q_j, k_i>) v_i         (+ the null source)

read before sublayer j + 1 (j = 0..2L-1); the head reads the plain stream s_2L. This is the public code
(wdlctc/delta-attention-residuals-code, `delta_attn_res`, gate type `bias`: the read is used as it is), in
two modes (`mode`, under `delta_attnres:` in the registry; flat `delta_mode`):

`delta` (the default): the sources v_i are the embedding o_0 and every sublayer output o_i so far. The
embedding is source 0 once the first sublayer has written, so the first sublayer reads o_0 itself.

`delta_block`: the sources are block summaries b_k. Blocks 1..K are P = `block_layers` layers each
(layers (k-1)P .. kP-1; a shorter last block is allowed, as in the public code); the default null is the
public code's rule P = max(1, ceil(L / N)) with N = 4 blocks, the count every published run of it passes (its
config class says 8). At layer kP (k = 0..K-1), with H_k the plain stream entering it and D_k = H_k - H_{k-1}
the sum of block k's outputs, b_k joins the sources:

    b_0 = H_0 = o_0                                       the embedding
    b_k = H_k - b_{k-1}       (recursive, the default)    = D_k + D_{k-2} + ... (+ o_0 for even k)
    b_k = H_k - H_{k-1} = D_k (`block_sources: true_delta`)

`recursive` is what the public code computes (`partial_block - blocks[-1]` at a block's first layer; the
per-block accumulation in its model forward is commented out), not the block delta its comments name
("block-aggregated deltas"); `true_delta` is that block delta. b_k joins after layer kP's attention: that
layer's MLP read sees it, its attention read does not. The last block's outputs never become a source (the
head reads the plain stream).

In both modes the norm is an RMSNorm with a learned weight (initialised to 1, eps 1e-6 as the public config
default) per read site; the query is a learned d-vector per site, initialised N(0, init_std) as the public
code's Linear init leaves it (not zero); no logit scale. `null_source: true` prepends a learned zero-initialised
d-vector to every read's sources (the public code's identity option: a softmax that picks it adds nothing;
it also gives site 0 a read). Without it site 0 has no sources and no parameters (the public code holds
an unused query there); every later read has at least one source in both modes.

    params = sites x (2 d [+ d with the null source])     sites = 2L - 1 (2L with the null source)
    FLOPs/token = sum_j |S_j| (2 d + 2 d + d) + d         logits, weighted sum, the norm weight; the add
                  + (K - 1) d                             delta_block: one subtraction per block start after
                                                          the first (K = ceil(L / P) blocks)
    |S_j| = j + 1 (delta)   |S_j| = ceil(l / P) for an attention read, floor(l / P) + 1 for an MLP read of layer
            l (delta_block)   (+ 1 with the null source)

Depth routing is per token: KV-cache decoding needs no cache of its own. Every parameter is one d-vector per
site, so AdamW takes them all under muon_adamw. Diagnostics ("depth_weights"): a recording pass keeps each
read's softmax over its sources, [S_j, B, T, 1] (the null source first), as AttnRes does; the read is added to
the plain stream, so these weights say how the added term is made, not how much of the stream it is.

Shape legend: S sources, B batch, T tokens, D = d_model, J read sites, P layers per block, K blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig, SizeConfig
from lrattn_lightning.model.options import PositiveInt
from lrattn_lightning.model.routing._math import autocast_off, compute_dtype
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router

NORM_EPS = 1e-6  # the public code's RMSNorm eps (its config default)
PUBLIC_BLOCKS = 4  # the public code's block count in every published delta_block run (--num_blocks 4)
DeltaMode = Literal["delta", "delta_block"]
BlockSources = Literal["recursive", "true_delta"]  # (not "true": YAML reads that as a boolean)


def block_layers(cfg: ModelConfig) -> int:
    """P, the layers per block of delta_block: the option, or the public code's max(1, ceil(L / 4))."""
    P = cfg.options.block_layers
    return P if P is not None else max(1, math.ceil(cfg.size.n_layers / PUBLIC_BLOCKS))


@dataclass
class DeltaState:
    stream: Tensor  # s_j, the plain residual stream [B, T, D]
    deltas: list[Tensor] = field(default_factory=list)  # the sources: o_0, o_1, ... (delta); b_0, b_1, ... (block)
    weights: list[Tensor] | None = None  # recording: per read site, the softmax over its sources [S, B, T, 1]
    block_start: Tensor | None = None  # delta_block, true_delta: H_{k-1}, the stream entering the last block


class DeltaAttnResRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d, self.std, self.null = cfg.size.d_model, cfg.size.init_std, cfg.options.null_source
        sites = cfg.size.n_sublayers if self.null else cfg.size.n_sublayers - 1  # reads j = first..2L-1
        self.first = 0 if self.null else 1
        self.block = block_layers(cfg) if cfg.options.mode == "delta_block" else None
        self.recursive = cfg.options.block_sources == "recursive"
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
        if self.block is None:
            if not state.deltas:
                state.deltas.append(state.stream)  # the embedding joins the sources with the first output
            state.deltas.append(out)
        elif i % 2 and (i // 2) % self.block == 0:  # the attention of a block's first layer wrote: H_k joins
            H = state.stream  # (after that attention's read, before its MLP's)
            if state.deltas:
                H = H - (state.deltas[-1] if self.recursive else state.block_start)
            state.deltas.append(H)
            state.block_start = state.stream
        state.stream = state.stream + out

    def read(self, state: DeltaState, j: int) -> Tensor:
        if j < self.first or j >= self.queries.shape[0] + self.first:  # site 0 without null; the final read
            return state.stream
        site = j - self.first
        sources = list(state.deltas)
        if self.null:
            sources.insert(0, self.null_sources[site].expand_as(state.stream))
        dtype = compute_dtype(state.stream.dtype)
        with autocast_off(state.stream.device):  # the read in float32 (float64 models: 64)
            V = torch.stack([s.to(dtype) for s in sources])  # [S, B, T, D]
            K = F.rms_norm(V, (self.d,), eps=NORM_EPS) * self.key_norm_weight[site].to(dtype)
            alpha = (K * self.queries[site].to(dtype)).sum(-1).softmax(dim=0)  # [S, B, T]
            added = (alpha.unsqueeze(-1) * V).sum(0)
        if state.weights is not None:
            state.weights.append(alpha.detach().float().unsqueeze(-1))
        return state.stream + added.to(state.stream.dtype)


@dataclass(frozen=True)
class DeltaAttnResOptions(KindOptions):
    """`delta_attnres: {mode: delta_block, block_sources: true_delta}` (flat: delta_mode, delta_block_*)."""

    flat_names: ClassVar[dict[str, str]] = {"mode": "delta_mode", "block_layers": "delta_block_layers",
                                            "block_sources": "delta_block_sources"}
    null_source: bool = False  # a zero source the softmax can pick, so the added term can vanish
    mode: DeltaMode = "delta"  # sources: every sublayer output, or block summaries
    block_layers: PositiveInt | None = None  # P, layers per block (None: the public code's ceil(L / 4))
    block_sources: BlockSources = "recursive"  # b_k = H_k - b_{k-1} (the public code) or H_k - H_{k-1}

    def clipped_to(self, size: SizeConfig) -> dict[str, Any]:
        P = self.block_layers
        return {"block_layers": max(1, size.n_layers - 1)} if P is not None and P >= size.n_layers else {}

    def rules(self, where: str) -> None:
        if self.mode == "delta":
            mode = self.name_of("mode")
            for name, default in (("block_layers", None), ("block_sources", "recursive")):
                if getattr(self, name) != default:
                    raise self.error(where, name, f"only {mode}: delta_block reads it; set {mode}: delta_block or "
                                                  "drop the field")


def read_sources(cfg: ModelConfig) -> list[int]:
    """|S_j| for the read sites j = first..2L-1 (first: 0 with the null source, else 1)."""
    null = int(cfg.options.null_source)
    first = 0 if null else 1
    if cfg.options.mode == "delta":
        return [(j + 1 if j else 0) + null for j in range(first, cfg.size.n_sublayers)]
    P = block_layers(cfg)  # read j is layer j // 2's attention (even j) or MLP (odd j)
    return [(j // 2 // P + 1 if j % 2 else math.ceil(j // 2 / P)) + null for j in range(first, cfg.size.n_sublayers)]


class DeltaAttnResKind(UnkeyedKind):
    """Unkeyed: its keys are the sources themselves (no key rows), and delta_block's blocks are its own
    (block_layers), not AttnRes's block summaries."""

    name = "delta_attnres"
    Options = DeltaAttnResOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        P, L = cfg.options.block_layers, cfg.size.n_layers
        if P is not None and P >= L:
            raise cfg.options.error(where, "block_layers", f"{P} layers per block leave no block after the first in "
                                                            f"{L} layers; choose 1..{L - 1} (or null)")

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return DeltaAttnResRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        return len(read_sources(cfg)) * cfg.size.d_model * (3 if cfg.options.null_source else 2)

    def added_flops(self, cfg: ModelConfig) -> int:
        d = cfg.size.d_model
        starts = 0 if cfg.options.mode == "delta" else math.ceil(cfg.size.n_layers / block_layers(cfg)) - 1
        return sum(n * 5 * d + d for n in read_sources(cfg)) + starts * d

    def adamw_names(self, router: nn.Module) -> None:
        return None  # one d-vector per site, each: AdamW

    def code_paths(self, options: DeltaAttnResOptions) -> list[str]:
        return []


KIND = DeltaAttnResKind()
