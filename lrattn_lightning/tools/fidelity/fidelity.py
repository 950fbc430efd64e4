"""`lrattn fidelity`: every registry entry against golden numbers the paper's code produced, as the table of
docs/fidelity.md (the reference's flags and weight names: interface.py; the golden data: golden.py)."""

from __future__ import annotations

import math
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import write_file
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.model.routing.attnres.backends import AUTO, IMPLS, availability
from lrattn_lightning.tools.fidelity.interface import flag_language


def fidelity_rows(golden_path: str, registry_path: str | None = None, impl: str = AUTO,
                  only: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per registry entry: params (ours, the reference's), max |Δlogit| and the gradients'
    relative error against the golden data, and the reference flags."""
    from lrattn_lightning.model.accounting import count_params
    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.tools.fidelity import golden

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
    parser.add_argument("--impl", default=AUTO, choices=(AUTO, *IMPLS),
                        help="AttnRes backend (triton: CUDA or TRITON_INTERPRET=1; the golden numbers are CPU tensors)")
    parser.add_argument("--out", default=None, help="write the markdown table here (default: print it)")
    parser.add_argument("--entries", default=None, help="comma-separated registry entries (default: all)")
    args = parser.parse_args(argv)
    from lrattn_lightning.tools.fidelity import golden

    if (error := availability(args.impl, "cpu")) is not None:  # the golden numbers are CPU tensors
        raise InputError(f"--impl {args.impl}: {error}")

    only = args.entries.split(",") if args.entries else None
    rows = fidelity_rows(args.golden, args.registry, impl=args.impl, only=only)
    size = golden.load(args.golden)["size"]
    size_line = ", ".join(f"{k}={v}" for k, v in size.items() if k not in ("name", "doc"))
    text = render_markdown(rows, args.golden, size_line)
    if args.out:
        write_file(args.out, text, "--out")
        print(f"wrote {args.out} ({len(rows)} entries)")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
