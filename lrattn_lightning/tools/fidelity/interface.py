"""The paper's reference implementation's interface (github jon123boss/LR-AttnRes, `model.py`, class `OBPM`, with
`norm_pos="before"` and flash attention off): `reference_flags` states, for one (size, ablation) pair, the ~40 flags
under which it computes the same function; `from_reference_state_dict` renames its weights to ours. Facts about its
interface, used to produce and to check the golden numbers under tests/golden/ (golden.py) and the table of
docs/fidelity.md (fidelity.py); no code of the reference is here.
"""

from __future__ import annotations

from typing import Any

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.kind import NotExpressible

# The reference's ModelConfig defaults for the flags we set (so the table can list only departures).
REFERENCE_DEFAULTS: dict[str, Any] = {
    "use_attnres": False, "attnres_type": "block", "attnres_num_blocks": 8, "attnres_block_average": True,
    "attnres_block_average_mode": "count", "attnres_block_count_prior": True, "attnres_block_beta": "legacy",
    "attnres_key_norm": True, "attn_res_query_norm": False, "attn_res_query_init": "zero", "use_lrid": False,
    "lrid_rank": 64, "lrid_num_heads": 1, "lrid_use_logit_scale": True, "lrid_logit_scale": None,
    "lrid_key_from_output_tail": False, "lrid_key_from_value": False, "lrid_key_from_value_shared": False,
    "lrid_static_embedding_key": False, "lrid_add_static_embedding_key": False,
    "lrid_input_dependent_query": False,
}


def reference_flags(cfg: ModelConfig) -> dict[str, Any]:
    """The reference ModelConfig kwargs that compute the same model as `cfg` (architecture flags only): the
    core's, then the routing kind's (NotExpressible where the reference has none)."""
    s = cfg.size
    flags: dict[str, Any] = {
        "block_size": s.seq_len, "vocab_size": s.vocab_size, "n_layer": s.n_layers, "n_head": s.n_heads,
        "n_embd": s.d_model, "mlp_hidden_dim": s.d_mlp, "rope_theta": s.rope_theta, "init_std": s.init_std,
        "norm_pos": "before", "qk_norm": True, "weight_tying": False, "flash_attention": False,
    }
    flags.update(cfg.kind.reference_flags(cfg))
    return flags


def flag_language(cfg: ModelConfig) -> str:
    """The flags where `cfg` departs from the reference's class defaults, as `name=value` words."""
    try:
        flags = reference_flags(cfg)
    except NotExpressible as err:
        return f"(none: {err})"
    words = [f"{k}={v}" for k, v in flags.items() if k in REFERENCE_DEFAULTS and REFERENCE_DEFAULTS[k] != v]
    return " ".join(words) or "(defaults, use_attnres=False)"


def from_reference_state_dict(ref: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The reference's parameters under our names (torch tensors or numpy arrays alike)."""
    L = cfg.size.n_layers
    proj, routing = cfg.kind.reference_weights(ref, cfg, _stack)  # LR keys wrap the output projections
    out: dict[str, Any] = {"embed.weight": ref["transformer.wte.weight"], "head.weight": ref["lm_head.weight"]}
    for layer in range(L):
        src, dst = f"transformer.layers.{layer}.", f"layers.{layer}."
        out[dst + "attn.qkv.weight"] = ref[src + "attn.c_attn.weight"]
        out[dst + "attn.proj.weight"] = ref[src + "attn.c_proj" + proj]
        out[dst + "mlp.fc1.weight"] = ref[src + "mlp.fc1.weight"]
        out[dst + "mlp.fc2.weight"] = ref[src + "mlp.fc2" + proj]
    return {**out, **routing}


def _stack(rows: list[Any]) -> Any:
    first = rows[0]
    if hasattr(first, "new_empty"):  # torch
        import torch

        return torch.stack(rows)
    import numpy as np

    return np.stack(rows)


# ---- the table of docs/fidelity.md ------------------------------------------------------------------
