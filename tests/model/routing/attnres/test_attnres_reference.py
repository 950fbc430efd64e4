"""Depth routing against independent formulas: depth_read, uniform start, S-LR keys, block sources."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.checks import capture
from helpers.models import ATTNRES_ABLATIONS, DEEPER, randomize_routing, tiny_config, tokens, variant
from helpers.references import EPS, ref_head_rms_norm, ref_rms_norm

from lrattn_lightning.model.accounting import sources_per_site
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.routing.attnres import reference as routing
from lrattn_lightning.model.routing.attnres.reference import depth_read

# ---- depth_read against a float64 loop (requirement 10) ----------------------------------------


def ref_depth_read(values, keys, query, bias, scale, key_norm, heads):
    """One read, written as loops over heads and sources in float64."""
    v, k = values.double(), keys.double()
    S, B, T, D = v.shape
    q = query.double()
    q = q.reshape(B, T, heads, -1) if q.dim() == 3 else q.reshape(1, 1, heads, -1)  # per token or static
    rh, dh = k.shape[-1] // heads, D // heads
    out = torch.zeros(B, T, D, dtype=torch.float64)
    alpha = torch.zeros(S, B, T, heads, dtype=torch.float64)
    for m in range(heads):
        logits = []
        for s in range(S):
            key = k[s, :, :, m * rh : (m + 1) * rh]  # (B, T, rh)
            if key_norm:
                key = key / torch.sqrt((key * key).mean(-1, keepdim=True) + EPS)
            logit = scale * (key * q[:, :, m]).sum(-1)  # (B, T)
            if bias is not None:
                logit = logit + float(bias[s])
            logits.append(logit)
        logits = torch.stack(logits)  # (S, B, T)
        weights = torch.exp(logits - logits.max(0).values)
        weights = weights / weights.sum(0)
        alpha[..., m] = weights
        for s in range(S):
            out[:, :, m * dh : (m + 1) * dh] += weights[s, :, :, None] * v[s, :, :, m * dh : (m + 1) * dh]
    return out, alpha


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("key_norm", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.35])
def test_depth_read_matches_float64_formula(heads, with_bias, key_norm, scale):
    S, B, T, D, R = 5, 2, 3, 16, 8
    values = torch.randn(S, B, T, D)
    keys = torch.randn(S, B, T, R) * 0.7 + 0.1
    query = torch.randn(R)
    bias = torch.log(torch.tensor([1.0, 3.0, 2.0, 4.0, 1.0])) if with_bias else None
    out, alpha = depth_read(values, keys, query, bias=bias, scale=scale, key_norm=key_norm, heads=heads,
                            return_weights=True)
    ref_out, ref_alpha = ref_depth_read(values, keys, query, bias, scale, key_norm, heads)
    assert out.shape == (B, T, D) and out.dtype == torch.float32
    assert alpha.shape == (S, B, T, heads)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alpha.double(), ref_alpha, atol=1e-6, rtol=1e-5)
    assert ref_alpha.std() > 0.05  # the routing is far from uniform, so the comparison means something
    # without return_weights it is the same output
    torch.testing.assert_close(
        depth_read(values, keys, query, bias=bias, scale=scale, key_norm=key_norm, heads=heads), out
    )


def test_depth_read_takes_a_per_head_query():
    values, keys, query = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 8), torch.randn(4, 2)
    flat = depth_read(values, keys, query.flatten(), heads=4)
    torch.testing.assert_close(depth_read(values, keys, query, heads=4), flat)
    torch.testing.assert_close(flat.double(), ref_depth_read(values, keys, query, None, 1.0, True, 4)[0],
                               atol=1e-5, rtol=1e-5)


def test_depth_read_rejects_indivisible_heads():
    with pytest.raises(ValueError):
        depth_read(torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 6), torch.randn(6), heads=4)


def test_depth_read_softmax_is_float32_for_bfloat16():
    values, keys, query = torch.randn(4, 1, 3, 8), torch.randn(4, 1, 3, 8), torch.randn(8)
    out, alpha = depth_read(values.bfloat16(), keys.bfloat16(), query.bfloat16(), return_weights=True)
    assert out.dtype == torch.bfloat16 and alpha.dtype == torch.float32
    torch.testing.assert_close(alpha.sum(0), torch.ones(1, 3, 1))


# ---- zero queries route uniformly (requirement 3) ----------------------------------------------

UNIFORM_CASES = [
    ("attnres-full", {}),
    ("s-lr-full-r64", {"rank": 8}),
    ("p-lr-full-r32", {"rank": 8}),
    ("attnres-block-n8", {"blocks": 4}),  # raw sums, ends 2, 3, 5, 6
    ("s-lr-block-n8-r64", {"blocks": 3, "rank": 8}),
    ("s-lr-block-n8-r64-h4", {"blocks": 4, "rank": 8}),
    ("p-lr-block-n8-r32", {"blocks": 4, "rank": 8}),
    ("s-lr-block-size4-r64", {"rank": 8}),
]


@pytest.mark.parametrize("name, changes", UNIFORM_CASES)
def test_zero_queries_route_uniformly(registry, name, changes):
    abl = variant(registry.ablation(name), **changes)
    assert abl.options.query_init == "zero" and abl.options.count_prior == 0.0
    cfg = ModelConfig(DEEPER, abl)
    model = build_decoder(cfg)
    assert torch.count_nonzero(model.router.queries) == 0
    idx = tokens(DEEPER.vocab_size, 2, 5)
    out = model(idx, return_routing=True)
    assert len(out.routing) == DEEPER.n_sublayers  # sites j = 1..2L
    for j, alpha in enumerate(out.routing, start=1):
        S = alpha.shape[0]
        assert alpha.shape == (S, 2, 5, abl.options.depth_heads)
        assert S == (j + 1 if not abl.options.is_block else sources_per_site(cfg)[j - 1])
        torch.testing.assert_close(alpha, torch.full_like(alpha, 1.0 / S))


def test_full_routing_at_init_averages_every_output(registry):
    """At zero queries, full routing reads the plain mean of o_0 .. o_j (checked on the final read)."""
    cfg = ModelConfig(DEEPER, registry.ablation("attnres-full"))
    model = build_decoder(cfg)
    idx = tokens(DEEPER.vocab_size, 2, 5)
    trace = capture(model, idx)
    mean = (trace.emb + sum(trace.outputs)) / (len(trace.outputs) + 1)
    torch.testing.assert_close(trace.final, ref_rms_norm(mean, EPS), atol=1e-5, rtol=1e-5)


def test_random_queries_do_not_route_uniformly(registry):
    model = build_decoder(ModelConfig(DEEPER, registry.ablation("attnres-full")))
    randomize_routing(model)
    alpha = model(tokens(DEEPER.vocab_size, 1, 4), return_routing=True).routing[-1]
    assert (alpha - 1.0 / alpha.shape[0]).abs().max() > 0.01


# ---- S-LR keys are the value tails (requirement 5) ---------------------------------------------

SLR_CASES = [
    ("s-lr-full-r64", {"rank": 8}),
    ("s-lr-block-n8-r64", {"blocks": 4, "rank": 8}),
    ("s-lr-block-n8-r64-h4", {"blocks": 3, "rank": 8}),
    ("s-lr-block-n8-r64-sqrtmean", {"blocks": 4, "rank": 8}),
    ("s-lr-block-n8-r64-refdefault", {"blocks": 4, "rank": 8}),
    ("s-lr-block-n8-r64-nokeynorm", {"blocks": 4, "rank": 8}),
    ("s-lr-block-size4-r64", {"rank": 12}),
]


def spy_depth_read(monkeypatch) -> list:
    calls = []
    original = routing.depth_read

    def spy(values, keys, query, **kwargs):
        calls.append((values.detach().clone(), keys.detach().clone(), kwargs))
        return original(values, keys, query, **kwargs)

    monkeypatch.setattr(routing, "depth_read", spy)
    return calls


def effective_keys(keys, kwargs, heads):
    """The keys depth_read routes with: it normalises them itself when called with key_norm=True."""
    return ref_head_rms_norm(keys, heads) if kwargs.get("key_norm", True) else keys


@pytest.mark.parametrize("name, changes", SLR_CASES)
def test_s_lr_keys_are_the_value_tails(registry, monkeypatch, name, changes):
    abl = variant(registry.ablation(name), **changes)
    cfg = ModelConfig(DEEPER, abl)
    model = build_decoder(cfg, impl="reference")  # the spy sees the reference path; fast parity: test_routing_fast
    randomize_routing(model)
    calls = spy_depth_read(monkeypatch)
    model(tokens(DEEPER.vocab_size, 2, 5))
    assert len(calls) == DEEPER.n_sublayers, "every read site j >= 1 goes through depth_read"
    r, heads = abl.options.rank, abl.options.depth_heads
    for j, (values, keys, kwargs) in enumerate(calls, start=1):
        assert keys.shape == (*values.shape[:-1], r)
        tail = values[..., -r:]  # every source, embedding and block summaries included
        if abl.options.key_norm == "rms":  # the key is the tail of the raw sum c^a v (a summary's count c)
            counts = torch.tensor([len(m) for m in ref_sources(j, cfg.block_ends())], dtype=torch.float32)
            expected = ref_head_rms_norm(tail * counts.view(-1, 1, 1, 1) ** abl.options.summary_exponent, heads)
        else:
            expected = tail
        torch.testing.assert_close(effective_keys(keys, kwargs, heads), expected, atol=1e-5, rtol=1e-5)


def test_p_lr_keys_are_not_the_value_tails(registry, monkeypatch):
    """The same check fails for projected keys: it does discriminate."""
    cfg = ModelConfig(DEEPER, variant(registry.ablation("p-lr-block-n8-r32"), blocks=4, rank=8))
    model = build_decoder(cfg, impl="reference")
    calls = spy_depth_read(monkeypatch)
    model(tokens(DEEPER.vocab_size, 2, 5))
    values, keys, kwargs = calls[-1]
    assert not torch.allclose(effective_keys(keys, kwargs, 1), ref_rms_norm(values[..., -8:]), atol=1e-3)


# ---- the whole routing rule against an independent reference (docs/method.md §2-3) ----------------------


def ref_sources(j: int, ends: list[int]) -> list[list[int]]:
    """Member indices of each source at read site j: [0], completed blocks, the partial block."""
    if not ends:
        return [[i] for i in range(j + 1)]
    sources, start = [[0]], 1
    for end in ends:
        if end > j:
            break
        sources.append(list(range(start, end + 1)))
        start = end + 1
    if start <= j:
        sources.append(list(range(start, j + 1)))
    return sources


def ref_read(cfg, params, emb, outputs, j):
    """h_j and alpha_j in float64, from docs/method.md §2-3 (RMSNorm eps of the float32 model: EPS)."""
    a, D = cfg.ablation, cfg.size.d_model
    r, heads = a.options.rank or cfg.size.d_model, a.options.depth_heads
    exponent = {"sum": 0.0, "mean": 1.0, "sqrt_mean": 0.5}[a.options.block_summary]
    norm = a.options.key_norm == "rms"
    raw = [emb.double(), *(o.double() for o in outputs)]
    value = [x[..., :D] for x in raw]

    def weight(name):
        return params[name].double()

    def project(v, index):  # value_projected: W RMSNorm(v)
        if a.options.key_source == "value_projected_shared":
            index = 0
        elif a.options.embedding_key not in ("projected", "projected_plus_static"):
            index -= 1  # no embedding projection: sublayer i uses projection i - 1
        return ref_rms_norm(v, EPS) @ weight(f"value_key_proj.{index}.weight").T

    emb_key = torch.zeros(*emb.shape[:-1], r, dtype=torch.float64)
    if a.options.embedding_key in ("projected", "projected_plus_static"):
        if a.options.key_source == "projected":  # emitted keys are normalised where they are emitted
            k0 = emb.double() @ weight("embedding_key_proj.weight").T
            emb_key = ref_head_rms_norm(k0, heads, EPS) if norm else k0
        else:
            emb_key = project(emb.double(), 0)
    if a.options.embedding_key in ("static", "projected_plus_static"):
        emb_key = emb_key + weight("embedding_key_static")
    emitted = [emb_key, *(ref_head_rms_norm(x[..., D : D + r], heads, EPS) if norm else x[..., D : D + r]
                          for x in raw[1:])]
    values, keys, counts = [], [], []
    for members in ref_sources(j, cfg.block_ends()):
        c = len(members)
        total = sum(value[i] for i in members)
        v = total / c**exponent
        if members == [0] and a.options.key_source not in ("value", "sliced"):
            k = emb_key
        elif a.options.key_source == "value":
            k = v
        elif a.options.key_source == "sliced":  # the tail of the raw sum; / c^a only without key norm
            k = total[..., -r:] if norm else v[..., -r:]
        elif a.options.key_source == "projected":  # the sum of the normalised emitted keys
            k = sum(emitted[i] for i in members)
            k = k if norm else k / c**exponent
        else:  # value_projected: the block's most recent sublayer projects the summary value
            k = project(v, members[-1])
        values.append(v)
        keys.append(ref_head_rms_norm(k, heads, EPS) if norm else k)
        counts.append(c)
    q = weight("queries")[j - 1]
    if a.options.query == "gated_dynamic":  # q_j + g_j q_dyn, q_dyn: the last r rows sublayer j emitted
        q_dyn = raw[j][..., -r:].unflatten(-1, (heads, -1))
        q = (q.view(heads, -1) + weight("query_gates")[j - 1].view(heads, 1) * q_dyn).flatten(-2)
    if a.options.query_norm:
        q = ref_head_rms_norm(q, heads, EPS)
    scale = a.options.logit_scale
    scale = 1.0 if scale == "none" else 1 / math.sqrt(r // heads) if scale == "inv_sqrt_head_dim" else float(scale)
    bias = torch.tensor([a.options.count_prior * math.log(c) for c in counts], dtype=torch.float64)
    return ref_depth_read(torch.stack(values), torch.stack(keys), q, bias, scale, False, heads)


ROUTING_CASES = [
    ("attnres-full", {}),
    ("attnres-block-n8", {"blocks": 4}),
    ("attnres-block-n8-refdefault", {"blocks": 4}),
    ("s-lr-full-r64", {"rank": 8}),
    ("s-lr-block-n8-r64", {"blocks": 4, "rank": 8}),
    ("s-lr-block-n8-r64-sqrtmean", {"blocks": 3, "rank": 8}),
    ("s-lr-block-n8-r64-h4", {"blocks": 4, "rank": 8}),
    ("s-lr-block-size4-r64", {"rank": 8}),
    ("s-lr-block-n8-r64-nokeynorm", {"blocks": 4, "rank": 8}),
    ("s-lr-block-n8-r64-qnorm-normal", {"blocks": 4, "rank": 8}),
    ("s-lr-block-n8-r64-refdefault", {"blocks": 4, "rank": 8}),
    ("p-lr-full-r32", {"rank": 8}),
    ("p-lr-block-n8-r32", {"blocks": 4, "rank": 8}),
    ("p-lr-block-n8-r32-static-embkey", {"blocks": 4, "rank": 8}),
    ("p-lr-block-n8-r32-projstatic-embkey", {"blocks": 3, "rank": 8}),
    ("p-lr-block-n8-r32-refdefault", {"blocks": 4, "rank": 8}),
    ("p-lr-block-n8-r32", {"blocks": 3, "rank": 8, "depth_heads": 2}),
    ("p-lr-block-n8-r32", {"blocks": 4, "rank": 8, "key_norm": "none", "block_summary": "mean"}),
    ("vp-lr-block-n8-r32", {"blocks": 4, "rank": 8}),
    ("vp-lr-block-n8-r32", {"blocks": 3, "rank": 8, "embedding_key": "static", "block_summary": "mean"}),
    ("vp-shared-lr-block-n8-r32", {"blocks": 4, "rank": 8}),
    ("vp-shared-lr-block-n8-r32", {"rank": 8, "blocks": None}),
    ("p-lr-block-n8-r32-dynquery", {"blocks": 4, "rank": 8}),
    ("p-lr-block-n8-r32-dynquery", {"blocks": 4, "rank": 8, "key_source": "sliced", "embedding_key": "sliced",
                                    "depth_heads": 2, "query_norm": True}),
]


@pytest.mark.parametrize("impl", ["reference", "auto"])  # auto: fast, compiled for the dynamic query
@pytest.mark.parametrize("name, changes", ROUTING_CASES)
def test_routing_matches_the_spec_reference(registry, name, changes, impl):
    cfg = ModelConfig(DEEPER, variant(registry.ablation(name), **changes))
    model = build_decoder(cfg, impl=impl)
    randomize_routing(model, std=1.0)
    params = {k: p.detach() for k, p in model.router.named_parameters()}
    trace = capture(model, tokens(DEEPER.vocab_size, 2, 6))
    M = DEEPER.n_sublayers
    assert len(trace.inputs) == len(trace.outputs) == M
    torch.testing.assert_close(trace.inputs[0].double(), ref_rms_norm(trace.emb.double(), EPS), atol=1e-5, rtol=1e-5)
    spread = 0.0
    for j in range(1, M + 1):
        h, alpha = ref_read(cfg, params, trace.emb, trace.outputs[:j], j)
        read = trace.final if j == M else trace.inputs[j]
        torch.testing.assert_close(read.double(), ref_rms_norm(h, EPS), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(trace.routing[j - 1].double(), alpha, atol=1e-5, rtol=1e-4)
        spread = max(spread, float(alpha.std(0).max()))
    assert spread > 0.01  # routing is not uniform here


def test_reference_sources_layout():
    assert ref_sources(3, []) == [[0], [1], [2], [3]]
    assert ref_sources(1, [2, 3, 5, 6]) == [[0], [1]]
    assert ref_sources(4, [2, 3, 5, 6]) == [[0], [1, 2], [3], [4]]
    assert ref_sources(6, [2, 3, 5, 6]) == [[0], [1, 2], [3], [4, 5], [6]]


@pytest.mark.parametrize("name", ATTNRES_ABLATIONS)
def test_routing_weights_are_distributions(registry, name):
    cfg = tiny_config(registry, name)
    model = build_decoder(cfg)
    randomize_routing(model)
    out = model(tokens(cfg.size.vocab_size, 2, 4), return_routing=True)
    assert [w.shape[0] for w in out.routing] == sources_per_site(cfg)
    for alpha in out.routing:
        assert alpha.dtype == torch.float32 and (alpha >= 0).all()
        torch.testing.assert_close(alpha.sum(0), torch.ones_like(alpha[0]))
