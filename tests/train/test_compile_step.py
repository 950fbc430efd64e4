"""`--model.compile true`: the decoder and the training loss compiled as one region give the eager step's
loss and gradients (same backend parameters; aot_eager: AOTAutograd's graphs without Inductor codegen)."""

from __future__ import annotations

import copy

import torch
from conftest import randomize_routing, tokens

from lrattn_lightning.train.lit_module import LRAttnModule


def _loss_and_grads(module: LRAttnModule, batch: torch.Tensor, losses) -> tuple[float, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    ce, z = losses(batch[:, :-1], batch[:, 1:])
    (ce + 1e-2 * z).backward()
    return float(ce), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_compiled_loss_region_matches_the_eager_step():
    torch.manual_seed(0)
    eager = LRAttnModule(size="tiny", ablation="p-lr-block-n4-r32", impl="compiled")
    randomize_routing(eager.model)
    compiled = copy.deepcopy(eager)
    compiled.compile_step(backend="aot_eager")
    compiled.compile_step(backend="aot_eager")  # idempotent
    batch = tokens(eager.cfg.size.vocab_size, batch=2, length=17)
    ce_e, grads_e = _loss_and_grads(eager, batch, eager.model_losses)
    ce_c, grads_c = _loss_and_grads(compiled, batch, compiled._compiled_losses)
    assert abs(ce_c - ce_e) < 1e-5 and set(grads_c) == set(grads_e) and len(grads_e) > 10
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-5 * max(1.0, g.abs().max().item()), msg=name)
