"""The plain residual stream (routing: residual): its router against the sum written out in float64, its counts."""

from __future__ import annotations

import torch

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.model.routing.residual import KIND as RESIDUAL


def test_residual_reads_the_plain_stream():
    """The residual kind's router, written out in float64: read j = o_0 + ... + o_j, nothing counted."""
    registry = load_registry()
    cfg = ModelConfig(registry.size("tiny"), registry.ablation("baseline"))
    router = RESIDUAL.build(cfg, "reference")
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 3, cfg.size.d_model, generator=gen, dtype=torch.float64) for _ in range(4)]
    state = router.start(outs[0])
    for i, o in enumerate(outs[1:], 1):
        router.write(state, i, o)
        torch.testing.assert_close(router.read(state, i), sum(outs[: i + 1]), rtol=0, atol=1e-12)
    assert RESIDUAL.routing_params(cfg) == sum(p.numel() for p in router.parameters()) == 0
    assert RESIDUAL.added_flops(cfg) == 0 and RESIDUAL.code_paths(cfg.options) == []
