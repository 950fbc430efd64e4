"""The gated residual and its training advice (routing_gated.py, docs/gated-residual.md), on tiny models.

Gate biases start where the registry says; the running-mean bias computes the baseline; a hold fixes
alpha at 0.5 and takes the gates out of training until the module releases them; the normalised gate
gradient is bounded and scale-free; KV-cache decoding stays exact with gates that matter; bad fields fail.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers.checks import capture
from helpers.models import DEEPER, tokens, variant

from lrattn_lightning.model.attention import KVCache
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.generate import generate
from lrattn_lightning.model.registry import load_registry, model_config_from_dict
from lrattn_lightning.model.routing.gated import NormalizedGateGrad
from lrattn_lightning.train.lit_module import LRAttnModule

GATED = ["gated-residual", "gated-alpha09", "gated-last09", "gated-running-mean"]
M = DEEPER.n_sublayers  # 6


def _model(registry, name: str, dtype=torch.float32, impl: str = "fast"):
    return build_decoder(ModelConfig(DEEPER, registry.ablation(name)), impl=impl).to(dtype)


def _alphas(model, idx) -> list[torch.Tensor]:
    """alpha_i [B, T] per sublayer, as the forward pass records it."""
    with torch.no_grad():
        return [w[0, ..., 0] for w in model(idx, return_routing=True).routing]


def _strong_gates(model, scale: float = 200.0) -> None:
    """Make the bilinear gate term O(1) and token-dependent (at init it is ~1e-4: the running means of the
    small initial activations), by scaling W_q and W_k."""
    with torch.no_grad():
        for lin in [*model.router.gate_q, *model.router.gate_k]:
            lin.weight.mul_(scale)


# ---- initial gates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("gated-residual", None),
    ("gated-alpha09", [0.9] * M),
    ("gated-last09", [0.5, 0.5, 0.5, 0.5, 0.9, 0.9]),
    ("gated-running-mean", [i / (i + 1) for i in range(1, M + 1)]),
])
def test_gates_start_at_alpha0(registry, name, expected):
    model = _model(registry, name)
    router = model.router
    assert router.gate_alpha0 == expected
    if expected is None:
        assert not hasattr(router, "gate_bias")  # the existing entry keeps its parameters
    else:
        torch.testing.assert_close(torch.sigmoid(router.gate_bias.detach()), torch.tensor(expected))
    idx = tokens(DEEPER.vocab_size, 2, 12)
    alphas = _alphas(model, idx)
    target = expected or [0.5] * M
    for alpha, a0 in zip(alphas, target, strict=True):  # the bilinear term is small at init, not zero
        assert (alpha - a0).abs().max() < 5e-3
    with torch.no_grad():  # without it alpha is alpha0 exactly
        for lin in router.gate_q:
            lin.weight.zero_()
    for alpha, a0 in zip(_alphas(model, idx), target, strict=True):
        torch.testing.assert_close(alpha, torch.full_like(alpha, a0))


def test_gate_bias_follows_the_formula_with_strong_gates(registry):
    """alpha_i = sigmoid(<W_q cummean(x), W_k cummean(F(x))> / sqrt(d) + b_i), recomputed independently."""
    model = _model(registry, "gated-last09").double()
    _strong_gates(model)
    with torch.no_grad():
        model.router.gate_bias.add_(torch.linspace(-1, 1, M, dtype=torch.float64))
    trace = capture(model, tokens(DEEPER.vocab_size, 2, 9))
    T = trace.emb.shape[1]
    counts = torch.arange(1, T + 1, dtype=torch.float64)[None, :, None]
    stream, spread = trace.emb, []
    for i, fx in enumerate(trace.outputs, start=1):
        wq, wk = model.router.gate_q[i - 1].weight.detach(), model.router.gate_k[i - 1].weight.detach()
        q, k = (stream.cumsum(1) / counts) @ wq.T, (fx.cumsum(1) / counts) @ wk.T
        g = torch.sigmoid((q * k).sum(-1, keepdim=True) / math.sqrt(DEEPER.d_model) + model.router.gate_bias[i - 1])
        torch.testing.assert_close(trace.routing[i - 1][0], g.float())
        spread.append(g.std().item())
        stream = g * stream + (1 - g) * fx
    torch.testing.assert_close(trace.final, F.rms_norm(stream, (DEEPER.d_model,)))
    assert max(spread) > 0.1  # the gates differ between tokens: the test sees the bilinear term


@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_running_mean_bias_is_the_baseline(registry, impl):
    """alpha0_i = i/(i+1): the stream after sublayer i is (o_0 + ... + o_i)/(i+1), the plain residual stream
    divided by i+1, which each parameter-free pre-norm undoes: with the bilinear term zero the logits are the
    baseline's. The one difference is RMSNorm's eps, which the (i+1)-times smaller stream feels (i+1)^2 times
    more: relative eps (i+1)^2 / mean(x^2) ~ 1e-10 in float64 at these init scales (~1e-3 in float32)."""
    base = _model(registry, "baseline", torch.float64, impl)
    gated = _model(registry, "gated-running-mean", torch.float64, impl)
    gated.load_state_dict({**gated.state_dict(), **base.state_dict()})  # the same embedding, layers, head
    gated.router.reset_parameters()  # b_i = log(i) in float64 (built in float32, it was rounded to float32)
    with torch.no_grad():
        for lin in gated.router.gate_q:
            lin.weight.zero_()
    idx = tokens(DEEPER.vocab_size, 2, 12)
    b, g = capture(base, idx), capture(gated, idx)
    torch.testing.assert_close(g.logits, b.logits, atol=1e-9, rtol=0)
    for j, (x_b, x_g) in enumerate(zip(b.inputs, g.inputs, strict=True)):  # every sublayer sees the same input
        torch.testing.assert_close(x_g, x_b, atol=1e-9, rtol=0, msg=f"input of sublayer {j + 1}")
    # a wrong alpha0 is far from it: the constant 0.9 start is not the baseline
    other = _model(registry, "gated-alpha09", torch.float64, impl)
    other.load_state_dict({**other.state_dict(), **base.state_dict()})
    with torch.no_grad():
        assert (other(idx) - b.logits).abs().max() > 1e-3
    # and at the real initialisation (orthogonal W_q, W_k) it is the baseline up to the small bilinear term
    fresh = _model(registry, "gated-running-mean", torch.float64, impl)
    fresh.load_state_dict({**fresh.state_dict(), **base.state_dict()})
    with torch.no_grad():
        diff = (fresh(idx) - base(idx)).abs().max().item()
    assert diff < 1e-3 * base(idx).abs().max().item()


# ---- holding the gates -----------------------------------------------------------------------------


def test_a_hold_fixes_alpha_at_half_and_takes_the_gates_out_of_training(registry):
    model = _model(registry, "gated-alpha09")
    _strong_gates(model)
    idx, targets = tokens(DEEPER.vocab_size, 2, 10), tokens(DEEPER.vocab_size, 2, 10, seed=3)
    model.router.set_gate_hold(True)
    assert all(torch.equal(a, torch.full_like(a, 0.5)) for a in _alphas(model, idx))
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    gate_params = {n: p for n, p in model.named_parameters() if n.startswith("router.gate")}
    assert gate_params and all(p.grad is None for p in gate_params.values())
    assert model.embed.weight.grad is not None
    model.router.set_gate_hold(False)
    alphas = _alphas(model, idx)
    assert all(abs(a.mean().item() - 0.5) > 0.05 for a in alphas)  # the gates compute alpha again
    model.zero_grad()
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate_params.values())


def test_the_hold_travels_in_the_state_dict_and_old_checkpoints_load(registry):
    model = _model(registry, "gated-residual")
    model.router.set_gate_hold(True)
    state = model.state_dict()
    assert bool(state["router.gate_hold"])
    fresh = _model(registry, "gated-residual", impl="reference")
    assert not fresh.router.gates_held
    fresh.load_state_dict(state)
    assert fresh.router.gates_held
    idx = tokens(DEEPER.vocab_size, 1, 6)
    assert all(torch.equal(a, torch.full_like(a, 0.5)) for a in _alphas(fresh, idx))
    old = {k: v for k, v in state.items() if k != "router.gate_hold"}  # written before holds existed
    fresh.load_state_dict(old)
    assert not fresh.router.gates_held


# ---- the normalised gate gradient ------------------------------------------------------------------


def test_normalised_gate_gradient_is_bounded():
    for scale in (1e-8, 1e-3, 1.0, 1e6):
        x = torch.rand(3, 7, 1, requires_grad=True)
        upstream = torch.randn(3, 7, 1) * scale
        NormalizedGateGrad.apply(x).backward(upstream)
        grad = x.grad
        assert grad.abs().max() <= 1.0 and torch.linalg.vector_norm(grad) <= 1.0 + 1e-6
        torch.testing.assert_close(grad, (upstream / (upstream.norm() + 1e-6)).clamp(-1, 1))
        if scale >= 1e-3:  # well above the 1e-6 guard the direction keeps unit norm
            assert torch.linalg.vector_norm(grad).item() == pytest.approx(1.0, abs=1e-3)


def test_normalised_gate_gradient_makes_the_last_gate_blind_to_the_loss_scale(registry):
    """Normalisation divides out the loss scale: the last sublayer's gate (whose alpha gradient comes only
    from the loss) gets the same gradient for L and 100 L; without it every gate gradient scales by 100.
    Earlier gates also receive gradient through the later (normalised) gates, so theirs is not scale-free."""
    idx, targets = tokens(DEEPER.vocab_size, 2, 10), tokens(DEEPER.vocab_size, 2, 10, seed=3)

    def gate_grads(normalize: bool, loss_scale: float) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = _model(registry, "gated-alpha09", torch.float64)
        _strong_gates(model)
        model.router.gate_grad_normalize = normalize
        (loss_scale * F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith(("router.gate_q", "router.gate_k"))}
        grads["bias"] = model.router.gate_bias.grad.clone()
        return grads

    last = (f"router.gate_q.{M - 1}.weight", f"router.gate_k.{M - 1}.weight")
    one, hundred = gate_grads(True, 1.0), gate_grads(True, 100.0)
    for name in last:  # up to the 1e-6 guard, relative 1e-6 / ||G|| (||G|| ~ 1e-3 here)
        torch.testing.assert_close(hundred[name], one[name], rtol=2e-3, atol=0)
    torch.testing.assert_close(hundred["bias"][-1], one["bias"][-1], rtol=2e-3, atol=0)
    assert not torch.allclose(hundred["bias"][0], one["bias"][0], rtol=1e-3)
    raw_one, raw_hundred = gate_grads(False, 1.0), gate_grads(False, 100.0)
    for name in raw_one:
        torch.testing.assert_close(raw_hundred[name], 100 * raw_one[name])
    # the raw alpha gradient is small, so normalising it scales the gate gradients up by orders of magnitude
    assert one["bias"][-1].abs() > 10 * raw_one["bias"][-1].abs()


# ---- KV-cache decoding with gates that matter --------------------------------------------------------


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("impl", ["fast", "reference"])
def test_kv_cache_is_exact_with_strong_gates(registry, name, impl, held):
    model = _model(registry, name, impl=impl).eval()
    _strong_gates(model)
    model.router.set_gate_hold(held)
    idx = tokens(DEEPER.vocab_size, batch=2, length=14)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.empty(len(model.layers))
        parts = [model(idx[:, a:b], cache=cache) for a, b in ((0, 6), (6, 10), (10, 11), (11, 14))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)
    prompt = idx[:, :4]
    assert torch.equal(generate(model, prompt, 10, use_cache=True), generate(model, prompt, 10, use_cache=False))


# ---- the training-time controls in the LightningModule ----------------------------------------------


class _Recorder(L.Callback):
    """Per optimiser step: whether the gates were held and the gate parameters after the step."""

    def __init__(self):
        self.held, self.bias, self.wq = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        router = module.model.router
        self.held.append(router.gates_held)
        self.bias.append(router.gate_bias.detach().clone() if hasattr(router, "gate_bias") else None)
        self.wq.append(router.gate_q[0].weight.detach().clone())


def _train(ablation: str, steps: int, **flags) -> tuple[LRAttnModule, _Recorder]:
    torch.manual_seed(0)
    module = LRAttnModule.from_names(size="tiny", ablation=ablation, optimizer="muon_adamw", lr=3e-3, muon_lr=1e-2,
                          muon_variant="torch", warmup_steps=1, routing_diagnostics=False, **flags)
    data = torch.utils.data.DataLoader(torch.randint(0, 256, (steps * 2, 17)), batch_size=2)
    recorder = _Recorder()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder])
    router = module.model.router
    init = (router.gate_bias.detach().clone() if hasattr(router, "gate_bias") else None,
            router.gate_q[0].weight.detach().clone())
    trainer.fit(module, train_dataloaders=data)
    recorder.init = init
    return module, recorder


def test_freeze_steps_hold_alpha_then_release(registry):
    module, rec = _train("gated-alpha09", 6, gate_freeze_steps=3)
    assert rec.held == [True, True, True, False, False, False]
    bias0, wq0 = rec.init
    for step in range(3):  # held: the gate parameters do not move (no gradient, so no decay either)
        assert torch.equal(rec.bias[step], bias0) and torch.equal(rec.wq[step], wq0)
    assert not torch.equal(rec.bias[3], bias0) and not torch.equal(rec.wq[3], wq0)  # released: they train
    assert not module.model.router.gates_held and not bool(module.model.router.gate_hold)
    idx = tokens(256, 1, 8)
    assert any(abs(a.mean().item() - 0.5) > 0.1 for a in _alphas(module.model, idx))  # alpha0 = 0.9 again


def test_release_loss_holds_until_the_loss_is_reached():
    _, never = _train("gated-residual", 4, gate_release_loss=1e-3)  # a byte model at init: ~5.5 nats
    assert never.held == [True] * 4
    _, soon = _train("gated-residual", 4, gate_release_loss=50.0)
    assert soon.held == [True, False, False, False]  # step 0's loss allows the release from step 1 on
    _, both = _train("gated-residual", 5, gate_freeze_steps=2, gate_release_loss=50.0)
    assert both.held == [True, True, False, False, False]


def test_no_schedule_means_no_hold():
    module, rec = _train("gated-running-mean", 2, gate_grad_normalize=True)
    assert rec.held == [False, False] and module.model.router.gate_grad_normalize


# ---- bad configuration names the field ---------------------------------------------------------------


@pytest.mark.parametrize("base, changes, field", [
    ("baseline", {"gate_bias": "constant", "gate_alpha": 0.9}, "gate_bias"),
    ("attnres-full", {"gate_alpha": 0.9}, "gate_alpha"),
    ("gated-residual", {"gate_bias": "constant"}, "gate_alpha"),
    ("gated-residual", {"gate_bias": "last_layer", "gate_alpha": 1.0}, "gate_alpha"),
    ("gated-residual", {"gate_bias": "constant", "gate_alpha": 0.0}, "gate_alpha"),
    ("gated-residual", {"gate_bias": "constant", "gate_alpha": True}, "gate_alpha"),
    ("gated-residual", {"gate_bias": "running_mean", "gate_alpha": 0.9}, "gate_alpha"),
    ("gated-residual", {"gate_alpha": 0.9}, "gate_alpha"),
    ("gated-residual", {"gate_bias": "linear"}, "gate_bias"),
])
def test_bad_gate_fields_name_the_field(registry, base, changes, field):
    with pytest.raises(ValueError, match=f"field '{field}'") as err:
        variant(registry.ablation(base), **changes)
    assert "\n" not in str(err.value)


def test_gate_fields_are_registry_fields(tmp_path):
    text = (
        "sizes: {s: {doc: d, n_layers: 1, d_model: 8, n_heads: 2, d_mlp: 8, vocab_size: 16, seq_len: 8}}\n"
        "ablations:\n"
        "  g: {doc: d, control: null, routing: gated, gate_bias: constant, gate_alpha: 1.5}\n"
    )
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ValueError, match=r"ablations\.g: field 'gate_alpha'"):
        load_registry(tmp_path / "r.yaml")


@pytest.mark.parametrize("ablation, flags, field", [
    ("baseline", {"gate_freeze_steps": 10}, "gate_freeze_steps"),
    ("attnres-block-n4", {"gate_grad_normalize": True}, "gate_grad_normalize"),
    ("attnres-full", {"gate_release_loss": 2.0}, "gate_release_loss"),
    ("gated-residual", {"gate_freeze_steps": -1}, "gate_freeze_steps"),
    ("gated-residual", {"gate_freeze_steps": 2.5}, "gate_freeze_steps"),
    ("gated-residual", {"gate_release_loss": 0.0}, "gate_release_loss"),
    ("gated-residual", {"gate_release_loss": float("nan")}, "gate_release_loss"),
])
def test_bad_gate_flags_name_the_flag(ablation, flags, field):
    with pytest.raises(ValueError, match=f"^model.{field}:") as err:
        LRAttnModule.from_names(size="tiny", ablation=ablation, **flags)
    assert "\n" not in str(err.value)


def test_checkpoints_from_before_the_gate_fields_still_match(registry):
    """A stored model_config without gate_bias / gate_alpha is the same architecture (the defaults)."""
    from lrattn_lightning.train.checkpoint.compat import architecture_differences

    cfg = registry.model("tiny", "gated-residual")
    stored = cfg.to_dict()
    for key in ("gate_bias", "gate_alpha"):
        del stored["ablation"][key]
    assert architecture_differences(stored, cfg) == []
    other = registry.model("tiny", "gated-alpha09")
    assert any("gate_bias" in d for d in architecture_differences(stored, other))
    assert model_config_from_dict(stored).ablation == cfg.ablation
