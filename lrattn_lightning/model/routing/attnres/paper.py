"""AttnRes in the paper's code's language (jon123boss/LR-AttnRes, class OBPM): the flags that select an entry
there and its router weights under our names (tools/fidelity/ compares every entry with that code's logits).
"""

from __future__ import annotations

import math
from typing import Any

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.kind import NotExpressible

# Our key source / embedding key -> the reference flag that selects it (set to True).
KEY_SOURCE_FLAGS = {"sliced": "lrid_key_from_output_tail", "value_projected": "lrid_key_from_value",
                    "value_projected_shared": "lrid_key_from_value_shared"}
EMBEDDING_KEY_FLAGS = {"static": "lrid_static_embedding_key", "projected_plus_static": "lrid_add_static_embedding_key"}


def reference_flags(cfg: ModelConfig) -> dict[str, Any]:
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

def reference_weights(ref: dict[str, Any], cfg: ModelConfig, stack) -> tuple[str, dict[str, Any]]:
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
