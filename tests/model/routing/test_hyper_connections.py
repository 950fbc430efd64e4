"""Hyper-Connections and mHC (routing: hyper_connections): identities at the start, the formula in float64,
the Sinkhorn constraint, accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEEPER,
    assert_causal_and_decodes_with_the_kv_cache,
    assert_router_gradcheck,
    capture,
    ref_rms_norm,
    tokens,
)

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig, SizeConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import parse_registry
from lrattn_lightning.model.routing.hyper_connections import sinkhorn
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER
BASELINE = parse_registry({"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}).ablation("b")


def config(size=SIZE, **options) -> ModelConfig:
    raw = {"sizes": {}, "ablations": {"hc": {"doc": "d", "control": None, "routing": "hyper_connections", **options}}}
    return ModelConfig(size, parse_registry(raw).ablation("hc"))


def with_baseline_core(cfg):
    torch.manual_seed(0)
    model, base = build_decoder(cfg), build_decoder(ModelConfig(SIZE, BASELINE))
    model.load_state_dict({**base.state_dict(), **{f"router.{k}": v for k, v in model.router.state_dict().items()}})
    return model.eval(), base.eval()


@pytest.mark.parametrize("dynamic", [False, True])
def test_one_stream_is_the_plain_residual_stream_exactly(dynamic):
    model, base = with_baseline_core(config(streams=1, dynamic=dynamic))
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    with torch.no_grad():
        assert torch.equal(model(idx), base(idx))


def test_n_streams_start_as_copies_of_the_baseline_stream():
    model, base = with_baseline_core(config(streams=4))
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    ours, theirs = capture(model, idx), capture(base, idx)
    for x, y in zip(ours.inputs, theirs.inputs, strict=True):  # every sublayer reads the baseline's stream exactly
        assert torch.equal(x, y)
    # the head reads RMSNorm(4 h): the baseline's up to RMSNorm's eps (finfo.eps against mean(h^2) ~ 4e-4)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-3, atol=2e-4)
    with torch.no_grad():
        model.router.static_alpha[3, 1, 2] = 0.5  # mix two streams: no longer copies
        assert (model(idx) - base(idx)).abs().max() > 1e-4


def test_mhc_does_not_start_as_the_baseline_as_published():
    model, base = with_baseline_core(config(streams=4, manifold=True))
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    with torch.no_grad():
        assert (model(idx) - base(idx)).abs().max() > 1e-3


def test_sinkhorn_gives_doubly_stochastic_matrices():
    m = sinkhorn(torch.randn(5, 4, 4, dtype=torch.float64) * 2, 50)
    torch.testing.assert_close(m.sum(-1), torch.ones(5, 4, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(m.sum(-2), torch.ones(5, 4, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert (m > 0).all()


def _sinkhorn_loop(log_alpha, iters):
    """Sinkhorn-Knopp written out: exp, then alternately divide by column sums and row sums."""
    a = (log_alpha - log_alpha.max(dim=-2, keepdim=True).values).exp()
    for _ in range(iters):
        a = a / a.sum(dim=-2, keepdim=True)
        a = a / a.sum(dim=-1, keepdim=True)
    return a


def reads_float64(model, trace, manifold):
    """Every sublayer's read and the head's input by the formulas of the module docstring, from the trace."""
    r, n, d = model.router, model.router.n, SIZE.d_model
    H = trace.emb.double().unsqueeze(-2).repeat(1, 1, n, 1)
    reads = []
    for i in range(2 * SIZE.n_layers):
        A, beta = r.static_alpha[i].detach().double(), r.static_beta[i].detach().double()
        normed = F.rms_norm(H, (d,)) * r.norm_gain[i].detach().double()
        wa = normed @ r.dynamic_alpha[i].detach().double()
        wb = normed @ r.dynamic_beta[i].detach().double()
        s = r.scales[i].detach().double()
        if manifold:
            A = torch.cat(((A[..., :1] + wa[..., :1] * s[0]).sigmoid(),
                           _sinkhorn_loop(A[..., 1:] + wa[..., 1:] * s[1], r.iters)), dim=-1)
            beta = beta + 2 * wb.sigmoid() * s[2]
        else:
            A, beta = A + wa.tanh() * s[0], beta + wb.tanh() * s[1]
        x = (A[..., :, 0:1] * H).sum(-2)
        reads.append(x)
        H_new = torch.einsum("btsu,btsd->btud", A[..., 1:], H)
        H = H_new + beta.unsqueeze(-1) * trace.outputs[i][..., :d].double().unsqueeze(-2)
    return reads, H.sum(-2)


@pytest.mark.parametrize("manifold", [False, True])
def test_every_read_is_the_formula_with_random_coefficients(manifold):
    torch.manual_seed(1)
    model = build_decoder(config(streams=3, manifold=manifold)).double().eval()
    with torch.no_grad():
        for name, p in model.router.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name != "scales" else 0.3))
    trace = capture(model, tokens(SIZE.vocab_size, batch=2, length=9))
    reads, final = reads_float64(model, trace, manifold)
    for j, x in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [{"streams": 4}, {"streams": 2, "dynamic": False}, {"streams": 3, "manifold": True}])
def test_parameters_and_flops_are_counted(options):
    cfg = config(**options)
    model = build_decoder(cfg)
    n, d, M = cfg.ablation.options.streams, SIZE.d_model, 2 * SIZE.n_layers
    dyn = cfg.ablation.options.dynamic
    per = n * (n + 1) + n + ((d * (n + 1) + 2 * d + (3 if cfg.ablation.options.manifold else 2)) if dyn else 0)
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == M * per
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert added_flops(cfg) == M * (2 * d * n * (n + 1) + 2 * n * d + ((2 * n * d * (n + 2) + 4 * n * d) if dyn else 0)) + n * d


@pytest.mark.parametrize("manifold", [False, True])
def test_causal_and_decodes_with_the_kv_cache(manifold):
    torch.manual_seed(2)
    model = build_decoder(config(streams=3, manifold=manifold)).eval()
    with torch.no_grad():
        for p in model.router.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    assert_causal_and_decodes_with_the_kv_cache(model)


@pytest.mark.parametrize("manifold", [False, True])
def test_float64_gradients_of_the_router(manifold):
    torch.manual_seed(3)
    # d = 8, 2 layers: every router parameter checked (about 200 numbers; a gradcheck costs two passes per number)
    small = SizeConfig(name="grad", doc="tests: gradcheck", n_layers=2, d_model=8, n_heads=2, d_mlp=16,
                       vocab_size=31, seq_len=8)
    model = build_decoder(config(small, streams=2, manifold=manifold, sinkhorn_iters=5)).double().eval()
    with torch.no_grad():
        for p in model.router.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    idx = tokens(small.vocab_size, batch=1, length=4)
    assert_router_gradcheck(model, idx)


def test_adamw_takes_every_router_parameter():
    model = build_decoder(config())
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)


@pytest.mark.parametrize("fields, says", [({"streams": 0}, "field 'streams': must be a positive integer"),
                                          ({"manifold": "yes"}, "field 'manifold': must be true or false"),
                                          ({"stream": 2}, "field 'stream': unknown field; closest: streams")])
def test_bad_options_are_one_line(fields, says):
    with pytest.raises(InputError, match=says):
        config(**fields)
