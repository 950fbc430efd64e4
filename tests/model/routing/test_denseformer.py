"""DenseFormer's depth-weighted average (routing: denseformer): the formula, its identity start, its accounting."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.checks import assert_causal_and_decodes_with_the_kv_cache, capture
from helpers.models import DEEPER, kind_config, randomized, tiny_config, tokens
from helpers.references import ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import model_config_from_dict, parse_registry
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER  # three layers: dilation 2 and period 2 have something to skip


config = functools.partial(kind_config, "denseformer")


def draw(name: str, w: torch.Tensor) -> torch.Tensor:
    """Every DWA weight N(0, 0.7): reads far from the identity start."""
    return torch.empty_like(w).normal_(std=0.7)


def dwa_inputs_float64(model, trace, dilation, period):
    """The read of every sublayer from the trace's outputs, by the formula of docs/method.md §9 written out."""
    L = model.cfg.size.n_layers
    kept, stream, reads = [trace.emb.double()], trace.emb.double(), []
    for t in range(1, L + 1):
        reads.append(stream)
        stream = stream + trace.outputs[2 * t - 2][..., : SIZE.d_model].double()
        reads.append(stream)
        stream = stream + trace.outputs[2 * t - 1][..., : SIZE.d_model].double()
        kept.append(stream)
        if t % period == 0:
            w = model.router.dwa[str(t)].detach().double()
            group = [s for s in range(t + 1) if s % dilation == t % dilation]
            assert len(group) == len(w)
            stream = sum(w[n] * kept[s] for n, s in enumerate(group))
    return reads, stream


@pytest.mark.parametrize("dilation, period", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1)])
def test_every_read_is_the_weighted_average_of_the_formula(dilation, period):
    cfg = config(dilation=dilation, period=period)
    model = randomized(cfg, draw)
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    trace = capture(model, idx)
    reads, final = dwa_inputs_float64(model, trace, dilation, period)
    for j, h in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(h), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-12, atol=1e-12)


def test_identity_start_is_the_baseline_exactly(registry):
    cfg = config()
    dwa, base = build_decoder(cfg), build_decoder(ModelConfig(SIZE, registry.ablation("baseline")))
    dwa.load_state_dict({**base.state_dict(), **{f"router.{k}": v for k, v in dwa.router.state_dict().items()}})
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    with torch.no_grad():
        assert torch.equal(dwa(idx), base(idx))
        dwa.router.dwa["2"][0] = 0.3  # one weight off the identity: no longer the baseline
        assert (dwa(idx) - base(idx)).abs().max() > 1e-4


@pytest.mark.parametrize("dilation, period, expected", [(1, 1, 2 + 3 + 4), (2, 1, 1 + 2 + 2), (1, 2, 3), (2, 2, 2),
                                                         (3, 1, 1 + 1 + 2)])
def test_parameters_and_flops_are_counted(dilation, period, expected):
    cfg = config(dilation=dilation, period=period)
    model = build_decoder(cfg)
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == expected
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert added_flops(cfg) == 2 * SIZE.d_model * expected


def test_causal_and_decodes_with_the_kv_cache():
    model = randomized(config(dilation=2), draw).float()
    assert_causal_and_decodes_with_the_kv_cache(model)


def test_float64_gradients_of_the_weights():
    model = randomized(config(dilation=2), draw)
    idx = tokens(SIZE.vocab_size, batch=1, length=6)
    names = list(model.router.dwa.keys())

    def loss(*weights):
        state = {f"router.dwa.{n}": w for n, w in zip(names, weights, strict=True)}
        logits = torch.func.functional_call(model, state, (idx,))
        return logits.square().mean() + logits[..., :3].sum()

    inputs = tuple(model.router.dwa[n].detach().clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-7)


def test_adamw_takes_the_weight_vectors():
    model = build_decoder(config())
    muon, adamw = split_parameters(model)
    assert all(any(p is q for q in adamw) for p in model.router.parameters())


@pytest.mark.parametrize("fields, says", [
    ({"dilation": 0}, "field 'dilation': must be a positive integer, got 0"),
    ({"period": True}, "field 'period': must be a positive integer"),
    ({"dilaton": 2}, "field 'dilaton': unknown field; closest: dilation"),
])
def test_bad_options_are_one_line(fields, says):
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "denseformer", **fields}}}
    with pytest.raises(InputError, match=says):
        parse_registry(raw)


def test_options_belong_to_their_kind():
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "residual", "dilation": 2}}}
    with pytest.raises(InputError, match="ablations.x: field 'dilation': only routing denseformer reads it; routing is 'residual'"):
        parse_registry(raw)
    with pytest.raises(InputError, match="period=4 exceeds the 3 layers"):
        config(period=4)


def test_registry_entries_and_mlflow_params(registry):
    from lrattn_lightning.train.callbacks import flat_run_params

    cfg = tiny_config(registry, "denseformer-k2-p2")
    assert (cfg.ablation.options.dilation, cfg.ablation.options.period) == (2, 2)
    params = flat_run_params(cfg)
    assert params["routing"] == "denseformer" and params["dilation"] == 2 and params["period"] == 2
    assert params["params"] == count_params(cfg) and "options" not in params
    assert model_config_from_dict(cfg.to_dict()) == cfg  # as a checkpoint stores it
