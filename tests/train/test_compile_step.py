"""`--model.compile true`: the decoder and the training loss compiled as one region give the eager step's
loss and gradients (same backend parameters; aot_eager: AOTAutograd's graphs without Inductor codegen)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import randomize_routing, tokens

from lrattn_lightning.train.lit_module import LRAttnModule


def _loss_and_grads(module: LRAttnModule, batch: torch.Tensor, losses) -> tuple[float, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    ce, z = losses(batch[:, :-1], batch[:, 1:])
    (ce + 1e-2 * z).backward()
    return float(ce), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_compiled_loss_region_matches_the_eager_step():
    torch.manual_seed(0)
    eager = LRAttnModule.from_names(size="tiny", ablation="p-lr-block-n4-r32", impl="compiled")
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


@pytest.mark.parametrize("loss_impl", ["logits", "chunked"])
@pytest.mark.parametrize("ablation", ["baseline", "s-lr-grid-n4-r16", "p-lr-block-n4-r32", "attnres-block-n4",
                                      "attnres-full"])
def test_the_compiled_loss_region_has_no_graph_break(ablation, loss_impl):
    """torch._dynamo.explain of what compile_step compiles (the decoder and the loss, the `compiled` AttnRes
    backend): one graph, no break, for the paper's entries and both losses (issue 54)."""
    torch._dynamo.reset()
    module = LRAttnModule.from_names(size="tiny", ablation=ablation, impl="compiled", loss_impl=loss_impl)
    randomize_routing(module.model)
    batch = tokens(module.cfg.size.vocab_size, batch=2, length=17)
    explained = torch._dynamo.explain(module.model_losses)(batch[:, :-1], batch[:, 1:])
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
