"""MUDDFormer (routing: muddformer): the attention's separate Q/K/V inputs, the dense aggregation's formula in
float64 with random parameters, the baseline at init, accounting, decoding, gradients, diagnostics."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.checks import assert_bf16_autocast_close, assert_causal_and_decodes_with_the_kv_cache
from helpers.models import DEEPER, kind_config, randomized, tokens
from helpers.references import ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.attention import AttentionPass
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import parse_registry
from lrattn_lightning.model.rope import apply_rope, rope_angles
from lrattn_lightning.train import routing_axes
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER  # three layers, d = 32
VARIANTS = [{}, {"mudd_prepost_norm": True}, {"mudd_dynamic": False}, {"mudd_multiway": False},
            {"mudd_prepost_norm": True, "mudd_multiway": False}]


config = functools.partial(kind_config, "muddformer")


def baseline_of(model) -> torch.nn.Module:
    raw = {"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}
    base = build_decoder(ModelConfig(SIZE, parse_registry(raw).ablation("b"))).to(next(model.parameters()).dtype)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("router.")})
    return base.eval()


def draw(name: str, p: torch.Tensor) -> torch.Tensor:
    """Every router parameter moved off its start: gains and static weights by N(0, 0.5), the rest by N(0, 0.2)."""
    return p + torch.randn_like(p) * (0.5 if "gain" in name or "static" in name else 0.2)


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def logits_float64(model, idx, options):
    """The model written out from docs/method.md §10, the routing by hand; the sublayers are the model's own modules."""
    r, L, d = model.router, SIZE.n_layers, SIZE.d_model
    ppn, dynamic, multi = (options.get("mudd_prepost_norm", False), options.get("mudd_dynamic", True),
                           options.get("mudd_multiway", True))
    cos, sin = rope_angles(torch.arange(idx.shape[1]), d // SIZE.n_heads, SIZE.rope_theta)
    x0 = model.embed(idx)
    sources = [rms(x0) * r.pre_gain[0] if ppn else x0]
    q = k = v = res = x0
    for i, layer in enumerate(model.layers, start=1):
        a = layer.attn(ref_rms_norm(q), ref_rms_norm(k), ref_rms_norm(v), AttentionPass(cos, sin), 0)
        y = res + a
        X = y + layer.mlp(ref_rms_norm(y))
        sources.append(rms(X) * r.pre_gain[i] if ppn else X)
        C, n = (4 if multi and i < L else 1), i + 1
        w = r.static[i - 1].expand(*X.shape[:-1], C, n)
        if dynamic:
            K = 64 * (C * n * (4 if i == L else 1) // 64 + 1)
            assert r.w1[i - 1].shape == (K, d)
            gelu = lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))  # noqa: E731
            w = w + (gelu(rms(X) @ r.w1[i - 1].T) @ r.w2[i - 1].T).view(*X.shape[:-1], C, n)
        streams = [sum(w[..., c, j, None] * sources[j] for j in range(n)) for c in range(C)]
        if ppn:
            streams[-1] = rms(streams[-1]) * r.post_gain[i - 1]
            streams = [X + s for s in streams]
        q, k, v, res = streams if C == 4 else streams * 4
    return model.head(ref_rms_norm(res))


