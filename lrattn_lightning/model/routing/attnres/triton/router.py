"""The `triton` AttnRes backend: each depth read is one fused Triton kernel (forward and backward).

Same parameters, state-dict names and results as `reference` (reference.py); only the read itself changes:

    h_j = sum_s softmax_s(scale * <q_j, RMSNorm(key_s)> + beta log c_s) v_s      (per depth head)

runs as `lrattn::attnres_read` (ops.py, kernels in kernels.py): the sources are not stacked
(the kernel reaches the completed block summaries through a pointer table), the key norm is never
materialised (<RMSNorm(x), q> = rstd <x, q>), the softmax is online in float32 with the logsumexp kept for
the hand-written backward, and the partial block is merged in the same pass. The keys come from the
router's key source (keys.py) exactly as for the other backends; the raw key is handed to the kernel,
which normalises it with the source's eps (a sliced key of a mean / sqrt-mean summary read from the
summary's value takes eps / c^(2a): _math.py). A key norm over the whole key with several depth heads
(depth_head_norm full, MHAR) is not the kernels' per-head norm: those keys are normalised here in the compute
dtype, as `reference` does, and reach the kernels as carried keys with their norm off (no kernel changes; the
key gain is folded into the query, and rms block summaries are ordinary values, as in every backend).

Under autocast the sources keep their dtypes (the float32 embedding, bfloat16 sublayer outputs and
summaries: the summaries share one dtype, cast once when stored); loads are converted to float32 and h is
returned in the promoted dtype, as the reference's stack would give. A float64 model routes in float64.

Each read and group read hands the completed sources on (views, ops.py's gradient chain) and the state keeps
those for the next read, so in backward each source's gradient is one buffer the reads' kernels add into.

Where it runs: CUDA, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported; slow, for tests). Elsewhere building it is one line naming the fix. Static and gated-dynamic
queries alike (the per-token query is an input of the kernel). KV-cache decoding needs no routing state.

Two-phase block reads (static queries): the read sites between two block ends form a group that sees the
same completed sources. At its first site one `lrattn::attnres_group` kernel reads those sources once for
all G sites (G online softmaxes in one tile) and keeps out_g and lse_g; each site whose block has a partial
merges it with `lrattn::attnres_merge` (w = sigmoid(l_p - lse_g), h = out_g + w (v_p - out_g)), as `fast`
does. Full routing (every group one site), per-token queries (gated dynamic: a site's query exists only once
the sublayer before it ran) read site by site with `lrattn::attnres_read`; a group whose tile would exceed
GROUP_TILE_MAX (the register budget, launch.py) is split into even sub-groups that fit, each one
`attnres_group` kernel (paper-0.5b, 8 blocks: the 6 sites of a block as 3 + 3; at d = 4096 with one depth
head no two sites fit, so those reads are site by site). Nothing has run on a GPU yet (docs/benchmarks.md).

Shape legend (docs/method.md letters): B batch, T tokens, N = B*T, D = d_model, r = key width, m = depth heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing._math import PartialBlock, compute_dtype, count_prior, rms_norm
from lrattn_lightning.model.routing.attnres.reference import AttnResRouter
from lrattn_lightning.model.routing.attnres.triton.launch import availability_error, check_device, group_limit
from lrattn_lightning.model.routing.attnres.triton.ops import attnres_merge, group, read


@dataclass
class TritonState:
    """One forward pass of the triton backend: the completed sources, as written (nothing stacked)."""

    embedding: Tensor  # [B, T, D]
    embedding_key: Tensor | None  # carried keys: the embedding's raw key [B, T, r]
    values: list[Tensor] = field(default_factory=list)  # completed block summaries [B, T, D]
    keys: list[Tensor] = field(default_factory=list)  # their raw keys [B, T, r] (carried keys only)
    counts: list[int] = field(default_factory=list)  # outputs each summary holds
    partial: PartialBlock = field(default_factory=PartialBlock)
    dynamic_query: Tensor | None = None  # what the last written sublayer emitted [B, T, r]
    weights: list[Tensor] | None = None  # per site j = 1..2L when recording: alpha [S_j, B, T, m]
    group: int = -1  # the two-phase group whose phase 1 is held below
    group_out: Tensor | None = None  # [G, N, D]
    group_lse: Tensor | None = None  # [G, N, m]
    group_alpha: Tensor | None = None  # [S, N, m, G] when recording

    def hand_on(self, handed: tuple) -> None:
        """The completed sources as the read just made handed them on (ops.read): the next read takes these, so
        each source's gradient runs along one chain of reads, each adding its share in the kernel."""
        self.embedding, self.embedding_key, values, keys = handed
        self.values, self.keys = list(values), list(keys)


