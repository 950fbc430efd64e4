"""Hyper-Connections, mHC and Frac-Connections (routing: hyper_connections): identities at the start, the formula
in float64, the Sinkhorn constraint, accounting.

Frac-Connections (`fractions: m`, below): the baseline exactly at init, the formula in float64 against a slot-by-slot
implementation, accounting, decoding, gradients, diagnostics, refusals."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.checks import (
    assert_bf16_autocast_close,
    assert_causal_and_decodes_with_the_kv_cache,
    assert_router_gradcheck,
    capture,
)
from helpers.models import DEEPER, GRAD, kind_config, randomized, tokens
from helpers.references import ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import load_registry, parse_registry
from lrattn_lightning.model.routing.hyper_connections import sinkhorn
from lrattn_lightning.train import routing_axes
from lrattn_lightning.train.diagnostics import weights_table
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER
BASELINE = parse_registry({"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}).ablation("b")


config = functools.partial(kind_config, "hyper_connections")


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


# ---- Frac-Connections (`fractions: m`: each stream split into m slots of width d/m) -------------------------------
FRAC = {"streams": 1, "fractions": 2, "hc_norm": "layer"}  # the registry's frac-connections-m2


def draw(name: str, p: torch.Tensor) -> torch.Tensor:
    """Every router parameter moved off its start: the scales by N(0, 0.3), the rest by N(0, 0.5)."""
    return p + torch.randn_like(p) * (0.3 if name == "scales" else 0.5)


def norm_float64(H, r, i):
    """N(H) over each slot's e channels, written out: LayerNorm (biased variance, eps 1e-5) or RMSNorm, then gain."""
    g = r.norm_gain[i].detach().double()
    if r.layer_norm:
        c = H - H.mean(-1, keepdim=True)
        return c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5) * g + r.norm_bias[i].detach().double()
    return ref_rms_norm(H) * g


def frac_reads_float64(model, trace):
    """Every sublayer's read, the head's input and each site's coefficients [Y | A_r | beta] from the trace, by the
    docs/method.md §10 formulas, one slot (stream s, fraction k; width e = d/m) at a time."""
    r, d = model.router, SIZE.d_model
    n, m = r.n, r.m
    e, N = d // m, n * m
    frac = [(s, k) for s in range(n) for k in range(m)]
    H = [trace.emb.double()[..., k * e:(k + 1) * e] for s, k in frac]  # slot a = (s, k): [B, T, e]
    reads, rows = [], []
    for i in range(2 * SIZE.n_layers):
        alpha, beta = r.static_alpha[i].detach().double(), r.static_beta[i].detach().double()
        if r.dynamic:
            s = r.scales[i].detach().double()
            normed = [norm_float64(h, r, i) for h in H]
            alpha = torch.stack([alpha[a] + s[0] * torch.tanh(x @ r.dynamic_alpha[i].detach().double())
                                 for a, x in enumerate(normed)], -2)  # row a: slot a's [Y | A_r]
            beta = torch.stack([beta[a] + s[1] * torch.tanh(x @ r.dynamic_beta[i].detach().double())
                                for a, x in enumerate(normed)], -1)
        else:
            alpha, beta = alpha.expand(*H[0].shape[:-1], N, m + N), beta.expand(*H[0].shape[:-1], N)
        x = torch.cat([sum(alpha[..., a, k:k + 1] * H[a] for a in range(N)) for k in range(m)], -1)
        reads.append(x)
        y = trace.outputs[i][..., :d].double()
        H = [sum(alpha[..., a, m + b:m + b + 1] * H[a] for a in range(N)) + beta[..., b:b + 1] * y[..., k * e:(k + 1) * e]
             for b, (_, k) in enumerate(frac)]
        rows.append(torch.cat((alpha[..., :m].flatten(-2), alpha[..., m:].flatten(-2), beta), -1))
    final = sum(torch.cat(H[s * m:(s + 1) * m], -1) for s in range(n))
    return reads, final, rows


def with_baseline_core_float64(cfg):
    torch.manual_seed(0)
    model, base = build_decoder(cfg), build_decoder(ModelConfig(SIZE, BASELINE))
    model.load_state_dict({**base.state_dict(), **{f"router.{k}": v for k, v in model.router.state_dict().items()}})
    return model.double().eval(), base.double().eval()


@pytest.mark.parametrize("options", [FRAC, {**FRAC, "dynamic": False}, {"streams": 1, "fractions": 4}])
def test_frac_connections_start_as_the_baseline_exactly(options):
    model, base = with_baseline_core_float64(config(**options))
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    with torch.no_grad():
        assert torch.equal(model(idx), base(idx))  # float64, atol 0
        model.router.static_alpha[2, 0, 1] = 0.25  # fraction 0 into the input's fraction 1: no longer the baseline
        assert (model(idx) - base(idx)).abs().max() > 1e-4


def test_streams_times_fractions_start_as_copies_of_the_baseline_stream():
    model, base = with_baseline_core_float64(config(streams=2, fractions=2))
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    ours, theirs = capture(model, idx), capture(base, idx)
    for x, y in zip(ours.inputs, theirs.inputs, strict=True):
        assert torch.equal(x, y)
    torch.testing.assert_close(ours.final, theirs.final, rtol=1e-12, atol=1e-12)  # RMSNorm(2 h) = RMSNorm(h) + eps


