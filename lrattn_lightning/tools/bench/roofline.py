"""The physical floor of depth routing: the bytes a training step must move for it, and the time that takes.

Routing adds < 1 % of the FLOPs (accounting.py), so its floor is memory traffic. The model below counts
what *any* implementation has to stream, per token, in units of one value vector (D elements of the
activation dtype, e bytes each); a key of width R counts R / D. Groups, partial sources and blocks are
those of the two-phase algorithm (model/routing/attnres/fast.py): group k is the read sites that see the same k + 1
completed sources (embedding + k block summaries); a site whose block has begun also reads the partial
source (the running sum of the block's outputs so far). Full routing is block routing with one-output
blocks: every site is its own group and there are no partial sources.

    forward                                         backward
    sum_k S_k     completed sources, read once      M           grad h_j read once per site
                  per group (all the group's sites  3 sum_k S_k value-gradient accumulators: per group
                  in one pass; a value/sliced key   - n_src       read v_s (the weights' gradient dots of
                  is part of the value read)                      all the group's sites) and read + write
    P             partial sources, read once                      grad v_s; the first group to reach a
    M             h_j written once per site                       source writes without reading
    3 P           block running sums (read sum and  2 P         partial: read v_p, write grad v_p
                  output, write sum)                3 P         the partial's gradient added into its block's
                                                    3 rho n_src key gradient (value / sliced keys): read
                                                                the key, read + write its rows of grad v_s

with S_k = k + 1 sources of group k, P = number of sites with a partial source (= sum over blocks of
count - 1), M = 2L read sites with queries, n_src = completed sources, rho = R / D (1 for value keys).
Keys that are carried next to the value (P-LR `projected`, `value_projected`) add rho x (the reads of
their sources per group and per partial, the running key sums, in backward their gradients: 2 per
source and per partial read, 3 per running sum), and P-LR normalises each emitted key where it is
emitted (read + write forward, read key + read grad + write grad backward, per sublayer and the
embedding).

The routing *replaces* the residual stream, which moves 3 M forward (h = h + o) and 3 M backward (the
stream's gradient added to the sublayer input's): the floor of the step-time difference to the baseline
is the net traffic (routing - residual) at the measured bandwidth, plus the key-row matmuls of P-LR (and
value-projected keys) at the measured matmul peak. Not counted: softmax statistics and weights (O(S G)
floats per token against O(S D) value elements), parameters and their gradients (queries: O(M R)).

The two ceilings, the matmul peak (`measure_peak_flops`) and the memory bandwidth (`measure_bandwidth`),
are measured on the spot with the clock the steps are timed with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig
from lrattn_lightning.model.routing.attnres.options import key_dim


@dataclass(frozen=True)
class Traffic:
    """Bytes per step (all tokens) that routing moves, and the FLOPs of its matmuls (key rows)."""

    forward_bytes: float
    backward_bytes: float
    residual_bytes: float  # what the residual stream it replaces moves (same phases)
    matmul_flops: float  # P-LR / value-projected key rows (forward, or x3 for training)
    units: dict  # the counts behind it, per token, in value vectors (for the docs and tests)

    @property
    def routing_bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes

    @property
    def net_bytes(self) -> float:
        return self.routing_bytes - self.residual_bytes

    def floor_s(self, bandwidth: float, peak_flops: float) -> float:
        """Seconds of the step-time difference to the baseline that no implementation can remove."""
        return max(self.net_bytes, 0.0) / bandwidth + self.matmul_flops / peak_flops

    def to_dict(self) -> dict:
        return {**asdict(self), "routing_bytes": self.routing_bytes, "net_bytes": self.net_bytes}


def _groups(cfg: ModelConfig) -> tuple[list[int], list[int], list[int]]:
    """(sites per group, partial sites per group, output count per block) of an attnres config."""
    M = cfg.size.n_sublayers
    ends = cfg.block_ends() or list(range(1, M + 1))  # full routing: every output is a block
    bounds = [0, *ends]
    sites, partials = [], []
    for k in range(len(bounds)):
        hi = bounds[k + 1] if k + 1 < len(bounds) else M + 1
        group = list(range(max(bounds[k], 1), hi))
        sites.append(len(group))
        partials.append(sum(1 for j in group if j > bounds[k]))
    counts = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return sites, partials, counts


def routing_traffic(
    size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None, *, tokens: int, value_bytes: int,
    training: bool = True,
) -> Traffic:
    """The minimal-traffic model of the module docstring for one step over `tokens` tokens: TRAFFIC's model for the
    kind, else the stream's (stream_traffic)."""
    cfg = size if isinstance(size, ModelConfig) else ModelConfig(size, ablation)
    return TRAFFIC.get(cfg.kind.name, stream_traffic)(cfg, tokens, value_bytes, training)


