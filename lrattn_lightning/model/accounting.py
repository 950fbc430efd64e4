"""Analytic parameter counts and the paper's cost axis: added forward FLOPs per token (SPEC §4).

    core  = 2 L (4 d^2 + 3 d h)          2 x non-embedding matmul parameters
    added = the routing kind's           AttnRes: the reads and key rows (routing/attnres/kind.py); the gated
                                         residual: its gate matmuls (routing/gated.py); an external router:
                                         what it states, or None (unknown: routing/external.py)
    added % = 100 added / core

Parameters likewise: the kind's `routing_params` (an external router: its module's real count).
"""

from __future__ import annotations

from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig


def _pair(size: SizeConfig | ModelConfig, ablation: AblationConfig | None) -> ModelConfig:
    return size if isinstance(size, ModelConfig) else ModelConfig(size, ablation)


def core_params(size: SizeConfig) -> int:
    """Non-embedding matmul parameters: attention 4 d^2 and SwiGLU 3 d h per layer."""
    d, h = size.d_model, size.d_mlp
    return size.n_layers * (4 * d * d + 3 * d * h)


def routing_params(size: SizeConfig | ModelConfig, ablation: AblationConfig | None = None) -> int:
    """Parameters that depth routing adds to the baseline (the routing kind's count)."""
    cfg = _pair(size, ablation)
    return cfg.kind.routing_params(cfg)


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
    """Forward FLOPs per token that routing adds to the core (the routing kind's; None: unknown, an external
    router that does not state them)."""
    cfg = _pair(size, ablation)
    return cfg.kind.added_flops(cfg)


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
