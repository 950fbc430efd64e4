"""Analytic parameter counts and the paper's cost axis: added forward FLOPs per token (SPEC §4).

    core  = 2 L (4 d^2 + 3 d h)                       2 x non-embedding matmul parameters
    read  = sum_{j=1..2L} |S_j| (2 k + 2 d)           k = d for AttnRes, r for LR; site 0 is free
    proj  = KeySource.flops()                         forming the keys (routing/keys.py): P-LR's key rows
                                                      2 (L r (d + h) + r d), value_projected's 2 (2L [+1]) r d
          + 2 L r (d + h) + 2L 2r                     gated dynamic query: the query rows, the gating
    gated = 2L (4 d^2 + 5 d [+ 1 with a gate bias])   gated residual (SPEC §7): W_q, W_k, the dot, the mix
    added % = 100 (read + proj) / core

Parameters likewise: the 2L pseudo-queries, what the key source declares (KeySource.num_params), the
dynamic query's rows and gates. An external router (routing/external.py) has its module's real parameter
count and the FLOPs its `added_flops_per_token()` states, or None (unknown) without it.
"""

from __future__ import annotations

from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig
from lrattn_lightning.model.routing.keys import key_source


def _pair(size: SizeConfig | ModelConfig, ablation: AblationConfig | None) -> ModelConfig:
    return size if isinstance(size, ModelConfig) else ModelConfig(size, ablation)


def core_params(size: SizeConfig) -> int:
    """Non-embedding matmul parameters: attention 4 d^2 and SwiGLU 3 d h per layer."""
    d, h = size.d_model, size.d_mlp
    return size.n_layers * (4 * d * d + 3 * d * h)


def routing_params(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None) -> int:
    """Parameters that depth routing adds to the baseline."""
    cfg = _pair(size, ablation)
    s, a = cfg.size, cfg.ablation
    d, h, L, M = s.d_model, s.d_mlp, s.n_layers, s.n_sublayers
    if a.routing == "residual":
        return 0
    if a.routing == "gated":
        return M * 2 * d * d + (M if a.gate_bias != "none" else 0)  # W_q and W_k per sublayer; the biases b_i
    if a.routing == "external":
        from lrattn_lightning.model.routing.external import facts

        return facts(cfg)[0]
    r = cfg.key_dim
    n = M * r + key_source(cfg).num_params()  # the pseudo-queries, one per read site j = 1..2L; the keys'
    if a.query == "gated_dynamic":
        n += L * r * (d + h) + M * a.depth_heads  # the query rows of every output projection, the gates
    return n


def count_params(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None) -> int:
    cfg = _pair(size, ablation)
    s = cfg.size
    return 2 * s.vocab_size * s.d_model + core_params(s) + routing_params(cfg)


def sources_per_site(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None) -> list[int]:
    """|S_j| for j = 1..2L. For residual/gated routing: the j + 1 outputs the stream sums."""
    cfg = _pair(size, ablation)
    M = cfg.size.n_sublayers
    ends = cfg.block_ends()
    if not ends:
        return [j + 1 for j in range(1, M + 1)]
    counts = []
    for j in range(1, M + 1):
        done = [e for e in ends if e <= j]
        counts.append(1 + len(done) + int(j > (done[-1] if done else 0)))
    return counts


def core_flops(size: SizeConfig) -> int:
    """Forward FLOPs per token of the non-embedding Transformer core."""
    return 2 * core_params(size)


def added_flops(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None) -> int | None:
    """Forward FLOPs per token that routing adds to the core (None: unknown, an external router that does not
    state them)."""
    cfg = _pair(size, ablation)
    s, a = cfg.size, cfg.ablation
    d, h, L, M = s.d_model, s.d_mlp, s.n_layers, s.n_sublayers
    if a.routing == "residual":
        return 0
    if a.routing == "gated":  # two d x d projections, the dot, the mix; + b_i
        return M * (2 * 2 * d * d + 2 * d + 3 * d + (1 if a.gate_bias != "none" else 0))
    if a.routing == "external":
        from lrattn_lightning.model.routing.external import facts

        return facts(cfg)[1]
    r = cfg.key_dim
    read = sum(sources_per_site(cfg)) * (2 * r + 2 * d)
    proj = key_source(cfg).flops()
    if a.query == "gated_dynamic":
        proj += 2 * L * r * (d + h) + M * 2 * r  # the query rows; q_j + g_j * q_dyn at every site
    return read + proj


def added_flops_percent(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None) -> float | None:
    cfg = _pair(size, ablation)
    flops = added_flops(cfg)
    return None if flops is None else 100.0 * flops / core_flops(cfg.size)


def model_flops_per_token(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None, *, training: bool = True) -> int:
    """Matmul FLOPs per token incl. the LM head and causal attention scores (for MFU); x3 for training.
    Routing FLOPs that are unknown (added_flops None) count as 0."""
    cfg = _pair(size, ablation)
    s = cfg.size
    attention_scores = 2 * 2 * s.n_layers * s.seq_len * s.d_model // 2  # QK^T and AV, causal half
    forward = core_flops(s) + (added_flops(cfg) or 0) + 2 * s.d_model * s.vocab_size + attention_scores
    return 3 * forward if training else forward
