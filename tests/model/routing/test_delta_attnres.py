"""Delta Attention Residuals (routing: delta_attnres), both modes.

`delta_mode: delta`: the formula in float64, the plain final read, accounting. `delta_mode: delta_block` (below): the
formula in float64 for both block sources, where they part, accounting, diagnostics, errors and the registry entries.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from helpers.checks import (
    assert_bf16_autocast_close,
    assert_causal_and_decodes_with_the_kv_cache,
    assert_router_gradcheck,
    capture,
)
from helpers.models import DEEPER, GRAD, kind_config, randomized, tiny_config, tokens
from helpers.references import ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import model_config_from_dict, parse_registry
from lrattn_lightning.train import routing_axes
from lrattn_lightning.train.diagnostics import weights_table
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER  # three layers, d = 32


config = functools.partial(kind_config, "delta_attnres")


def draw(name: str, p: torch.Tensor) -> torch.Tensor:
    """Queries N(0, 1), key norm gains 1 + N(0, 0.3), every other router parameter N(0, 0.3): routing far from
    uniform."""
    return torch.randn_like(p) * (1.0 if name == "queries" else 0.3) + (1.0 if name == "key_norm_weight" else 0)


def reads_float64(model, trace, null):
    """What each sublayer reads, by the formula written out: the stream plus the softmax over the deltas."""
    r = model.router
    deltas, stream, reads = [], trace.emb.double(), []
    for j in range(2 * SIZE.n_layers):
        sources = list(deltas)
        site = j if null else j - 1
        if null:
            sources.insert(0, r.null_sources[site].detach().double().expand_as(stream))
        if sources:
            logits = torch.stack([(q * k).sum(-1) for q, k in [(r.queries[site].detach().double(),
                                 F.rms_norm(v, (SIZE.d_model,), eps=1e-6) * r.key_norm_weight[site].detach().double())
                                 for v in sources]])
            weights = logits.softmax(0)
            reads.append(stream + sum(w.unsqueeze(-1) * v for w, v in zip(weights, sources, strict=True)))
        else:
            reads.append(stream)
        out = trace.outputs[j][..., : SIZE.d_model].double()
        if not deltas:
            deltas.append(stream)
        deltas.append(out)
        stream = stream + out
    return reads, stream


@pytest.mark.parametrize("null", [False, True])
def test_every_read_is_the_stream_plus_the_formulas_delta_read(null):
    model = randomized(config(null_source=null), draw)
    trace = capture(model, tokens(SIZE.vocab_size, batch=2, length=10))
    reads, final = reads_float64(model, trace, null)
    for j, h in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(h), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-12, atol=1e-12)  # the plain stream
    if not null:  # the first sublayer reads the embedding itself, as in the baseline
        torch.testing.assert_close(trace.inputs[0], ref_rms_norm(trace.emb.double()), rtol=0, atol=0)


def test_the_added_reads_matter():
    cfg = config()
    model, base = randomized(cfg, draw), build_decoder(ModelConfig(SIZE, parse_registry(
        {"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}).ablation("b"))).double().eval()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("router.")})
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        assert (model(idx) - base(idx)).abs().max() > 1e-3


@pytest.mark.parametrize("null", [False, True])
def test_parameters_and_flops_are_counted(null):
    cfg = config(null_source=null)
    model = build_decoder(cfg)
    M, d = 2 * SIZE.n_layers, SIZE.d_model
    sites = M if null else M - 1
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == sites * d * (3 if null else 2)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    sources = [(j + 1 if j else 0) + int(null) for j in range(0 if null else 1, M)]
    assert added_flops(cfg) == sum(5 * d * n + d for n in sources)


def test_causal_and_decodes_with_the_kv_cache():
    model = randomized(config(null_source=True), draw).float()
    assert_causal_and_decodes_with_the_kv_cache(model)


def test_float64_gradients_of_the_router():
    model = randomized(config(GRAD, null_source=True), draw)
    idx = tokens(GRAD.vocab_size, batch=1, length=5)
    assert_router_gradcheck(model, idx)


def test_bf16_autocast_reads_in_float32():
    model = randomized(config(), draw).float()
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    assert_bf16_autocast_close(model, idx)


def test_adamw_takes_every_router_parameter():
    model = build_decoder(config(null_source=True))
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)


def test_a_bad_option_is_one_line():
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "delta_attnres", "null_source": 1}}}
    with pytest.raises(InputError, match="field 'null_source': must be true or false, got 1"):
        parse_registry(raw)


# ---- delta_mode: delta_block (sources: a block's summed outputs, recursive or true deltas) ----------------------
FIVE = dataclasses.replace(DEEPER, name="tiny-l5", n_layers=5)  # five layers: P = 1 gives b_0 .. b_4


def block_config(size=FIVE, null=False, **block) -> ModelConfig:
    return config(size, null_source=null, delta_mode="delta_block", **block)


def block_sources(emb, outputs, P, recursive):
    """b_0 .. b_{K-1} in closed form: D_k sums block k's outputs; recursive b_k = D_k + D_{k-2} + ... (+ x0)."""
    L = len(outputs) // 2
    D = [emb] + [sum(outputs[2 * (k - 1) * P: 2 * k * P]) for k in range(1, -(-L // P))]
    return [sum(D[k::-2]) if recursive else D[k] for k in range(len(D))]


def block_reads_float64(model, trace, P, recursive, null):
    """What each sublayer reads, written out: the plain stream plus the softmax over the sources it may see."""
    r, d = model.router, model.cfg.size.d_model
    outputs = [o[..., :d].double() for o in trace.outputs]
    b = block_sources(trace.emb.double(), outputs, P, recursive)
    reads = []
    for j in range(len(outputs)):
        layer = j // 2
        seen = [b[k] for k in range(len(b)) if k * P < layer + j % 2]  # a block's first MLP sees its b_k
        site = j if null else j - 1
        if null:
            seen.insert(0, r.null_sources[site].detach().double().expand_as(trace.emb))
        stream = trace.emb.double() + sum(outputs[:j], torch.zeros_like(trace.emb.double()))
        if not seen:
            reads.append(stream)
            continue
        q, g = r.queries[site].detach().double(), r.key_norm_weight[site].detach().double()
        alpha = torch.stack([(F.rms_norm(v, (d,), eps=1e-6) * g * q).sum(-1) for v in seen]).softmax(0)
        reads.append(stream + sum(a.unsqueeze(-1) * v for a, v in zip(alpha, seen, strict=True)))
    return reads, trace.emb.double() + sum(outputs)


@pytest.mark.parametrize("P, sources, null", [(2, "recursive", False), (2, "true_delta", True),
                                              (1, "recursive", True), (1, "true_delta", False)])
def test_every_read_is_the_formula_with_block_sources(P, sources, null):
    model = randomized(block_config(null=null, delta_block_layers=P, delta_block_sources=sources), draw)
    trace = capture(model, tokens(FIVE.vocab_size, batch=2, length=10))
    reads, final = block_reads_float64(model, trace, P, sources == "recursive", null)
    for j, h in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(h), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-12, atol=1e-12)  # the plain stream
    if not null:  # layer 0's attention reads the embedding; its MLP adds x0, the one source, with weight 1
        torch.testing.assert_close(trace.inputs[0], ref_rms_norm(trace.emb.double()), rtol=0, atol=0)
        one = trace.emb.double() + trace.outputs[0][..., : FIVE.d_model].double()
        torch.testing.assert_close(trace.inputs[1], ref_rms_norm(one + trace.emb.double()), rtol=1e-12, atol=1e-12)


def router_sources(sources, outputs, emb):
    """The router's sources after a pass over given sublayer outputs, in the decoder's read/write order."""
    router = build_decoder(block_config(delta_block_layers=1, delta_block_sources=sources)).router.double()
    state = router.start(emb)
    for i, out in enumerate(outputs, start=1):
        router.read(state, i - 1)
        router.write(state, i, out)
    return state.deltas


def test_the_recursive_sources_part_from_the_block_delta_at_b2():
    """b_0 = x0 and b_1 = D_1 in both; then recursive b_2 = D_2 + x0, b_3 = D_3 + D_1, b_4 = D_4 + D_2 + x0."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 3, FIVE.d_model, generator=g, dtype=torch.float64)
    outputs = [torch.randn(2, 3, FIVE.d_model, generator=g, dtype=torch.float64) for _ in range(2 * FIVE.n_layers)]
    D = [emb] + [outputs[2 * k - 2] + outputs[2 * k - 1] for k in range(1, 5)]  # one layer per block
    rec, true = router_sources("recursive", outputs, emb), router_sources("true_delta", outputs, emb)
    assert len(rec) == len(true) == 5  # blocks start at layers 0..4: the last layer's outputs are no source
    for k in range(5):
        torch.testing.assert_close(true[k], D[k], rtol=1e-12, atol=1e-12)
    for k, held in enumerate([D[0], D[1], D[2] + D[0], D[3] + D[1], D[4] + D[2] + D[0]]):
        torch.testing.assert_close(rec[k], held, rtol=1e-12, atol=1e-12)
    assert torch.equal(rec[0], true[0]) and torch.equal(rec[1], true[1])
    assert all((rec[k] - true[k]).abs().min() > 0 for k in (2, 3, 4))


@pytest.mark.parametrize("P, null", [(1, False), (2, True), (None, False)])
def test_parameters_flops_and_recorded_sources_are_counted(P, null):
    cfg = block_config(null=null, delta_block_layers=P)
    model = build_decoder(cfg)
    M, d, L = 2 * FIVE.n_layers, FIVE.d_model, FIVE.n_layers
    sites = M if null else M - 1
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == sites * d * (3 if null else 2)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        recorded = model(tokens(FIVE.vocab_size, batch=1, length=4), return_routing=True).routing
    seen = [w.shape[0] for w in recorded]  # |S_j| of every read, as the pass saw them
    block = P or 2  # null: the public code's ceil(L / 4) = 2 at five layers
    starts = -(-L // block)
    assert seen == [sum(k * block < j // 2 + j % 2 for k in range(starts)) + null for j in range(M - sites, M)]
    assert added_flops(cfg) == sum(5 * d * n + d for n in seen) + (starts - 1) * d


@pytest.mark.parametrize("sources", ["recursive", "true_delta"])
def test_block_causal_and_decodes_with_the_kv_cache(sources):
    cfg = block_config(DEEPER, null=True, delta_block_layers=1, delta_block_sources=sources)
    model = randomized(cfg, draw).float()
    assert_causal_and_decodes_with_the_kv_cache(model)


def test_block_float64_gradients_of_the_router():
    model = randomized(block_config(GRAD, null=True, delta_block_layers=1), draw)
    idx = tokens(GRAD.vocab_size, batch=1, length=5)
    assert_router_gradcheck(model, idx)


def test_block_bf16_autocast_reads_in_float32():
    model = randomized(block_config(delta_block_layers=2), draw).float()
    idx = tokens(FIVE.vocab_size, batch=2, length=10)
    assert_bf16_autocast_close(model, idx)


@pytest.mark.parametrize("sources, labels", [
    ("recursive", ["null", "x0", "B1 (L0)", "B2 (L1) + x0", "B3 (L2) + B1", "B4 (L3) + B2 + x0"]),
    ("true_delta", ["null", "x0", "B1 (L0)", "B2 (L1)", "B3 (L2)", "B4 (L3)"]),
])
def test_diagnostics_name_every_block_source(sources, labels):
    cfg = block_config(null=True, delta_block_layers=1, delta_block_sources=sources)
    axes = routing_axes.axes(cfg)
    assert axes["source_labels"] == labels and axes["embedding_column"] == 1
    with torch.no_grad():
        out = randomized(cfg, draw).float()(tokens(FIVE.vocab_size, batch=2, length=6), return_routing=True)
    table = weights_table(cfg, out.routing)
    assert table["site_labels"] == [str(j) for j in range(10)] and table["source_labels"] == labels
    assert [len(row) for row in table["sites_by_sources"]] == [1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    for w in out.routing:
        torch.testing.assert_close(w.sum(0), torch.ones_like(w[0]))
    two = block_config(delta_block_layers=2)  # blocks of two layers: b_1 holds layers 0-1
    assert routing_axes.axes(two)["source_labels"] == ["x0", "B1 (L0-1)", "B2 (L2-3) + x0"]


def test_block_adamw_takes_every_router_parameter():
    model = build_decoder(block_config(null=True))
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)


@pytest.mark.parametrize("fields, says", [
    ({"delta_mode": "block"}, "field 'delta_mode': 'block' is not one of ['delta', 'delta_block']"),
    ({"delta_block_layers": 0}, "field 'delta_block_layers': must be a positive integer or null, got 0"),
    ({"delta_block_sources": True}, "field 'delta_block_sources': True is not one of ['recursive', 'true_delta']"),
    ({"delta_mode": "delta", "delta_block_layers": 2},
     "field 'delta_block_layers': only delta_mode: delta_block reads it; set delta_mode: delta_block or drop"),
    ({"delta_mode": "delta", "delta_block_sources": "true_delta"}, "field 'delta_block_sources': only delta_mode"),
    ({"delta_block_layer": 2}, "field 'delta_block_layer': unknown field; closest: delta_block_layers"),
])
def test_bad_options_are_one_line(fields, says):
    entry = {"doc": "d", "control": None, "routing": "delta_attnres", "delta_mode": "delta_block", **fields}
    with pytest.raises(InputError, match=f"^ablations.x: {re.escape(says)}"):
        parse_registry({"sizes": {}, "ablations": {"x": entry}})


def test_a_block_size_that_does_not_fit_is_one_line():
    with pytest.raises(InputError, match=r"field 'delta_block_layers': 5 layers per block leave no block after the "
                                         r"first in 5 layers; choose 1\.\.4 \(or null\)$"):
        block_config(delta_block_layers=5)
    block_config(delta_block_layers=3)  # a shorter last block is allowed, as in the public code


def test_registry_entries_and_mlflow_params(registry):
    from lrattn_lightning.model.config import fit_to_size
    from lrattn_lightning.train.callbacks import flat_run_params

    block, true = registry.ablation("delta-attnres-block"), registry.ablation("delta-attnres-block-true")
    assert (block.options.mode, block.options.block_layers, block.options.block_sources) == (
        "delta_block", None, "recursive")
    assert true.options.block_sources == "true_delta" and true.control == "delta-attnres-block"
    assert registry.ablation("delta-attnres").options.mode == "delta"  # the delta entries keep their mode
    study = registry.model("cpu-study", "delta-attnres-block")
    assert routing_axes.axes(study)["source_labels"] == ["x0", "B1 (L0-1)", "B2 (L2-3) + x0", "B3 (L4-5) + B1"]
    cfg = tiny_config(registry, "delta-attnres-block-true")
    params = flat_run_params(cfg)
    assert params["delta_mode"] == "delta_block" and params["delta_block_sources"] == "true_delta"
    assert params["params"] == count_params(cfg) and model_config_from_dict(cfg.to_dict()) == cfg
    clipped = fit_to_size(block.replace(delta_block_layers=9), cfg.size)
    assert clipped.options.block_layers == 1  # tests' fit to the two-layer size
