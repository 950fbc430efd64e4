"""The `fast` AttnRes backend: the same parameters and results as `reference`, less memory traffic.

The math is the reference's (reference.py, _math.py); only the order of work changes. The buffers and
autograd Functions are in fast_functions.py.

1. Logits at write time. Queries are static (one learned vector per read site), so the logits of a
   source against *every* later site are computed once, when the source is written: one
   [N, r] @ [r, J] matmul per source. With key norm, <RMSNorm(x), q> = rstd <x, q>: the normalised
   key is never materialised, and its backward needs only the stored logits (`_key_grads` in
   fast_functions.py). The key gradients of all sites that read a source are folded in one matmul.
   With depth_head_norm full one rstd spans every head's slice, and the norm's backward sums over heads.

2. Two-phase block routing (AttnRes report). The read sites between two block ends form a *group*:
   they all see the same completed sources C (embedding + finished block summaries). Phase 1 runs once
   per group, when its first site is read: a float32 softmax over C for all G sites of the group and
   their weighted sums (a bmm over tokens per site, reading the value buffer in place):

       out_C[g] = sum_{s in C} alpha_{g,s} v_s        lse_C[g] = logsumexp_{s in C} logit_{g,s}

   Phase 2, at each site of the group, merges the partial block source p (if non-empty) by an
   online-softmax update, which is the same softmax over C + {p}:

       w_p = sigmoid(l_p - lse_C)      h_j = out_C + w_p (v_p - out_C)      (per depth head)

   Its backward needs <grad h, out_C> = sum_s alpha_s <grad h, v_s>: the bmm the group's backward
   needs anyway, so out_C is not saved and the bmm runs once. Full routing is block routing with one
   sublayer per block: the partial source is always empty at a read and phase 2 never runs.

3. Completed sources live in buffers allocated once per forward pass (values [S_max, N, D], logits
   [S_max, N, m, J]), written once: no stacking or copying of the growing source list at each read.
   The buffers are outside autograd. `StoreSource` writes a source and returns a dependency token;
   `GroupRead` takes the tokens of the sources it reads, so autograd runs every read's backward before
   the store's. In backward the reads accumulate value and logit gradients into buffers, and
   `StoreSource.backward` turns them into the source's gradient (through the key norm) and the
   queries'. Saved for backward: the value buffer once, partial values, small float32 tensors.

Dynamo cannot trace the Functions over buffers: under torch.compile, use the `compiled` backend
(compiled.py); this one raises. The gated dynamic query (per-token queries: no logits at write
time) is outside this backend's premise: `build_router` serves it with `compiled`'s plain tensor ops.

Precision: logits, softmax weights and gradient accumulators are in the compute dtype
promote_types(dtype, float32) (float64 for a float64 model); "float32" above means that dtype.
RMSNorm's eps is finfo(compute dtype).eps. A sliced key of a mean/sqrt-mean block summary is the
slice of the *raw* sum (as the paper's code forms it); the value buffer holds the summary v / c^a, and
RMSNorm(c^a x) = x rstd with eps / c^(2a), so such a source's key norm uses that smaller eps.

Repeated backward (retain_graph=True): the accumulators are reset when the embedding's store runs its
backward, which autograd always runs last (every read depends on it).

Shape legend (docs/method.md letters): S sources, J = 2L read sites, G sites of a group, B batch, T tokens,
N = B*T, D = d_model, r = key width (the rank; d for key_source value), m = depth heads, k = r/m,
e = D/m.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import PartialBlock, count_prior
from lrattn_lightning.model.routing.attnres.fast_functions import (
    GroupRead,
    PartialRead,
    Plan,
    SourceBuffers,
    StoreSource,
)
from lrattn_lightning.model.routing.attnres.reference import AttnResRouter


@dataclass
class FastState:
    """One forward pass of the fast backend: its buffers and the current group's phase-1 results."""

    embedding: Tensor  # site 0 reads it unchanged
    queries: Tensor  # [J, r], query-normed and gained if configured (computed once per pass)
    buffers: SourceBuffers
    shape: tuple[int, int, int]  # B, T, D
    partial: PartialBlock = field(default_factory=PartialBlock)
    tokens: list[Tensor] = field(default_factory=list)  # one dependency token per stored source
    group: int = -1
    group_out: list[Tensor] | tuple[Tensor, ...] = ()  # per site g of the group: [N, D]
    group_lse: list[Tensor] | tuple[Tensor, ...] = ()  # per site g: [N, m] float32
    group_alpha: Tensor | None = None  # [S, N, m, G] float32, detached
    weights: list[Tensor] | None = None  # per site j = 1..2L when recording: alpha [S_j, B, T, m]


