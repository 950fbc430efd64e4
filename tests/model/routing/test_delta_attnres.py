"""Delta Attention Residuals (routing: delta_attnres): the formula in float64, the plain final read, accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEEPER,
    GRAD,
    assert_bf16_autocast_close,
    assert_causal_and_decodes_with_the_kv_cache,
    assert_router_gradcheck,
    capture,
    ref_rms_norm,
    tokens,
)

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import parse_registry
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER  # three layers, d = 32


def config(null_source=False, size=SIZE) -> ModelConfig:
    raw = {"sizes": {}, "ablations": {"delta": {"doc": "d", "control": None, "routing": "delta_attnres",
                                                "null_source": null_source}}}
    return ModelConfig(size, parse_registry(raw).ablation("delta"))


def randomized(cfg, seed=0):
    torch.manual_seed(seed)
    model = build_decoder(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.router.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if name == "queries" else 0.3) + (1.0 if name == "key_norm_weight" else 0))
    return model


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
    model = randomized(config(null))
    trace = capture(model, tokens(SIZE.vocab_size, batch=2, length=10))
    reads, final = reads_float64(model, trace, null)
    for j, h in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(h), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-12, atol=1e-12)  # the plain stream
    if not null:  # the first sublayer reads the embedding itself, as in the baseline
        torch.testing.assert_close(trace.inputs[0], ref_rms_norm(trace.emb.double()), rtol=0, atol=0)


def test_the_added_reads_matter():
    cfg = config()
    model, base = randomized(cfg), build_decoder(ModelConfig(SIZE, parse_registry(
        {"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}).ablation("b"))).double().eval()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("router.")})
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        assert (model(idx) - base(idx)).abs().max() > 1e-3


@pytest.mark.parametrize("null", [False, True])
def test_parameters_and_flops_are_counted(null):
    cfg = config(null)
    model = build_decoder(cfg)
    M, d = 2 * SIZE.n_layers, SIZE.d_model
    sites = M if null else M - 1
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == sites * d * (3 if null else 2)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    sources = [(j + 1 if j else 0) + int(null) for j in range(0 if null else 1, M)]
    assert added_flops(cfg) == sum(5 * d * n + d for n in sources)


def test_causal_and_decodes_with_the_kv_cache():
    model = randomized(config(True)).float()
    assert_causal_and_decodes_with_the_kv_cache(model)


def test_float64_gradients_of_the_router():
    model = randomized(config(True, size=GRAD))
    idx = tokens(GRAD.vocab_size, batch=1, length=5)
    assert_router_gradcheck(model, idx)


def test_bf16_autocast_reads_in_float32():
    model = randomized(config()).float()
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    assert_bf16_autocast_close(model, idx)


def test_adamw_takes_every_router_parameter():
    model = build_decoder(config(True))
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)


def test_a_bad_option_is_one_line():
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "delta_attnres", "null_source": 1}}}
    with pytest.raises(InputError, match="field 'null_source': must be true or false, got 1"):
        parse_registry(raw)