@pytest.mark.parametrize("options", [FRAC, {**FRAC, "dynamic": False}, {"streams": 1, "fractions": 4},
                                     {"streams": 2, "fractions": 2}])
def test_frac_every_read_is_the_formula_with_random_coefficients(options):
    model = randomized(config(**options), draw, seed=1)
    trace = capture(model, tokens(SIZE.vocab_size, batch=2, length=9))
    reads, final, rows = frac_reads_float64(model, trace)
    for j, x in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-10, atol=1e-10)
    for got, row in zip(trace.routing, rows, strict=True):  # the recorded coefficients, [C, B, T, 1]
        torch.testing.assert_close(got.squeeze(-1).movedim(0, -1).double(), row, rtol=1e-6, atol=1e-6)


def test_recorded_coefficients_are_the_mixing_table_with_its_labels():
    cfg = config(**FRAC)
    model = build_decoder(cfg).eval()
    trace = capture(model, tokens(SIZE.vocab_size, batch=2, length=6))
    assert routing_axes.recorded(cfg) == "mixing" and len(trace.routing) == 2 * SIZE.n_layers
    table = weights_table(cfg, trace.routing)
    assert table["site_labels"] == [str(j) for j in range(6)]
    assert table["source_labels"] == ["read 0→0", "read 0→1", "read 1→0", "read 1→1", "0→0", "0→1", "1→0", "1→1",
                                      "β 0", "β 1"]
    assert table["sites_by_sources"] == [[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]] * 6  # Y = A_r = I, beta = 1
    labels = routing_axes.axes(config(streams=2, fractions=2))["source_labels"]
    assert len(labels) == 4 * 2 + 16 + 4 and labels[:3] == ["read 0.0→0", "read 0.0→1", "read 0.1→0"]


@pytest.mark.parametrize("options", [FRAC, {**FRAC, "dynamic": False}, {"streams": 1, "fractions": 4},
                                     {"streams": 3, "fractions": 2}])
def test_frac_parameters_and_flops_are_counted(options):
    cfg = config(**options)
    model = build_decoder(cfg)
    a, d, M = cfg.ablation.options, SIZE.d_model, 2 * SIZE.n_layers
    n, m = a.streams, a.fractions
    e, N = d // m, n * m
    layer = a.norm == "layer"
    # static [Y | A_r] N x (m + N) and beta N; dynamic: norm gain (+ bias), W_alpha e x (m + N), w_beta e, 2 scales
    per = N * (m + N) + N + ((e * (2 if layer else 1) + e * (m + N) + e + 2) if a.dynamic else 0)
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == M * per
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    mix = 2 * (m + N) * N * e  # every read fraction and new slot: N multiply-adds of e channels
    depth = 2 * N * e  # beta y + H'
    dyn = 2 * N * e * (m + N + 1) + (7 if layer else 4) * N * e  # the tanh terms' matmuls and the norm
    assert added_flops(cfg) == M * (mix + depth + (dyn if a.dynamic else 0)) + n * d  # + the head's sum


@pytest.mark.parametrize("options", [FRAC, {"streams": 2, "fractions": 2}])
def test_frac_causal_and_decodes_with_the_kv_cache(options):
    assert_causal_and_decodes_with_the_kv_cache(randomized(config(**options), draw, seed=2).float())


def test_frac_float64_gradients_of_the_router():
    model = randomized(config(GRAD, **FRAC), draw, seed=3)
    idx = tokens(GRAD.vocab_size, batch=1, length=4)
    assert_router_gradcheck(model, idx)


def test_bf16_autocast_is_close_to_float32():
    model = randomized(config(**FRAC), draw, seed=4).float()
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    assert_bf16_autocast_close(model, idx)


def test_frac_adamw_takes_every_router_parameter():
    model = build_decoder(config(**FRAC))
    assert "norm_bias" in dict(model.router.named_parameters())
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)


def test_the_registry_entries_and_a_tiny_fit():
    registry = load_registry()
    dynamic, static = registry.ablation("frac-connections-m2"), registry.ablation("frac-connections-static-m2")
    assert (dynamic.routing, dynamic.control, static.control) == ("hyper_connections", "baseline", "frac-connections-m2")
    assert dynamic.options.as_dict() | {"dynamic": False} == static.options.as_dict()
    assert (dynamic.options.streams, dynamic.options.fractions, dynamic.options.norm) == (1, 2, "layer")
    wide = parse_registry({"sizes": {}, "ablations": {"w": {"doc": "d", "control": None, "routing": "hyper_connections",
                                                           "fractions": 6}}}).ablation("w")
    assert fit_to_size(wide, SIZE).options.fractions == 4  # the largest divisor of d = 32 below 6


@pytest.mark.parametrize("fields, says", [
    ({"fractions": 0}, "field 'fractions': must be a positive integer, got 0"),
    ({"hc_norm": "ln"}, "field 'hc_norm': 'ln' is not one of \\['rms', 'layer'\\]"),
    ({"fractions": 2, "manifold": True}, "field 'fractions': mHC .manifold: true. has no fractions"),
    ({"fractions": 3}, "field 'fractions': d_model=32 is not divisible by fractions=3; choose a divisor of 32"),
    ({"fraction": 2}, "field 'fraction': unknown field; closest: fractions")])
def test_frac_bad_options_are_one_line(fields, says):
    with pytest.raises(InputError, match=says) as err:
        config(**fields)
    assert "\n" not in str(err.value)
