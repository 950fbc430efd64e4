"""Make tests/golden/reference.pt from a checkout of the paper's reference code.

    python tests/golden/make_reference_golden.py PATH/TO/LR-AttnRes [--out tests/golden/reference.pt]

Runs outside the package and never copies the reference: it imports `model.py` from the checkout
given on the command line, builds `OBPM` with the flags `lrattn_lightning.tools.fidelity.interface.reference_flags`
states for each registry entry at the golden size, loads the deterministic weights of
`lrattn_lightning.tools.fidelity.golden`, and stores the reference's logits, loss and gradients (under our
parameter names) for the fixed inputs. Entries the reference cannot express are skipped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.tools.fidelity import golden
from lrattn_lightning.tools.fidelity.interface import (
    NotExpressible,
    from_reference_state_dict,
    reference_flags,
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("reference_dir")
    parser.add_argument("--out", default="tests/golden/reference.pt")
    args = parser.parse_args()
    sys.path.insert(0, args.reference_dir)
    import model as ref  # the reference's model.py

    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.reference_dir, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    reg = load_registry()
    idx, targets = golden.inputs()
    entries = {}
    for name in reg.ablations:
        cfg = golden.config(reg, name)
        try:
            flags = reference_flags(cfg)
        except NotExpressible as err:
            print(f"skip {name}: {err}")
            continue
        model = ref.OBPM(ref.ModelConfig(**flags))
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        weights = golden.reference_weights(shapes)
        model.load_state_dict(weights, strict=False)  # buffers (RoPE tables) stay the reference's own
        logits = model(idx)
        loss = golden.loss_of(logits, targets)
        loss.backward()
        grads = from_reference_state_dict({n: p.grad for n, p in model.named_parameters()}, cfg)
        entries[name] = {
            "flags": {k: (v if not isinstance(v, float) else float(v)) for k, v in flags.items()},
            "reference_params": sum(p.numel() for p in model.parameters()),
            "reference_shapes": shapes,
            "weights_sum": sum(float(w.double().sum()) for w in weights.values()),
            "logits": logits.detach().float().clone(),
            "loss": float(loss.detach()),
            "grads": {n: golden.gradient_record(n, g) for n, g in grads.items() if golden.stores_gradient(n, cfg)},
        }
        if cfg.ablation.routing == "residual":  # float64 logits: everything but routing runs in float64 there
            entries[name]["logits64"] = model.double()(idx).detach().clone()
        print(f"{name}: loss {float(loss.detach()):.6f}, reference params {entries[name]['reference_params']:,}")
    size = golden.golden_size(reg)
    torch.save({"reference_commit": commit, "size": {k: getattr(size, k) for k in size.__dataclass_fields__},
                "seed": golden.SEED, "entries": entries}, args.out)
    print(f"wrote {args.out}: {len(entries)} entries from reference commit {commit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
