"""The paper's reference implementation's interface (github jon123boss/LR-AttnRes, `model.py`, class `OBPM`, with
`norm_pos="before"` and flash attention off): `reference_flags` states, for one (size, ablation) pair, the ~40 flags
under which it computes the same function; `from_reference_state_dict` renames its weights to ours. Facts about its
interface, used to produce and to check the golden numbers under tests/golden/ (golden.py) and the table of
docs/fidelity.md (fidelity.py); no code of the reference is here.

By routing kind: ROUTING[kind] = (its flags, its router weights under our names) for the kinds the reference has
(its plain residual stream, AttnRes with P-LR / S-LR); ABSENT[kind] how the table names one it does not; any other
kind is NotExpressible as "routing NAME is not part of the reference" (the deliberate default, written once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.config import ModelConfig


class NotExpressible(InputError):
    """The entry has no equivalent in the reference's flags (said why)."""


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
    flags.update(_routing(cfg)[0](cfg))
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
    proj, routing = _routing(cfg)[1](ref, cfg, _stack)  # LR keys wrap the output projections
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


# Our key source / embedding key -> the reference flag that selects it (set to True).
KEY_SOURCE_FLAGS = {"sliced": "lrid_key_from_output_tail", "value_projected": "lrid_key_from_value",
                    "value_projected_shared": "lrid_key_from_value_shared"}
EMBEDDING_KEY_FLAGS = {"static": "lrid_static_embedding_key", "projected_plus_static": "lrid_add_static_embedding_key"}


def attnres_flags(cfg: ModelConfig) -> dict[str, Any]:
    """AttnRes's flags (it has neither rms summaries nor MHAR's norm or gain)."""
    a = cfg.options
    if a.block_summary == "rms":
        raise NotExpressible("block_summary 'rms' (RMS Block AttnRes) is not in the reference")
    if a.key_gain or (a.depth_head_norm == "full" and a.depth_heads > 1):
        raise NotExpressible("MHAR's key norm over the whole key and its key gain are not in the reference")
    flags: dict[str, Any] = {"use_attnres": True, "attnres_key_norm": a.key_norm == "rms",
                             "attn_res_query_norm": a.query_norm, "attn_res_query_init": a.query_init}
    flags.update(_block_flags(cfg))
    if a.key_source == "value":
        return flags
    flags.update(use_lrid=True, lrid_rank=a.rank, lrid_num_heads=a.depth_heads)
    if a.logit_scale == "none":
        flags["lrid_use_logit_scale"] = False
    elif a.logit_scale == "inv_sqrt_head_dim":
        flags["lrid_use_logit_scale"] = True
    else:
        flags.update(lrid_use_logit_scale=True, lrid_logit_scale=float(a.logit_scale))
    for flag in (KEY_SOURCE_FLAGS.get(a.key_source), EMBEDDING_KEY_FLAGS.get(a.embedding_key)):
        if flag is not None:
            flags[flag] = True
    if a.query == "gated_dynamic":
        flags["lrid_input_dependent_query"] = True
    return flags


def _block_flags(cfg: ModelConfig) -> dict[str, Any]:
    a, m = cfg.options, cfg.size.n_sublayers
    ends = cfg.block_ends()
    if not ends:
        return {"attnres_type": "full"}
    n = len(ends)
    if [math.ceil(m * b / n) for b in range(1, n + 1)] != ends:
        raise NotExpressible(f"block ends {ends} are not the reference's ceil(2L b / N) layout for any N")
    flags: dict[str, Any] = {"attnres_type": "block", "attnres_num_blocks": n}
    if a.block_summary == "sum":
        flags["attnres_block_average"] = False
    else:
        flags.update(attnres_block_average=True,
                     attnres_block_average_mode="count" if a.block_summary == "mean" else "sqrt")
    if a.count_prior in (0.0, 1.0):
        flags["attnres_block_count_prior"] = a.count_prior == 1.0
    else:
        flags.update(attnres_block_count_prior=True, attnres_block_beta=float(a.count_prior))
    return flags


def attnres_weights(ref: dict[str, Any], cfg: ModelConfig, stack) -> tuple[str, dict[str, Any]]:
    """The reference's router weights under our names; LR keys wrap its output projections (`.proj`)."""
    a, L = cfg.options, cfg.size.n_layers
    J, out = 2 * L, {}
    if a.key_source == "value":
        out["router.queries"] = stack([ref[f"transformer.attn_residuals.{j}.query"] for j in range(J)])
        return ".weight", out
    out["router.queries"] = stack([ref[f"transformer.lrid_queries.{j}"].reshape(-1) for j in range(J)])
    if a.query == "gated_dynamic":
        out["router.query_gates"] = stack([ref[f"transformer.lrid_query_gates.{j}"] for j in range(J)])
    emb_projected = a.embedding_key in ("projected", "projected_plus_static")
    if a.embedding_key in ("static", "projected_plus_static"):
        out["router.embedding_key_static"] = ref["transformer.lrid_static_embedding_key.key"]
    embedding_proj = "transformer.lrid_embedding_key.proj.weight"
    if a.key_source == "projected" and emb_projected:
        out["router.embedding_key_proj.weight"] = ref[embedding_proj]
    elif a.key_source == "value_projected_shared" or (a.key_source == "value_projected" and emb_projected):
        out["router.value_key_proj.0.weight"] = ref[embedding_proj]  # the shared projection, or the embedding's own
    if a.key_source == "value_projected":
        first = 0 if emb_projected else 1
        for layer in range(L):
            for i, part in ((2 * layer + 1, "attn.c_proj"), (2 * layer + 2, "mlp.fc2")):
                out[f"router.value_key_proj.{i - first}.weight"] = ref[
                    f"transformer.layers.{layer}.{part}.value_key_proj.weight"]
    return ".proj.weight", out


def _residual_weights(ref: dict[str, Any], cfg: ModelConfig, stack) -> tuple[str, dict[str, Any]]:
    return ".weight", {}  # no router weights


ROUTING: dict[str, tuple[Callable[[ModelConfig], dict[str, Any]], Callable[..., tuple[str, dict[str, Any]]]]] = {
    "residual": (lambda cfg: {}, _residual_weights),  # the reference's own residual stream (use_attnres=False)
    "attnres": (attnres_flags, attnres_weights),
}
ABSENT: dict[str, Callable[[ModelConfig], str]] = {
    "gated": lambda cfg: "the gated residual (docs/method.md §7)",
    "external": lambda cfg: f"an external router ({cfg.options.router})",
}


def _routing(cfg: ModelConfig):
    """(flags, weights) of cfg's kind in the reference; NotExpressible for a kind it does not have."""
    name = cfg.kind.name
    if name not in ROUTING:
        what = ABSENT[name](cfg) if name in ABSENT else f"routing {name}"
        raise NotExpressible(f"{what} is not part of the reference")
    return ROUTING[name]