def test_the_attention_takes_separate_query_key_and_value_inputs():
    """Separate inputs: the same qkv weight's key and value rows on them, against the attention written out."""
    torch.manual_seed(0)
    attn = build_decoder(config()).double().layers[0].attn
    B, T, d, H = 2, 6, SIZE.d_model, SIZE.n_heads
    xq, xk, xv = (torch.randn(B, T, d, dtype=torch.float64) for _ in range(3))
    cos, sin = rope_angles(torch.arange(T), d // H, SIZE.rope_theta)
    same = attn(xq, xq, xq, AttentionPass(cos, sin), 0)  # one input: the fused projection
    torch.testing.assert_close(attn(xq, xq.clone(), xq.clone(), AttentionPass(cos, sin), 0), same, rtol=1e-12,
                               atol=1e-12)  # the same input as three: the separate projections, the same
    wq, wk, wv = attn.qkv.weight.chunk(3)
    heads = lambda x, w: (x @ w.T).view(B, T, H, d // H)  # noqa: E731
    q, k = apply_rope(ref_rms_norm(heads(xq, wq)), cos, sin), apply_rope(ref_rms_norm(heads(xk, wk)), cos, sin)
    scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(d // H)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhts,bshe->bthe", scores.softmax(-1), heads(xv, wv)).reshape(B, T, d)
    torch.testing.assert_close(attn(xq, xk, xv, AttentionPass(cos, sin), 0), attn.proj(y), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_logits_are_the_formulas_with_random_parameters(options):
    model = randomized(config(**options), draw)
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        ours, written = model(idx), logits_float64(model, idx, options)
        torch.testing.assert_close(ours, written, rtol=1e-10, atol=1e-10)
        assert (ours - baseline_of(model)(idx)).abs().max() > 1e-3  # the connections matter


@pytest.mark.parametrize("options", VARIANTS[:3], ids=["default", "ppn", "static"])
def test_exactly_the_baseline_at_init(options):
    torch.manual_seed(0)
    model = build_decoder(config(**options)).double().eval()
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), baseline_of(model)(idx), rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_parameters_and_flops_are_counted(options):
    cfg = config(**options)
    model = build_decoder(cfg)
    L, d = SIZE.n_layers, SIZE.d_model
    ppn, dynamic = options.get("mudd_prepost_norm", False), options.get("mudd_dynamic", True)
    ways = [4 if options.get("mudd_multiway", True) and i < L else 1 for i in range(1, L + 1)]
    params = flops = 0
    for i, C in enumerate(ways, start=1):
        K = 64 * (C * (i + 1) * (4 if i == L else 1) // 64 + 1)
        params += C * (i + 1) + (d * K + K * C * (i + 1) if dynamic else 0)
        flops += 2 * d * C * (i + 1) + (2 * d * K + 2 * K * C * (i + 1) if dynamic else 0) + (C * d if ppn else 0)
    params += (L + 1) * d + L * d if ppn else 0
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == params
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert added_flops(cfg) == flops


@pytest.mark.parametrize("options", [{}, {"mudd_prepost_norm": True}], ids=["default", "ppn"])
def test_causal_and_decodes_with_the_kv_cache(options):
    assert_causal_and_decodes_with_the_kv_cache(randomized(config(**options), draw).float())


def test_float64_gradients_of_the_router():
    model = randomized(config(mudd_prepost_norm=True), draw)
    idx = tokens(SIZE.vocab_size, batch=1, length=4)
    params = dict(model.router.named_parameters())
    # every kind of router parameter, a slice of each (a gradcheck costs two passes per number)
    parts = [("static.0", (slice(None),)), ("static.2", (slice(None),)), ("w1.1", (0, slice(0, 8))),
             ("w2.2", (0, slice(0, 16))), ("pre_gain", (1, slice(0, 8))), ("post_gain", (0, slice(0, 8)))]

    def loss(*values):
        state = {}
        for (name, where), value in zip(parts, values, strict=True):
            full = state.get(f"router.{name}", params[name].detach().clone())
            full = full.index_put((torch.arange(full.shape[0])[where[0]],) if len(where) == 1 else
                                  (torch.tensor(where[0]), torch.arange(full.shape[1])[where[1]]), value)
            state[f"router.{name}"] = full
        logits = torch.func.functional_call(model, state, (idx,))
        return logits.square().mean() + logits[..., :3].sum()

    inputs = tuple(params[name].detach()[where].clone().requires_grad_() for name, where in parts)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6)


def test_bf16_autocast_keeps_the_aggregation_in_float32():
    model = randomized(config(mudd_prepost_norm=True), draw).float()
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    assert_bf16_autocast_close(model, idx)


def test_recorded_weights_are_the_aggregations_rows():
    cfg = config()
    model = build_decoder(cfg).eval()
    with torch.no_grad():
        out = model(tokens(SIZE.vocab_size, batch=2, length=8), return_routing=True)
    labels = routing_axes.axes(cfg)["site_labels"]
    assert len(out.routing) == len(labels) == 4 + 4 + 1 and labels[0] == "after layer 1: Q"
    for row, n in zip(out.routing, [2] * 4 + [3] * 4 + [4], strict=True):
        assert row.shape == (n, 2, 8, 1)
        torch.testing.assert_close(row, torch.eye(n)[-1].view(n, 1, 1, 1).expand_as(row))  # one-hot at init


def test_adamw_takes_every_router_parameter():
    model = build_decoder(config(mudd_prepost_norm=True))
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)


@pytest.mark.parametrize("field", ["mudd_prepost_norm", "mudd_dynamic", "mudd_multiway"])
def test_a_bad_option_is_one_line(field):
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "muddformer", field: "yes"}}}
    with pytest.raises(InputError, match=f"field '{field}': must be true or false, got 'yes'"):
        parse_registry(raw)
