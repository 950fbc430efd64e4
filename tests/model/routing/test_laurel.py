"""LAuReL (routing: laurel): the formula in float64 with random parameters, the baseline at the factory's start,
accounting, decoding, gradients, bf16, diagnostics, the optimiser split and bad options."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.checks import assert_causal_and_decodes_with_the_kv_cache, assert_router_gradcheck, capture
from helpers.models import DEEPER, kind_config, randomized, tokens
from helpers.references import ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, count_params, routing_params
from lrattn_lightning.model.config import ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import parse_registry
from lrattn_lightning.train import routing_axes
from lrattn_lightning.train.diagnostics import weights_table
from lrattn_lightning.train.optim import split_parameters

SIZE = DEEPER  # 3 layers, d = 32
MODES = ["rw", "lr", "rw_lr"]
BASELINE = parse_registry({"sizes": {}, "ablations": {"b": {"doc": "b", "control": None}}}).ablation("b")


def ablation(**options):
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "laurel", **options}}}
    return parse_registry(raw).ablation("x")


config = functools.partial(kind_config, "laurel")


def mode_config(mode: str, rank: int) -> ModelConfig:
    """Mode `mode` with rank `rank` where the mode has the low-rank term (rw takes no rank)."""
    return config(laurel_mode=mode) if mode == "rw" else config(laurel_mode=mode, laurel_rank=rank)


def draw(name: str, p: torch.Tensor) -> torch.Tensor:
    """Every router parameter off its start: w ~ N(0, 1), A and B ~ N(0, 0.3) (x A B about the stream's size)."""
    return torch.empty_like(p).normal_(std=1.0 if name == "mix_logits" else 0.3)


def streams_float64(model, trace, mode):
    """The stream before every sublayer and the head's, by docs/method.md's formula, written out from the trace."""
    r = model.router
    x, reads = trace.emb.double(), []
    for i, f in enumerate(trace.outputs):
        reads.append(x)
        f = f[..., : SIZE.d_model].double()
        if "lr" in mode:
            A, B = r.down[i].detach().double(), r.up[i].detach().double()
            augment = torch.einsum("btd,dk,ke->bte", x, A, B)
        else:
            augment = torch.zeros_like(x)
        if "rw" in mode:
            w = r.mix_logits[i].detach().double()
            a, b = 2 * w.exp() / w.exp().sum()
        else:
            a = b = 1.0
        x = a * f + b * (x + augment)
    return reads, x


@pytest.mark.parametrize("mode", MODES)
def test_every_stream_is_the_formula_with_random_parameters(mode):
    model = randomized(mode_config(mode, 5), draw, seed=1, float64=False).double()
    trace = capture(model, tokens(SIZE.vocab_size, batch=2, length=9))
    reads, final = streams_float64(model, trace, mode)
    assert len(reads) == len(trace.inputs) == 2 * SIZE.n_layers
    for j, x in enumerate(reads):
        torch.testing.assert_close(trace.inputs[j], ref_rms_norm(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trace.final, ref_rms_norm(final), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_the_factory_start_is_the_baseline_exactly(mode):
    cfg = config(laurel_mode=mode)
    torch.manual_seed(0)
    model, base = build_decoder(cfg).eval(), build_decoder(ModelConfig(SIZE, BASELINE)).eval()
    r, d = model.router, SIZE.d_model
    if "lr" in mode:  # A column orthogonal: A[j, j mod r] = 1/sqrt(r d); B = 0
        rank = cfg.ablation.options.rank
        expected = torch.zeros(d, rank)
        expected[torch.arange(d), torch.arange(d) % rank] = 1 / math.sqrt(rank * d)
        assert all(torch.equal(A, expected) for A in r.down) and not r.up.any()
    if "rw" in mode:
        assert not r.mix_logits.any()
    model.load_state_dict({**base.state_dict(), **{f"router.{k}": v for k, v in r.state_dict().items()}})
    model, base = model.double(), base.double()
    idx = tokens(SIZE.vocab_size, batch=2, length=12)
    with torch.no_grad():
        assert torch.equal(model(idx), base(idx))
        (r.mix_logits if "rw" in mode else r.up)[2, 0].add_(0.3)  # one sublayer off its start: no longer the baseline
        assert (model(idx) - base(idx)).abs().max() > 1e-4


@pytest.mark.parametrize("mode, rank", [("rw", 16), ("lr", 16), ("rw_lr", 16), ("rw_lr", 7)])
def test_parameters_and_flops_are_counted(mode, rank):
    cfg = mode_config(mode, rank)
    model = build_decoder(cfg)
    d, M = SIZE.d_model, 2 * SIZE.n_layers
    per = {"rw": 2, "lr": 2 * d * rank, "rw_lr": 2 + 2 * d * rank}[mode]
    assert sum(p.numel() for p in model.router.parameters()) == routing_params(cfg) == M * per
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    # per sublayer: x A and (x A) B 2 d r each, x + x A B d, a f + b s 3 d, less the baseline's own x + f
    flops = {"rw": 2 * d, "lr": 4 * d * rank + d, "rw_lr": 4 * d * rank + 3 * d}[mode]
    assert added_flops(cfg) == M * flops


@pytest.mark.parametrize("mode", ["rw", "rw_lr"])
def test_causal_and_decodes_with_the_kv_cache(mode):
    assert_causal_and_decodes_with_the_kv_cache(randomized(config(laurel_mode=mode), draw, seed=1, float64=False))


def test_float64_gradients_of_the_router():
    small = SizeConfig(name="grad", doc="tests: gradcheck", n_layers=2, d_model=8, n_heads=2, d_mlp=16,
                       vocab_size=31, seq_len=8)  # 4 x (2 + 2 d r) = 136 parameters, each checked
    model = randomized(config(small, laurel_rank=2), draw, seed=1, float64=False).double()
    idx = tokens(small.vocab_size, batch=1, length=4)
    assert_router_gradcheck(model, idx)


def test_bf16_autocast_is_close_to_float32():
    model = randomized(config(), draw, seed=1, float64=False)
    idx = tokens(SIZE.vocab_size, batch=2, length=10)
    with torch.no_grad():
        exact = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(idx).float()
    assert (low - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("mode", MODES)
def test_a_recording_pass_keeps_the_mixing_per_sublayer(mode):
    cfg = config(laurel_mode=mode)
    model = randomized(cfg, draw, seed=1, float64=False)
    idx = tokens(SIZE.vocab_size, batch=2, length=8)
    with torch.no_grad():
        out = model(idx, return_routing=True)
    trace = capture(model, idx)
    reads, _ = streams_float64(model.double(), trace, mode)  # (the router's values: float32 copies)
    table = weights_table(cfg, out.routing)
    axes = routing_axes.axes(cfg)
    assert routing_axes.recorded(cfg) == "mixing" and table["site_labels"][:2] == ["1 attn", "2 mlp"]
    assert len(out.routing) == len(axes["site_labels"]) == 2 * SIZE.n_layers
    for i, (w, x) in enumerate(zip(out.routing, reads, strict=True)):
        expected = []
        if "rw" in mode:
            expected += (2 * model.router.mix_logits[i].softmax(0)).tolist()
        if "lr" in mode:
            augment = x @ model.router.down[i] @ model.router.up[i]
            expected.append((augment.norm(dim=-1) / x.norm(dim=-1)).mean().item())
        assert w.dtype == torch.float32 and w.shape[0] == len(axes["source_labels"]) == len(expected)
        assert w.shape[1:] in ((2, 8, 1), (1, 1, 1))
        torch.testing.assert_close(torch.tensor(table["sites_by_sources"][i], dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_adamw_takes_every_router_parameter():
    model = build_decoder(config())
    muon, adamw = split_parameters(model)
    assert {id(p) for p in model.router.parameters()} <= {id(p) for p in adamw}
    assert not any(p is q for p in model.router.parameters() for q in muon)
    assert any(p is model.layers[0].attn.proj.weight for p in muon)  # the core's matrices stay with Muon


@pytest.mark.parametrize("fields, says", [
    ({"laurel_mode": "both"}, "field 'laurel_mode': 'both' is not one of \\['rw', 'lr', 'rw_lr'\\]"),
    ({"laurel_rank": 0}, "field 'laurel_rank': must be a positive integer, got 0"),
    ({"laurel_mode": "rw", "laurel_rank": 4}, "field 'laurel_rank': laurel_mode rw has no low-rank term"),
    ({"laurel_ranks": 4}, "field 'laurel_ranks': unknown field; closest: laurel_rank"),
])
def test_bad_options_are_one_line(fields, says):
    with pytest.raises(InputError, match=says):
        ablation(**fields)


def test_a_rank_above_d_model_is_one_line_and_fits_a_tiny_size():
    with pytest.raises(InputError, match="field 'laurel_rank': laurel_rank=40 exceeds d_model=32; choose laurel_rank <= 32"):
        config(laurel_rank=40)
    fitted = fit_to_size(ablation(laurel_rank=40), SIZE)
    assert fitted.options.rank == SIZE.d_model
    assert ModelConfig(SIZE, fitted).kind.routing_params(ModelConfig(SIZE, fitted)) > 0