class TritonAttnRes(AttnResRouter):
    """AttnRes with fused Triton reads (module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        error = availability_error()
        if error is not None:
            raise InputError(error)
        keys = self.key_source
        # a key norm over the whole key with several heads (depth_head_norm full) is not the kernels' per-head
        # norm: those keys are normalised here (as `reference` does) and reach the kernels as carried keys,
        # with the kernels' own key norm off
        self.norm_here = self.key_norm and self.full_norm
        self.carried = keys.carried or self.norm_here
        self.kernel_key_norm = self.key_norm and not self.norm_here
        self.key_offset = 0 if self.carried else self.d - self.rank  # value keys: r = d, offset 0
        # two-phase groups: the sites between two block ends (fast's grouping), where one kernel serves several;
        # a group wider than one kernel's tile holds (group_limit) is split into even sub-groups
        limit = group_limit(self.d, self.heads, self.rank)
        bounds = [0, *sorted(self.ends)]
        self.site_group: dict[int, tuple[int, int]] = {}  # j -> (group, index in it), two-phase sites only
        self.group_sites: dict[int, list[int]] = {}
        for b, lo in enumerate(bounds):
            hi = bounds[b + 1] if b + 1 < len(bounds) else self.n_sublayers + 1
            sites = list(range(max(lo, 1), hi))
            if len(sites) < 2 or self.dynamic_query or limit < 2:
                continue
            n_sub = -(-len(sites) // limit)
            for k in range(n_sub):
                sub = sites[k * len(sites) // n_sub : (k + 1) * len(sites) // n_sub]
                if len(sub) > 1:
                    grp = len(self.group_sites)
                    self.group_sites[grp] = sub
                    self.site_group.update({j: (grp, g) for g, j in enumerate(sub)})

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> TritonState:
        if not torch.compiler.is_compiling():
            check_device(emb_BTD.device)
        key = self._carried(self.key_source.embedding(emb_BTD))
        return TritonState(emb_BTD, key, partial=self.new_partial(), weights=[] if record else None)

    def write(self, state: TritonState, i: int, out_BTE: Tensor) -> None:
        value_BTD, key_BTr, state.dynamic_query = self.split_output(out_BTE)
        state.partial.add(value_BTD, key_BTr, i)
        if i in self.ends:  # the block is complete: summarise it once
            value, key = self.completed(state.partial)
            if state.values:  # the table holds one dtype (a no-op unless dtypes are mixed)
                value = value.to(state.values[0].dtype)
            state.values.append(value)
            if self.carried:
                key = self._carried(key)
                state.keys.append(key.to(state.keys[0].dtype) if state.keys else key)
            state.counts.append(state.partial.count)
            state.partial.clear()

    def read(self, state: TritonState, j: int) -> Tensor:
        """Hidden state at read site j (0..2L) -> [B, T, D]."""
        if j == 0:
            return state.embedding
        if j in self.site_group:
            return self._two_phase(state, j)
        part_v = part_k = None
        c = state.partial.count
        if c:
            part_v, key = self.key_source.summary(state.partial)
            part_k = self._carried(key)
            # the kernels see the partial as the table's last source: one dtype (as `write` casts a summary)
            if state.values and part_v.dtype != state.values[0].dtype:
                part_v = part_v.to(state.values[0].dtype)
            if state.keys and part_k is not None and part_k.dtype != state.keys[0].dtype:
                part_k = part_k.to(state.keys[0].dtype)
        query = self.site_query(self.queries, j, state.dynamic_query)
        out, alpha, handed = read(
            state.embedding, state.embedding_key, list(state.values), list(state.keys), part_v, part_k,
            query.contiguous(), self._consts(state, c, state.embedding.dtype), float(self.scale), self.heads,
            self.kernel_key_norm, self.key_offset, state.weights is not None)
        state.hand_on(handed)
        if state.weights is not None:
            B, T, _ = state.embedding.shape
            state.weights.append(alpha.detach().view(-1, B, T, self.heads).float())
        return out

    def _two_phase(self, state: TritonState, j: int) -> Tensor:
        """Site j of a group: phase 1 once per group (at its first site), then the partial merged."""
        grp, g = self.site_group[j]
        emb = state.embedding
        B, T, D = emb.shape
        record = state.weights is not None
        if state.group != grp:
            queries = torch.stack([self.site_query(self.queries, site) for site in self.group_sites[grp]])
            state.group_out, state.group_lse, state.group_alpha, handed = group(
                emb, state.embedding_key, list(state.values), list(state.keys), queries.contiguous(),
                self._consts(state, 0, emb.dtype), float(self.scale), self.heads, self.kernel_key_norm,
                self.key_offset, record)
            state.hand_on(handed)
            state.group = grp
        out_ND, c = state.group_out[g], state.partial.count
        alpha = state.group_alpha[..., g].detach() if record else None
        if c == 0:
            if record:
                state.weights.append(alpha.view(-1, B, T, self.heads).float())
            return out_ND.view(B, T, D)
        part_v, key = self.key_source.summary(state.partial)
        h, w = attnres_merge(out_ND, state.group_lse[g], part_v, self._carried(key),
                             self.site_query(self.queries, j).contiguous(), count_prior(self.count_prior, c),
                             self._eps(c, emb.dtype), float(self.scale), self.heads, self.kernel_key_norm,
                             self.key_offset)
        if record:
            w = w.detach()
            state.weights.append(torch.cat((alpha * (1 - w), w[None])).view(-1, B, T, self.heads).float())
        return h

    def _carried(self, key_BTr: Tensor) -> Tensor | None:
        """A raw key as the kernels take it: None when they read it from the value, normalised here over the
        whole key (in the compute dtype, as `reference`) when their per-head norm is not the one asked for."""
        if not self.carried:
            return None
        if self.norm_here:
            return rms_norm(key_BTr.to(compute_dtype(key_BTr.dtype)))
        return key_BTr

    def _consts(self, state: TritonState, partial_count: int, dtype: torch.dtype) -> list[float]:
        """Priors then eps of the slots embedding, summaries, partial (the kernel's meta layout)."""
        counts = [1, *state.counts, max(partial_count, 1)]
        return [count_prior(self.count_prior, n) for n in counts] + [self._eps(n, dtype) for n in counts]

    def _eps(self, count: int, dtype: torch.dtype) -> float:
        """The key norm's eps of a source summarising `count` outputs (the summary rule: _math.py)."""
        keys = self.key_source
        return torch.finfo(compute_dtype(dtype)).eps * (1.0 if keys.carried else keys.eps_factor(count))
