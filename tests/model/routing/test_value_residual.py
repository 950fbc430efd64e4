"""Value residual learning (routing: value_residual): the attention's values mixed with layer 1's, in float64
against the attention written out, lambda = 0 as the baseline, accounting, decoding, gradients, diagnostics."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.checks import assert_bf16_autocast_close, assert_causal_and_decodes_with_the_kv_cache
from helpers.models import DEEPER, kind_config, tokens
from helpers.references import ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import parse_registry
from lrattn_lightning.model.rope import apply_rope, rope_angles
from lrattn_lightning.train import routing_axes
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER  # three layers, d = 32, 4 heads


config = functools.partial(kind_config, "value_residual")


def model_of(cfg, seed=0):
    """The float64 model of `cfg` in eval mode; learned lambdas set to fixed values off the fixed 0.5, the same in
    every test."""
    torch.manual_seed(seed)
    model = build_decoder(cfg).double().eval()
    if cfg.ablation.routing == "value_residual" and cfg.options.value_lambda_learned:
        with torch.no_grad():
            model.router.lambdas.copy_(torch.tensor([0.8, -0.3], dtype=torch.float64))  # any values: not the fixed 0.5
    return model


def logits_float64(model, idx, lambdas):
    """The decoder written out with the attention by hand: V_n <- lambda_n V_1 + (1 - lambda_n) V_n."""
    B, T = idx.shape
    d, H = SIZE.d_model, SIZE.n_heads
    hd = d // H
    cos, sin = rope_angles(torch.arange(T), hd, SIZE.rope_theta)
    h, first = model.embed(idx), None
    for n, layer in enumerate(model.layers):
        x = ref_rms_norm(h)
        wq, wk, wv = layer.attn.qkv.weight.chunk(3)
        q = apply_rope(ref_rms_norm((x @ wq.T).view(B, T, H, hd)), cos, sin)
        k = apply_rope(ref_rms_norm((x @ wk.T).view(B, T, H, hd)), cos, sin)
        v = (x @ wv.T).view(B, T, H, hd)
        if n == 0:
            first = v
        else:
            v = lambdas[n - 1] * first + (1 - lambdas[n - 1]) * v
        scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        h = h + layer.attn.proj(torch.einsum("bhts,bshe->bthe", scores.softmax(-1), v).reshape(B, T, d))
        h = h + layer.mlp(ref_rms_norm(h))
    return model.head(ref_rms_norm(h))


@pytest.mark.parametrize("learned", [False, True])
def test_logits_are_the_formulas(learned):
    model = model_of(config(value_lambda=0.5, value_lambda_learned=learned))
    lambdas = [0.8, -0.3] if learned else [0.5, 0.5]
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), logits_float64(model, idx, lambdas), rtol=1e-10, atol=1e-10)


def test_lambda_zero_is_the_baseline_exactly_and_one_half_is_not():
    raw = {"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}
    base = model_of(ModelConfig(SIZE, parse_registry(raw).ablation("b")))
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        for lam, same in ((0, True), (0.5, False)):
            model = model_of(config(value_lambda=lam))
            model.load_state_dict(base.state_dict())
            assert torch.equal(model(idx), base(idx)) is same


@pytest.mark.parametrize("learned", [False, True])
def test_parameters_and_flops_are_counted(learned):
    cfg = config(value_lambda_learned=learned)
    model = build_decoder(cfg)
    L, d = SIZE.n_layers, SIZE.d_model
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == (L - 1 if learned else 0)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert added_flops(cfg) == (L - 1) * 3 * d


@pytest.mark.parametrize("learned", [False, True])
def test_causal_and_decodes_with_the_kv_cache(learned):
    """The cache holds the mixed values; a new token's V_1 comes from the same pass."""
    assert_causal_and_decodes_with_the_kv_cache(model_of(config(value_lambda_learned=learned)).float())


def test_float64_gradients_of_the_lambdas():
    model = model_of(config(value_lambda_learned=True))
    idx = tokens(SIZE.vocab_size, batch=1, length=5)

    def loss(lambdas):
        logits = torch.func.functional_call(model, {"router.lambdas": lambdas}, (idx,))
        return logits.square().mean() + logits[..., :3].sum()

    assert torch.autograd.gradcheck(loss, (model.router.lambdas.detach().clone().requires_grad_(),), eps=1e-6,
                                    atol=1e-6)


def test_bf16_autocast_is_close_to_float32():
    model = model_of(config(value_lambda_learned=True)).float()
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    assert_bf16_autocast_close(model, idx)


def test_recorded_weights_are_the_lambdas():
    cfg = config(value_lambda_learned=True)
    model = model_of(cfg).float()
    with torch.no_grad():
        out = model(tokens(SIZE.vocab_size, batch=2, length=8), return_routing=True)
    assert len(out.routing) == len(routing_axes.axes(cfg)["site_labels"]) == SIZE.n_layers - 1
    torch.testing.assert_close(torch.stack([w.flatten() for w in out.routing]),
                               torch.tensor([[0.8, 0.2], [-0.3, 1.3]]))


def test_adamw_takes_the_lambdas():
    model = build_decoder(config(value_lambda_learned=True))
    muon, _ = split_parameters(model)
    assert not any(p is model.router.lambdas for p in muon)


@pytest.mark.parametrize("field, value, says", [
    ("value_lambda", 1.5, "field 'value_lambda': must be a number in [0, 1]"),
    ("value_lambda", "half", "field 'value_lambda': must be a number in [0, 1]"),
    ("value_lambda_learned", 1, "field 'value_lambda_learned': must be true or false, got 1"),
])
def test_a_bad_option_is_one_line(field, value, says):
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "value_residual", field: value}}}
    with pytest.raises(InputError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_registry(raw)
