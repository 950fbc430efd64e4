"""Analytic parameter counts and the paper's cost axis: added forward FLOPs per token (docs/method.md §4).

    core  = 2 L (4 d^2 + 3 d h)          2 x non-embedding matmul parameters
    added = the routing kind's           AttnRes: the reads and key rows (routing/attnres/kind.py); the gated
                                         residual: its gate matmuls (routing/gated.py); an external router:
                                         what it states, or None (unknown: routing/external.py)
    added % = 100 added / core

Parameters likewise: the kind's `routing_params` (an external router: its module's real count).

A model read from a file (a registry size, a checkpoint's hparams, an exported folder's config.json) is held to
a budget before anything is built (`check_budget`): at most MAX_PARAMS parameters by the analytic count and at
most MAX_LAYERS layers.
"""

from __future__ import annotations

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig

# 10^11 parameters are 400 GB of fp32 weights (AdamW's states triple that): more than one 8-GPU node holds; the
# registry's largest size, d4096-7b, has 7.3e9. Layers cost apart from their width: each is ~16 KiB of Python
# modules built in ~1.3 ms, so 10^8 two-wide layers (2e9 parameters, within MAX_PARAMS) would take days;
# 4096 layers (8192 sublayers) build in ~5 s and are 30x the deepest published LLMs.
MAX_PARAMS = 100 * 10**9
MAX_LAYERS = 4096


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


def check_budget(cfg: SizeConfig | ModelConfig, where: str) -> None:
    """Refuse, before anything is allocated, a size (or model) past MAX_PARAMS parameters or MAX_LAYERS layers:
    embeddings, head and core by the analytic count, then a ModelConfig's routing (not an external router's:
    only its module, the user's code, knows it). One line naming `where`, the fields and the fix."""
    s = cfg.size if isinstance(cfg, ModelConfig) else cfg
    count = 2 * s.vocab_size * s.d_model + core_params(s)
    if count > MAX_PARAMS:
        raise _over_budget(where, s, count, 0)
    if s.n_layers > MAX_LAYERS:
        raise InputError(f"{where}: n_layers {s.n_layers:,} exceeds the budget of {MAX_LAYERS:,} layers "
                         "(lrattn_lightning/model/accounting.py); use fewer layers")
    routing = routing_params(cfg) if isinstance(cfg, ModelConfig) and not cfg.kind.code_paths(cfg.options) else 0
    if count + routing > MAX_PARAMS:
        raise _over_budget(where, s, count + routing, routing)


def _over_budget(where: str, s: SizeConfig, count: int, routing: int) -> InputError:
    dims = (f"n_layers {_rough(s.n_layers)}, d_model {_rough(s.d_model)}, d_mlp {_rough(s.d_mlp)}, vocab_size "
            f"{_rough(s.vocab_size)}" + (f", routing {_rough(routing)}" if routing else ""))
    return InputError(f"{where}: {_rough(count)} parameters ({dims}; {_rough(4 * count // 10**9)} GB of fp32 weights) "
                      f"exceed the budget of {MAX_PARAMS:.0e} (lrattn_lightning/model/accounting.py); use a smaller "
                      "d_model, d_mlp, n_layers or vocab_size")


def _rough(n: int) -> str:
    """An integer of any size for a message: 12,345, 1.23e+18, or ~1e4000 past what a float holds."""
    if n < 10**12:
        return f"{n:,}"
    return f"{n:.3g}" if n < 10**300 else f"~1e{int(n.bit_length() * 0.30103)}"