def stream_traffic(cfg: ModelConfig, tokens: int, value_bytes: int, training: bool) -> Traffic:
    """A kind without softmax depth attention: the stream itself (net 0), and the kind's FLOPs (gated: its d x d
    matmuls)."""
    from lrattn_lightning.model.accounting import added_flops

    M = cfg.size.n_sublayers
    vector = tokens * cfg.size.d_model * value_bytes  # bytes of one value vector over all tokens
    flops = (added_flops(cfg) or 0) * tokens * (3 if training else 1)
    units = {"forward": 3 * M, "backward": 3 * M if training else 0, "residual": 3 * M * (2 if training else 1)}
    return Traffic(3 * M * vector, units["backward"] * vector, units["residual"] * vector, float(flops), units)


def depth_attention_traffic(cfg: ModelConfig, tokens: int, value_bytes: int, training: bool) -> Traffic:
    """AttnRes's softmax attention over depth sources: the model of the module docstring."""
    from lrattn_lightning.model.accounting import added_flops, sources_per_site

    s, a = cfg.size, cfg.options
    M, D = s.n_sublayers, s.d_model
    vector = tokens * D * value_bytes  # bytes of one value vector over all tokens
    mult = 3 if training else 1
    sites, partials, counts = _groups(cfg)
    reads = sum(k + 1 for k, n in enumerate(sites) if n)  # sum_k S_k over groups with sites
    n_src = len(counts) + 1  # embedding + blocks
    P = sum(partials)  # = sum over blocks of (count - 1)
    rho = 1.0 if a.key_source == "value" else key_dim(cfg) / D
    forward = reads + P + M + 3 * P
    backward = M + 3 * reads - n_src + 2 * P + 3 * P
    carried = a.key_source in ("projected", "value_projected", "value_projected_shared")
    if carried:
        forward += rho * (reads + P + 3 * P)
        backward += rho * (2 * n_src + 2 * P + 3 * P)
        if a.key_source == "projected" and a.key_norm == "rms":
            forward += rho * 2 * (M + 1)
            backward += rho * 3 * (M + 1)
    else:
        backward += 3 * rho * n_src
    # key-row matmuls (P-LR, value-projected keys): what accounting adds beyond the reads' FLOPs
    read_flops = sum(sources_per_site(cfg)) * (2 * key_dim(cfg) + 2 * D)
    matmul = added_flops(cfg) - read_flops if carried else 0
    residual = 3 * M * (2 if training else 1)
    if not training:
        backward = 0
    units = {"group_reads": reads, "partials": P, "sites": M, "sources": n_src, "key_ratio": rho,
             "forward": forward, "backward": backward, "residual": residual}
    return Traffic(forward * vector, backward * vector, residual * vector, float(matmul * tokens * mult), units)


# The traffic model of a kind with softmax attention over depth sources, by kind; every other kind moves the plain
# stream's traffic (stream_traffic: the deliberate default, written once).
TRAFFIC = {"attnres": depth_attention_traffic}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device, dtype, clock: Callable[[], float] = time.perf_counter) -> float:
    """FLOP/s of the best of a few large square matmuls in `dtype` on `device`, timed with `clock` (the
    clock the steps are timed with: with --clock cpu, FLOP per CPU-second, like the steps).

    Side 4096 on CUDA, 1024 on CPU; on a CPU where one such product takes over 0.1 s (a dtype it emulates:
    bfloat16 without AVX-512 BF16 or AMX took 2.4 s, so 85 s for the measurement) the largest power of two from
    256 up whose product fits in 0.1 s, so a slow dtype is measured in about a second."""
    import torch

    n = 4096 if device.type == "cuda" else _cpu_side(dtype)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(8):
        _sync(device)
        t0 = clock()
        for _ in range(4):
            a @ b
        _sync(device)
        if i:  # the first call warms up
            best = min(best, (clock() - t0) / 4)
    return 2 * n**3 / max(best, 1e-12)


def _cpu_side(dtype, limit_s: float = 0.1, largest: int = 1024) -> int:
    import torch

    n = 256
    while n < largest:
        a = torch.randn(2 * n, 2 * n, dtype=dtype)
        a @ a  # warm
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > limit_s:
            break
        n *= 2
    return n


def measure_bandwidth(device, clock: Callable[[], float] = time.perf_counter, mib: int | None = None) -> float:
    """Bytes/s of the best of a few large out-of-place adds (c = a + b: two reads and a write), timed with
    `clock` (the clock the steps are timed with). The tensors are larger than any last-level cache."""
    import torch

    n = (mib or (1024 if device.type == "cuda" else 64)) * 2**20 // 4
    a = torch.rand(n, device=device)
    b = torch.rand(n, device=device)
    c = torch.empty_like(a)
    best = float("inf")
    for i in range(8):
        _sync(device)
        t0 = clock()
        torch.add(a, b, out=c)
        _sync(device)
        if i:  # the first call warms up (page faults, caches)
            best = min(best, clock() - t0)
    return 3 * n * 4 / max(best, 1e-9)
