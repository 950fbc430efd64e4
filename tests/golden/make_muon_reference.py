"""Write tests/golden/muon_reference.pt from the paper's reference code (jon123boss/LR-AttnRes).

    TORCHDYNAMO_DISABLE=1 python tests/golden/make_muon_reference.py /path/to/LR-AttnRes/src tests/golden/muon_reference.pt

This script holds no reference code: it imports the reference checkout given as the first argument
(its `muon/muon.py` optimiser and Polar Express, its `schedulers.py` LR schedule, and the momentum
schedule function of its `train.py`, which is compiled alone because `train.py` runs training on import)
and records what they compute on fixed random matrices. See tests/golden/README.md.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the reference torch.compile()s Polar Express; run it eagerly

import torch  # noqa: E402

# The scenario: a short run that crosses LR warmup, stable and decay, and momentum warmup and cooldown.
SHAPES = {"wide": (8, 16), "tall": (16, 8), "square": (32, 32), "tall3": (64, 24)}
CONFIG = {
    "lr": 0.05, "weight_decay": 0.5, "beta2": 0.95, "total_steps": 8,
    "warmup_steps": 2, "warmdown_steps": 3,  # LR: warmup over steps 0-1, decay from step 5
    "momentum_min": 0.85, "momentum_max": 0.95, "momentum_warmup_steps": 3, "momentum_cooldown_steps": 2,
}
ORTHO_SHAPES = [(8, 16), (16, 8), (32, 32), (64, 24)]


def reference_momentum_fn(train_py: Path):
    """The reference's `get_muon_momentum(step)`, compiled from its train.py with our CONFIG as globals."""
    tree = ast.parse(train_py.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_muon_momentum")
    scope = {
        "max_steps": CONFIG["total_steps"],
        "muon_momentum_warmup_steps": CONFIG["momentum_warmup_steps"],
        "muon_momentum_cooldown_steps": CONFIG["momentum_cooldown_steps"],
        "muon_momentum_min": CONFIG["momentum_min"],
        "muon_momentum_max": CONFIG["momentum_max"],
    }
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(train_py), "exec"), scope)
    return scope["get_muon_momentum"]


def polar_express_float64(coeffs):
    """The Polar Express iteration with every step in float64 (no bfloat16 between iterations), from the
    paper's formula: X <- G / (1.02 ||G||_F + 1e-6) on the wide orientation, then X <- a X + (b A + c A^2) X
    with A = X X^T for each (a, b, c). Rounding differences between CPUs stay ~1e-16 here, while the
    bfloat16 casts of the real iteration turn them into flipped bfloat16 roundings."""

    def run(g: torch.Tensor) -> torch.Tensor:
        tall = g.size(-2) > g.size(-1)
        x = g.double().mT if tall else g.double()
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
        for a, b, c in coeffs:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
        return x.mT if tall else x

    return run


def run_scenario(Muon, WarmupStableDecay, momentum_at, init, grads):
    """The reference's loop order: set momentum, step, then step the LR schedule; weights after each step."""
    steps = CONFIG["total_steps"]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = Muon(list(params.values()), lr=CONFIG["lr"], weight_decay=CONFIG["weight_decay"],
               momentum=CONFIG["momentum_max"], beta2=CONFIG["beta2"], nesterov=True, use_triton=False, cautious=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupStableDecay(
        warmup_steps=CONFIG["warmup_steps"], max_steps=steps, warmdown_steps=CONFIG["warmdown_steps"], mode="linear"))
    lrs, momenta, after = [], [], {k: [] for k in init}
    for step in range(steps):
        opt.param_groups[0]["momentum"] = momentum_at(step)
        lrs.append(opt.param_groups[0]["lr"])
        momenta.append(opt.param_groups[0]["momentum"])
        for k, p in params.items():
            p.grad = grads[k][step].clone()
        opt.step()
        sched.step()
        for k, p in params.items():
            after[k].append(p.detach().clone())
    return lrs, momenta, {k: torch.stack(v) for k, v in after.items()}  # [steps, *shape]


def main(ref_src: str, out: str) -> None:
    ref = Path(ref_src).resolve()
    sys.path.insert(0, str(ref))
    import muon.muon as reference_muon
    from muon.muon import Muon, polar_express, polar_express_coeffs
    from schedulers import WarmupStableDecay

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    init = {k: torch.randn(s, generator=gen) * 0.5 for k, s in SHAPES.items()}
    steps = CONFIG["total_steps"]
    grads = {k: torch.randn(steps, *s, generator=gen) for k, s in SHAPES.items()}
    momentum_at = reference_momentum_fn(ref / "train.py")
    lrs, momenta, after = run_scenario(Muon, WarmupStableDecay, momentum_at, init, grads)
    # The same scenario with the reference's Polar Express swapped for the float64 iteration: every other
    # ingredient of its update (momentum, nesterov, second moment, scale, cautious decay) unchanged.
    bf16_polar_express = reference_muon.polar_express
    reference_muon.polar_express = lambda g, use_triton=False: polar_express_float64(polar_express_coeffs)(g)
    _, _, after_float64 = run_scenario(Muon, WarmupStableDecay, momentum_at, init, grads)
    reference_muon.polar_express = bf16_polar_express

    ortho_in = [torch.randn(s, generator=gen) for s in ORTHO_SHAPES]
    golden = {
        "config": CONFIG,
        "lr": lrs,
        "momentum": momenta,
        "init": init,
        "grads": grads,
        "params": after,
        "params_float64_polar_express": after_float64,
        "polar_express_coefficients": [list(map(float, c)) for c in polar_express_coeffs],
        "polar_express_in": ortho_in,
        "polar_express_out": [polar_express(g, use_triton=False).float() for g in ortho_in],
        "torch_version": str(torch.__version__),
    }
    torch.save(golden, out)
    print(f"wrote {out}: lr {lrs}, momentum {momenta}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
