"""Fidelity to the paper's code: registry entries in the reference's flag language, its weight names,
and the table of docs/fidelity.md (`lrattn fidelity`).

The paper's reference implementation (github jon123boss/LR-AttnRes, `model.py`, class `OBPM`) is
configured by ~40 flags. `reference_flags` states, for one (size, ablation) pair, the flags under
which the reference computes the same function (with `norm_pos="before"`, flash attention off);
`from_reference_state_dict` renames the reference's weights to ours. Both are facts about the
reference's interface, used to produce and to check the golden numbers under tests/golden/; no code
of the reference is here.
"""

from __future__ import annotations

import math
from typing import Any

from lrattn_lightning.errors import InputError, Parser
from lrattn_lightning.model.config import ALL_IMPLS, ModelConfig
from lrattn_lightning.model.routing.kinds import NotExpressible

__all__ = ["NotExpressible", "fidelity_rows", "flag_language", "from_reference_state_dict", "reference_flags"]

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


def fidelity_rows(golden_path: str, registry_path: str | None = None, impl: str = "fast",
                  only: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per registry entry: params (ours, the reference's), max |Δlogit| and the gradients'
    relative error against the golden data, and the reference flags."""
    from lrattn_lightning.model.accounting import count_params
    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.tools import golden

    reg = load_registry(registry_path)
    data = golden.load(golden_path)
    rows = []
    for name in only or list(reg.ablations):
        cfg = golden.config(reg, name)
        row: dict[str, Any] = {"entry": name, "params": count_params(cfg), "flags": flag_language(cfg),
                               "clipped": cfg.ablation.name != name}
        entry = data["entries"].get(name)
        if entry is None:
            row.update(reference_params=None, dlogit=None, dgrad=None)
        else:
            result = golden.compare(cfg, entry, data, impl=impl)
            row.update(reference_params=entry["reference_params"], **result)
        rows.append(row)
    return rows


def render_markdown(rows: list[dict[str, Any]], golden_path: str, size_line: str) -> str:
    lines = [
        "# Fidelity to the paper's code",
        "",
        "Every registry entry, built at the golden size and loaded with the same weights as the paper's",
        "reference implementation (`jon123boss/LR-AttnRes`, `model.py`, class `OBPM`, `norm_pos=\"before\"`,",
        "flash attention off), with **non-zero** pseudo-queries, gates and static keys, in float32.",
        f"Golden size: {size_line}. Golden data: `{golden_path}` (how it is made: tests/golden/README.md).",
        "",
        "- *params*: our analytic count at the golden size; *reference*: the reference model's own count.",
        "  † marks entries whose rank exceeds the golden size's d = 128 and is clipped to it there.",
        "- *max |Δlogit|*: ours (fast router) against the reference's logits (logit RMS ≈ 0.2).",
        "- *grad rel. err.*: max |Δ| / max |g| over the stored gradients (router parameters in full,",
        "  large matrices through fixed random projections).",
        "- Both errors are float32 rounding (eps ≈ 1.2e-7, summed over many terms): shown as an upper bound",
        "  on the 1-2-5 grid (`≤ 5e-6`: the measured value lies in (2e-6, 5e-6]), `0` when exact, so a rerun",
        "  gives the same file; another CPU's kernels round differently and may move a value by one step.",
        "- *reference flags*: what the entry is in the reference's flag language (departures from its",
        "  class defaults), so a run of the reference can be translated to a registry entry.",
        "",
        "Regenerate: `lrattn fidelity --golden tests/golden/reference.pt --out docs/fidelity.md`.",
        "",
        "| entry | params | reference | max \\|Δlogit\\| | grad rel. err. | reference flags |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ref = "—" if r["reference_params"] is None else f"{r['reference_params']:,}"
        dl, dg = ("—" if r[key] is None else upper_bound(r[key]) for key in ("dlogit", "dgrad"))
        mark = " †" if r.get("clipped") else ""
        lines.append(f"| `{r['entry']}`{mark} | {r['params']:,} | {ref} | {dl} | {dg} | {r['flags']} |")
    return "\n".join(lines) + "\n"


def upper_bound(value: float) -> str:
    """`value` >= 0 as the smallest 1, 2 or 5 x 10^k at or above it: 7.3e-6 and 7.4e-6 -> '≤ 1e-5'.

    An error's digits beyond its order are rounding noise (they change with the CPU's kernels); its bound
    is what the table claims. 0 (bit-identical) stays '0'.
    """
    if value == 0:
        return "0"
    exp = math.floor(math.log10(value))
    mantissa = value / 10.0**exp  # in [1, 10)
    step = next(m for m in (1, 2, 5, 10) if mantissa <= m * (1 + 1e-12))
    if step == 10:
        step, exp = 1, exp + 1
    return f"≤ {step}e{exp}"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="lrattn fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--golden", required=True, help="golden data file (tests/golden/reference.pt)")
    parser.add_argument("--registry", default=None)
    parser.add_argument("--impl", default="fast", choices=ALL_IMPLS,
                        help="AttnRes backend (triton: CUDA or TRITON_INTERPRET=1; the golden numbers are CPU tensors)")
    parser.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    parser.add_argument("--entries", default=None, help="comma-separated registry entries (default: all)")
    args = parser.parse_args(argv)
    from lrattn_lightning.tools import golden

    if args.impl == "triton":
        from lrattn_lightning.model.routing.triton_ops import availability_error

        if (error := availability_error("cpu")) is not None:
            raise InputError(f"--impl triton: {error}")

    only = args.entries.split(",") if args.entries else None
    rows = fidelity_rows(args.golden, args.registry, impl=args.impl, only=only)
    size = golden.load(args.golden)["size"]
    size_line = ", ".join(f"{k}={v}" for k, v in size.items() if k not in ("name", "doc"))
    text = render_markdown(rows, args.golden, size_line)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out} ({len(rows)} entries)")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
