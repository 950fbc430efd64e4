"""The decoder: residual routing equals a plain pre-norm Transformer, mean summaries with the count
prior equal full routing at init, causality, gradients and dtypes for every registry entry."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.checks import capture
from helpers.models import ALL_ABLATIONS, DEEPER, randomize_routing, tiny_config, tokens, variant
from helpers.references import EPS, ref_rms_norm

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.train import routing_axes

# ---- an independent plain pre-norm decoder (requirement 2) -------------------------------------


def rope_interleaved(x, theta):
    """x (B, T, H, hd): rotate pairs (x[2i], x[2i+1]) by t * theta^(-2i/hd), as complex numbers."""
    B, T, H, hd = x.shape
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]  # (T, hd/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.reshape(B, T, H, hd // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation[None, :, None, :]).reshape(B, T, H, hd)


def rope_half_split(x, theta):
    """The other common RoPE layout (GPT-NeoX): pairs (x[i], x[i + hd/2]). Used as a negative control."""
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    perm = torch.stack((x1, x2), dim=-1).flatten(-2)  # interleave, rotate, de-interleave
    out = rope_interleaved(perm, theta).unflatten(-1, (hd // 2, 2))
    return torch.cat((out[..., 0], out[..., 1]), dim=-1)


def plain_decoder(w, idx, n_layers, n_heads, theta, rope=rope_interleaved):
    """Pre-norm decoder in float64 from a state_dict: h = h + attn(norm(h)); h = h + mlp(norm(h))."""
    w = {k: v.double() for k, v in w.items()}
    B, T = idx.shape
    x = w["embed.weight"][idx]
    D = x.shape[-1]
    hd = D // n_heads
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in range(n_layers):
        p = f"layers.{layer}."
        q, k, v = (ref_rms_norm(x, EPS) @ w[p + "attn.qkv.weight"].T).split(D, dim=-1)
        q, k, v = (t.reshape(B, T, n_heads, hd) for t in (q, k, v))
        q, k = rope(ref_rms_norm(q, EPS), theta), rope(ref_rms_norm(k, EPS), theta)  # QK-norm, then RoPE
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, D)
        x = x + y @ w[p + "attn.proj.weight"].T
        a, gate = (ref_rms_norm(x, EPS) @ w[p + "mlp.fc1.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * a) @ w[p + "mlp.fc2.weight"].T
    return ref_rms_norm(x, EPS) @ w["head.weight"].T


@pytest.mark.parametrize("size", ["tiny", DEEPER])
def test_residual_routing_equals_a_plain_decoder(registry, size):
    cfg = tiny_config(registry, "baseline", size)
    s = cfg.size
    assert s.rope_theta == 500000.0
    model = build_decoder(cfg)
    with torch.no_grad():  # larger weights than the init, so every nonlinearity matters
        for p in model.parameters():
            p.normal_(std=0.15)
    weights = model.state_dict()
    expected_keys = {"embed.weight", "head.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(s.n_layers) for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    }
    assert set(weights) == expected_keys  # no biases, no norm weights, no routing parameters
    idx = tokens(s.vocab_size, 2, 16)
    logits = model(idx)
    assert logits.dtype == torch.float32
    ref = plain_decoder(weights, idx, s.n_layers, s.n_heads, s.rope_theta)
    torch.testing.assert_close(logits.double(), ref, atol=1e-5, rtol=0)
    # negative controls: the comparison is sensitive to the RoPE layout and theta
    other_layout = plain_decoder(weights, idx, s.n_layers, s.n_heads, s.rope_theta, rope=rope_half_split)
    assert (logits.double() - other_layout).abs().max() > 1e-3
    other_theta = plain_decoder(weights, idx, s.n_layers, s.n_heads, 10000.0)
    assert (logits.double() - other_theta).abs().max() > 1e-3


def test_residual_stream_is_the_sum_of_outputs(registry):
    model = build_decoder(ModelConfig(DEEPER, registry.ablation("baseline")))
    trace = capture(model, tokens(DEEPER.vocab_size, 2, 5))
    stream = trace.emb
    for j, inp in enumerate(trace.inputs):
        torch.testing.assert_close(inp, ref_rms_norm(stream, EPS), atol=1e-5, rtol=1e-5)
        stream = stream + trace.outputs[j]
    torch.testing.assert_close(trace.final, ref_rms_norm(stream, EPS), atol=1e-5, rtol=1e-5)


def test_gated_residual_follows_its_formula(registry):
    """docs/method.md §7: y = g x + (1 - g) F(x), g = sigmoid(<W_q cummean(x), W_k cummean(F(x))> / sqrt(d)) per token."""
    model = build_decoder(ModelConfig(DEEPER, registry.ablation("gated-residual")))
    trace = capture(model, tokens(DEEPER.vocab_size, 2, 6))
    T, D = trace.emb.shape[1], DEEPER.d_model
    counts = torch.arange(1, T + 1, dtype=torch.float64)[None, :, None]
    stream = trace.emb.double()
    for i, out in enumerate(trace.outputs, start=1):
        torch.testing.assert_close(trace.inputs[i - 1].double(), ref_rms_norm(stream, EPS), atol=1e-5, rtol=1e-5)
        fx = out.double()
        wq = model.router.gate_q[i - 1].weight.detach().double()
        wk = model.router.gate_k[i - 1].weight.detach().double()
        q = (stream.cumsum(1) / counts) @ wq.T
        k = (fx.cumsum(1) / counts) @ wk.T
        g = torch.sigmoid((q * k).sum(-1, keepdim=True) / math.sqrt(D))
        stream = g * stream + (1 - g) * fx
    torch.testing.assert_close(trace.final.double(), ref_rms_norm(stream, EPS), atol=1e-5, rtol=1e-5)
    w = model.router.gate_q[0].weight.detach()
    torch.testing.assert_close(w @ w.T, torch.eye(D), atol=1e-5, rtol=0)  # orthogonal init


# ---- mean summaries with count prior 1 equal full routing at init (requirement 4) ---------------


@pytest.mark.parametrize(
    "full, block, changes",
    [
        ("attnres-full", "attnres-block-n8-refdefault", {"blocks": 2}),
        ("attnres-full", "attnres-block-n8-refdefault", {"blocks": 4}),  # uneven: ends 2, 3, 5, 6
        ("attnres-full", "attnres-block-n8-refdefault", {"blocks": 5}),  # ends 2, 3, 4, 5, 6
        ("s-lr-full-r64", "s-lr-block-n8-r64-refdefault", {"blocks": 3, "rank": 8}),
        ("s-lr-full-r64", "s-lr-block-n8-r64-refdefault", {"blocks": 4, "rank": 8}),
        ("s-lr-full-r64", "s-lr-block-size4-r64", {"block_size": 4, "rank": 8, "block_summary": "mean",
                                                   "count_prior": 1.0}),
        ("s-lr-full-r64", "s-lr-block-n8-r64-h4", {"blocks": 4, "rank": 8, "block_summary": "mean",
                                                   "count_prior": 1.0}),
    ],
)
def test_mean_summaries_with_count_prior_equal_full_routing_at_init(registry, full, block, changes):
    block_abl = variant(registry.ablation(block), **changes)
    assert (block_abl.options.block_summary, block_abl.options.count_prior) == ("mean", 1.0)
    full_abl = variant(registry.ablation(full), rank=changes.get("rank"), depth_heads=block_abl.options.depth_heads)
    full_model = build_decoder(ModelConfig(DEEPER, full_abl))
    block_model = build_decoder(ModelConfig(DEEPER, block_abl))
    block_model.load_state_dict(full_model.state_dict())  # same parameters, strict
    idx = tokens(DEEPER.vocab_size, 2, 8)
    a, b = capture(full_model, idx), capture(block_model, idx)
    for x, y in zip([*a.inputs, a.final], [*b.inputs, b.final], strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    assert len(b.routing[-1]) < len(a.routing[-1])  # the block model really routes over fewer sources


@pytest.mark.parametrize("changes", [{"block_summary": "sum", "count_prior": 0.0}, {"block_summary": "sqrt_mean"},
                                     {"count_prior": 0.0}])
def test_other_summaries_differ_from_full_routing(registry, changes):
    """Negative control: raw sums, sqrt means or a missing prior do not reproduce full routing."""
    full_model = build_decoder(ModelConfig(DEEPER, registry.ablation("attnres-full")))
    block_abl = variant(registry.ablation("attnres-block-n8-refdefault"), blocks=3, **changes)
    block_model = build_decoder(ModelConfig(DEEPER, block_abl))
    block_model.load_state_dict(full_model.state_dict())
    idx = tokens(DEEPER.vocab_size, 2, 8)
    assert (block_model(idx) - full_model(idx)).abs().max() > 1e-4


# ---- causality, gradients, dtypes for every registry entry (requirements 6-8) ------------------


@pytest.mark.parametrize("name", ALL_ABLATIONS)
def test_causal(registry, name):
    cfg = tiny_config(registry, name)
    model = build_decoder(cfg)
    randomize_routing(model)
    idx = tokens(cfg.size.vocab_size, 2, 8)
    with torch.no_grad():
        logits = model(idx)
        for t in (0, 3, 6):
            changed = idx.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % cfg.size.vocab_size
            other = model(changed)
            torch.testing.assert_close(other[:, : t + 1], logits[:, : t + 1], atol=1e-6, rtol=0)
            assert (other[:, t + 1] - logits[:, t + 1]).abs().max() > 1e-6  # the change is seen where it is


@pytest.mark.parametrize("name", ALL_ABLATIONS)
def test_gradients_reach_every_parameter(registry, name):
    cfg = tiny_config(registry, name)
    model = build_decoder(cfg)
    randomize_routing(model, std=0.1)
    idx = tokens(cfg.size.vocab_size, 2, 8)
    targets = tokens(cfg.size.vocab_size, 2, 8, seed=2)
    logits = model(idx)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    a = cfg.ablation
    key_source, embedding_key = (getattr(a.options, k, None) for k in ("key_source", "embedding_key"))
    names = [n for n, _ in model.named_parameters()]
    expected = {
        "router.queries": a.routing in ("attnres", "delta_attnres"),
        "router.gate_q.": a.routing == "gated",
        "router.gate_k.": a.routing == "gated",
        "router.embedding_key_static": embedding_key in ("static", "projected_plus_static"),
        "router.embedding_key_proj.": key_source == "projected" and embedding_key != "static",
        "router.value_key_proj.": key_source in ("value_projected", "value_projected_shared"),
    }
    for prefix, present in expected.items():
        assert any(n.startswith(prefix) for n in names) == present, prefix
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} gets no gradient"
        assert torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, f"{n} has a zero gradient"
    if a.routing == "attnres":  # every site's query row, not just the tensor as a whole
        assert (model.router.queries.grad.abs().sum(-1) > 0).all()
    if key_source == "projected":  # the P-LR key rows of every sublayer
        D = cfg.size.d_model
        for layer in model.layers:
            for lin in (layer.attn.proj, layer.mlp.fc2):
                assert lin.weight.shape[0] == D + cfg.extra_out
                assert (lin.weight.grad[D:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ALL_ABLATIONS)
def test_forward_in_float32_and_bfloat16(registry, name, dtype):
    cfg = tiny_config(registry, name)
    model = build_decoder(cfg)
    randomize_routing(model, std=0.1)
    idx = tokens(cfg.size.vocab_size, 2, 8)
    with torch.no_grad():
        reference = model(idx)
        out = model.to(dtype)(idx, return_routing=True)
    assert out.logits.shape == (2, 8, cfg.size.vocab_size)
    assert out.logits.dtype == dtype
    assert torch.isfinite(out.logits).all()
    tolerance = 1e-6 if dtype == torch.float32 else 0.05 * reference.abs().max().item()
    torch.testing.assert_close(out.logits.float(), reference, atol=tolerance, rtol=0)
    if cfg.ablation.routing == "attnres":
        assert all(alpha.dtype == torch.float32 and torch.isfinite(alpha).all() for alpha in out.routing)
    elif cfg.ablation.routing == "gated":  # per sublayer the two-source weights [alpha, 1 - alpha]
        assert len(out.routing) == cfg.size.n_sublayers
        for w in out.routing:
            assert w.shape == (2, 2, 8, 1) and w.dtype == torch.float32
            torch.testing.assert_close(w.sum(0), torch.ones(2, 8, 1))
    elif routing_axes.recorded(cfg) is None:
        assert not out.routing  # no routing weights with the plain residual stream
    else:  # every other kind records its weights, one [S, B, T, m] float32 tensor per row of its heatmap
        sites = routing_axes.axes(cfg)["site_labels"]
        assert len(out.routing) == len(sites)
        for w in out.routing:
            assert w.dim() == 4 and w.shape[1:3] in ((2, 8), (1, 1)) and w.dtype == torch.float32  # (1, 1): static
            assert torch.isfinite(w).any() and not torch.isinf(w).any()  # (NaN: a source a DWA leaves out)
            if routing_axes.recorded(cfg) == "depth_weights":  # a softmax over the sources
                torch.testing.assert_close(w.sum(0), torch.ones_like(w[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rope_rotates_each_pair_bit_for_bit(dtype):
    """apply_rope (x * cos + swap(x) * sin, either table layout, q and k stacked or not) against the pair formula
    (x0 cos - x1 sin, x0 sin + x1 cos) computed on the unbound pairs: the same products and sums, so equal bits."""
    from lrattn_lightning.model.rope import apply_rope, rope_angles, rope_tables

    torch.manual_seed(0)
    x = torch.randn(2, 16, 2, 3, 8, dtype=dtype)  # (B, T, q/k, H, hd)
    cos, sin = rope_angles(torch.arange(16), 8, 500000.0)
    cdtype = torch.promote_types(dtype, torch.float32)
    x0, x1 = x.to(cdtype).unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos.to(cdtype)[None, :, None, None, :], sin.to(cdtype)[None, :, None, None, :]
    expected = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    assert torch.equal(apply_rope(x, *rope_tables(cos, sin)), expected)
    assert torch.equal(apply_rope(x[:, :, 0], cos, sin), expected[:, :, 0])  # (B, T, H, hd)
    assert not torch.equal(apply_rope(x, cos, -sin), expected)  # the sign of the rotation matters


def test_a_compiled_forward_computes_the_rope_tables_once_through_their_op(registry):
    """Compiling, the decoder takes RoPE's tables from the opaque op `lrattn::rope_tables` (Inductor, tracing the
    angles inline, fused their cos and sin into every rotation: 140 ms of a 1.6 s step at `small` on an AVX2 CPU):
    the traced graph holds the op once and no cos or sin; the op's tables equal the eager ones bit for bit, at an
    offset too (KV-cache decoding), and its fake has their shape; compiled logits equal eager ones."""
    import torch._dynamo

    from lrattn_lightning.model.rope import positions_rope, rope_angles, rope_tables

    cfg = tiny_config(registry, "baseline")
    hd, theta = cfg.size.d_model // cfg.size.n_heads, cfg.size.rope_theta
    for start, length in ((0, 8), (5, 3)):
        expected = rope_tables(*rope_angles(torch.arange(start, start + length), hd, theta))
        op = torch.ops.lrattn.rope_tables(start, length, hd, theta, torch.device("cpu"))
        assert all(torch.equal(a, b) for a, b in zip(op, expected, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(positions_rope(start, length, hd, theta, torch.device("cpu")),
                                                     expected, strict=True))
    torch.library.opcheck(torch.ops.lrattn.rope_tables.default, (2, 4, hd, theta, torch.device("cpu")))

    traced = []

    def record_graph(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    model = build_decoder(cfg).eval()
    idx = torch.randint(0, cfg.size.vocab_size, (2, 8))
    torch._dynamo.reset()
    try:
        torch.compile(model, backend=record_graph)(idx)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="aot_eager")(idx), model(idx), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    assert sum("rope_tables" in t for t in traced) == 1, traced
    assert not [t for t in traced if t in ("cos", "sin") or t.endswith((".cos", ".sin"))], traced