class FastAttnRes(AttnResRouter):
    """AttnRes computed as in the module docstring (static queries only; see `build_router`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if self.dynamic_query:
            raise InputError("routing backend 'fast' does not serve query 'gated_dynamic' (per-token queries); "
                             "use impl 'compiled' or 'reference'")
        M = self.n_sublayers  # 2L
        bounds = [0, *sorted(self.ends)]
        self.group_sites: list[list[int]] = []  # group grp: the sites reading sources 0..grp
        self.site_group: dict[int, tuple[int, int]] = {}  # j -> (group grp, index g in the group)
        for grp in range(len(bounds)):
            hi = bounds[grp + 1] if grp + 1 < len(bounds) else M + 1
            sites = list(range(max(bounds[grp], 1), hi))
            self.group_sites.append(sites)
            for g, j in enumerate(sites):
                self.site_group[j] = (grp, g)
        counts = [1] + [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.plan = Plan(
            heads=self.heads, rank=self.rank, scale=self.scale, key_norm=self.key_norm, keys=self.key_source,
            full_norm=self.full_norm,
            first_column=[max(b, 1) - 1 for b in bounds], counts=counts,
            prior=[count_prior(self.count_prior, c) for c in counts], count_prior=self.count_prior,
        )

    # ---- the forward-pass protocol ----------------------------------------------------------------
    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> FastState:
        if torch.compiler.is_compiling():
            raise InputError("routing backend 'fast' cannot run under torch.compile (autograd Functions over "
                             "buffers); build the decoder with impl 'compiled'")
        B, T, D = emb_BTD.shape
        queries = self.static_queries()
        key_BTr = self.key_source.embedding(emb_BTD) if self.key_source.carried else None
        key_dtype = emb_BTD.dtype if key_BTr is None else key_BTr.dtype
        buffers = SourceBuffers(self.plan, len(self.group_sites), self.n_sublayers, B * T, D, emb_BTD.dtype,
                                key_dtype, emb_BTD.device)
        state = FastState(emb_BTD, queries, buffers, (B, T, D), partial=self.new_partial(),
                          weights=[] if record else None)
        state.tokens.append(StoreSource.apply(emb_BTD, key_BTr, queries, buffers))
        return state

    def write(self, state: FastState, i: int, out_BTE: Tensor) -> None:
        value_BTD, key_BTr, _ = self.split_output(out_BTE)
        state.partial.add(value_BTD, key_BTr, i)
        if i in self.ends:  # the block is complete: summarise it once
            value, key = self.completed(state.partial)
            key = key if self.key_source.carried else None
            state.tokens.append(StoreSource.apply(value, key, state.queries, state.buffers))
            state.partial.clear()

    def read(self, state: FastState, j: int) -> Tensor:
        if j == 0:
            return state.embedding
        grp, g = self.site_group[j]
        if state.group != grp:
            self._phase_one(state, grp)
        B, T, D = state.shape
        m = self.heads
        out_ND = state.group_out[g]
        alpha_SNm = state.group_alpha[..., g]
        if state.partial.count == 0:
            if state.weights is not None:
                state.weights.append(alpha_SNm.view(-1, B, T, m).float())
            return out_ND.view(B, T, D)
        # phase 2: merge the partial block p into the group's softmax (online-softmax update)
        v_p, key_p = self.key_source.summary(state.partial)
        key_p = key_p if self.key_source.carried else None
        h, w_Nm = PartialRead.apply(out_ND, state.group_lse[g], v_p, key_p, state.queries, alpha_SNm,
                                    state.buffers, j, state.partial.count, (grp, g))
        if state.weights is not None:
            state.weights.append(torch.cat((alpha_SNm * (1 - w_Nm), w_Nm[None])).view(-1, B, T, m).float())
        return h

    def _phase_one(self, state: FastState, grp: int) -> None:
        sites = self.group_sites[grp]
        S, c0, c1 = grp + 1, sites[0] - 1, sites[-1]
        if state.buffers.n_stored != S:
            raise RuntimeError(f"group {grp} read with {state.buffers.n_stored} sources stored, expected {S}")
        outputs = GroupRead.apply(state.buffers, grp, c0, c1, *state.tokens)
        G = c1 - c0
        state.group, state.group_alpha = grp, outputs[-1]
        state.group_out, state.group_lse = outputs[:G], outputs[G : 2 * G]
