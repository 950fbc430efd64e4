"""The optimiser: parity with the paper's Muon (golden numbers), with torch.optim.Muon and AdamW, the
Polar Express band, the parameter split, the schedule, and resuming across every schedule phase."""

from __future__ import annotations

import io
import signal

import numpy as np
import pytest
import torch
from helpers.models import tiny_config
from helpers.references import BF16_BOUND, muon_golden, polar_express_float64, rel_err
from helpers.runs import REGISTRY, losses_by_step, run_cli, run_process, slr_fit_args, the_run

from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.train.lit_module import LRAttnModule
from lrattn_lightning.train.muon import ORTHOGONALIZERS, POLAR_EXPRESS_COEFFS, newton_schulz, polar_express
from lrattn_lightning.train.optim import MUON_VARIANTS, MuonWithAuxAdamW, build_optimizer, split_parameters
from lrattn_lightning.train.schedule import MomentumSchedule, WarmupStableDecay

GOLDEN = muon_golden()


# ---- the reference variant against the paper's code -------------------------------------------------
# Which bound holds where. Polar Express rounds to bfloat16 between its iterations; its float32 matmuls
# round differently on different CPUs (kernel blocking, AVX-512/AMX paths), so an element near a bfloat16
# rounding boundary flips by one bfloat16 step (2^-8 relative) on one machine and not on another. Computing
# the same matmuls in float64 and rounding to float32 (a legitimate "other CPU") moves one Polar Express
# output by 5.5e-3 of its largest element, and a whole 8-step Muon run by up to 25 % of the weights' change
# (the cautious weight decay's sign mask and the second moment amplify single flips). So:
#   - the optimiser against the reference: the golden run whose Polar Express ran in float64 (every other
#     ingredient the reference's own code), strict to 1e-5 on every CPU;
#   - the bfloat16 Polar Express against the reference's output: at bfloat16 tolerance (BF16_BOUND);
#   - the bfloat16 Polar Express bit for bit against the same operation sequence run here (same machine,
#     same kernels, so no rounding can differ).
# (BF16_BOUND and the float64 Polar Express are helpers/references.py's.)


@pytest.fixture
def float64_polar_express(monkeypatch):
    monkeypatch.setitem(ORTHOGONALIZERS, "polar_express", polar_express_float64)


def run_golden_scenario(**change):
    """Our optimiser and schedule on the golden scenario; yields (step, params, group) after each step. Its
    orthogonaliser runs in bfloat16, the reference's rounding, on every machine (`auto` may pick float32)."""
    c = GOLDEN["config"]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in GOLDEN["init"].items()}
    opt = MuonWithAuxAdamW([{"params": list(params.values()), "use_muon": True, "lr": c["lr"],
                             "weight_decay": c["weight_decay"], "momentum": c["momentum_max"],
                             "orthogonalizer_dtype": "bfloat16", **{**MUON_VARIANTS["reference"], **change}}])
    steps = c["total_steps"]
    momentum = MomentumSchedule(peak=c["momentum_max"], low=c["momentum_min"],
                                warmup_steps=c["momentum_warmup_steps"], cooldown_steps=c["momentum_cooldown_steps"])
    schedule = WarmupStableDecay(opt, steps, c["warmup_steps"], c["warmdown_steps"] / steps, 0.1, momentum)
    for step in range(steps):
        group = dict(opt.param_groups[0])
        for k, p in params.items():
            p.grad = GOLDEN["grads"][k][step].clone()
        opt.step()
        schedule.step()
        yield step, params, group


def test_reference_variant_matches_the_papers_muon_at_every_step(float64_polar_express):
    golden = GOLDEN["params_float64_polar_express"]
    for step, params, group in run_golden_scenario():
        assert group["lr"] == pytest.approx(GOLDEN["lr"][step], rel=1e-12), step
        assert group["momentum"] == pytest.approx(GOLDEN["momentum"][step], rel=1e-12), step
        for k, p in params.items():  # compare the change from init: the weights themselves hide small errors
            err = rel_err(p.detach() - GOLDEN["init"][k], golden[k][step] - GOLDEN["init"][k])
            assert err <= 1e-5, (step, k, err)
    # the scenario crosses warmup, stable and decay of the LR and both momentum ramps
    assert len(set(GOLDEN["lr"])) >= 4 and min(GOLDEN["momentum"]) < max(GOLDEN["momentum"]) == 0.95
    assert GOLDEN["momentum"][-1] < 0.95


def test_reference_variant_first_step_matches_the_papers_bfloat16_muon():
    """One step of the real (bfloat16) update against the reference's: one orthogonalisation, so the
    bfloat16 bound applies; later steps compound flipped roundings through the sign mask (see above)."""
    _, params, _ = next(run_golden_scenario())
    for k, p in params.items():
        err = rel_err(p.detach() - GOLDEN["init"][k], GOLDEN["params"][k][0] - GOLDEN["init"][k])
        assert err <= BF16_BOUND, (k, err)


@pytest.mark.parametrize("change", [{"cautious": False}, {"variance_beta2": None},
                                    {"orthogonalizer": "newton_schulz"}, {"scale": "match_rms_adamw"}])
def test_golden_scenario_tells_each_ingredient_apart(change, float64_polar_express):
    """Switching off any one ingredient of the reference update moves the result far outside tolerance."""
    *_, (step, params, _) = run_golden_scenario(**change)
    golden = GOLDEN["params_float64_polar_express"]
    errs = [rel_err(p.detach() - GOLDEN["init"][k], golden[k][step] - GOLDEN["init"][k]) for k, p in params.items()]
    assert max(errs) > 1e-2, errs


def polar_express_same_sequence(g: torch.Tensor) -> torch.Tensor:
    """The reference's PyTorch Polar Express as a sequence of operations (bfloat16 between iterations,
    float32 inside them), written from its description: on one machine it must agree with ours bit for bit."""
    tall = g.size(-2) > g.size(-1)
    x = g.bfloat16().mT if tall else g.bfloat16()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in GOLDEN["polar_express_coefficients"]:
        x32 = x.float()
        gram = x32 @ x32.mT
        x = (a * x32 + (b * gram + c * (gram @ gram)) @ x32).bfloat16()
    return x.mT if tall else x


def test_polar_express_matches_the_reference():
    assert [list(c) for c in POLAR_EXPRESS_COEFFS] == GOLDEN["polar_express_coefficients"]
    for g, ref in zip(GOLDEN["polar_express_in"], GOLDEN["polar_express_out"], strict=True):
        out = polar_express(g)
        assert out.dtype == torch.bfloat16 and out.shape == g.shape
        assert torch.equal(out, polar_express_same_sequence(g))  # same machine: bit for bit
        assert rel_err(out, ref) <= BF16_BOUND  # the reference's CPU: bfloat16 tolerance
        # and the bfloat16 result is the float64 iteration's up to the rounding of five iterations
        # (measured 0.6-2.5 % on these inputs: each iteration's bf16 error is carried into the next)
        assert rel_err(out, polar_express_float64(g)) <= 5e-2


def _minimax_odd_quintic(lo: float, hi: float) -> np.ndarray:
    """(a, b, c) of p(x) = a x + b x^3 + c x^5 minimising max |1 - p| on [lo, hi] (Remez exchange): the error
    equioscillates, 1 - p = +E, -E, +E, -E at lo < x1 < x2 < hi, where x1, x2 are the roots of p'."""
    x1, x2 = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    for _ in range(100):
        pts = np.array([lo, x1, x2, hi])
        system = np.stack([pts, pts**3, pts**5, [1.0, -1.0, 1.0, -1.0]], axis=1)  # p(x_i) + (+-E) = 1
        a, b, c, _ = np.linalg.solve(system, np.ones(4))
        # p'(x) = a + 3b x^2 + 5c x^4 = 0, a quadratic in x^2
        x1, x2 = np.sqrt(np.sort(np.roots([5 * c, 3 * b, a]).real))
    return np.array([a, b, c])


def polar_express_table(lo: float = 1e-3, steps: int = 5, cushion: float = 0.02, safety: float = 1.02):
    """The Polar Express composition (arXiv:2505.16932, Alg. 1): each quintic is the minimax one on the
    interval [lo, hi] the previous ones left (lo floored at cushion * hi and the polynomial then rescaled so
    p(lo) and p(hi) sit symmetrically about 1), evaluated at x / safety except the last."""
    hi, table = 1.0, []
    for k in range(steps):
        coef = _minimax_odd_quintic(max(lo, cushion * hi), hi)
        p = lambda x, c=coef: c[0] * x + c[1] * x**3 + c[2] * x**5  # noqa: E731
        if cushion * hi > lo:
            coef = coef * 2 / (p(lo) + p(hi))
        if k < steps - 1:
            coef = coef / np.array([safety, safety**3, safety**5])
        table.append(coef)
        lo = coef[0] * lo + coef[1] * lo**3 + coef[2] * lo**5
        hi = 2 - lo
    return np.array(table), lo


def test_polar_express_table_is_the_papers_composition():
    table, _ = polar_express_table()
    np.testing.assert_allclose(table, np.array(POLAR_EXPRESS_COEFFS), rtol=1e-9)


def test_polar_express_singular_values_land_in_the_band():
    """Inputs whose singular values (over 1.02 ||G||_F) lie in [1e-3, 1] come out in [l5, 2 - l5]."""
    _, lo = polar_express_table()
    assert 0.85 < lo < 0.87
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(s, generator=gen) for s in [(8, 16), (16, 8), (32, 32), (96, 40), (40, 96)]]
    q1, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    q2, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    inputs.append(q1 @ torch.diag(torch.logspace(0, -2, 48)) @ q2)  # condition number 100
    for g in inputs:
        sv_in = torch.linalg.svdvals(g)
        assert sv_in.min() / (sv_in.norm() * 1.02) >= 1e-3  # the band's precondition
        sv = torch.linalg.svdvals(polar_express(g).float())
        assert sv.min() >= lo - 0.01 and sv.max() <= 2 - lo + 0.01, (tuple(g.shape), sv.min(), sv.max())
        sv_ns = torch.linalg.svdvals(newton_schulz(g).float())  # the torch quintic: wider, lower band
        assert sv_ns.min() < lo


# ---- the torch variant against torch.optim.Muon, the AdamW group against torch.optim.AdamW ---------
def _twins(gen: torch.Generator, shapes: list[tuple[int, ...]]) -> tuple[list, list]:
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def _assert_steps_alike(opt, ref, ours: list, theirs: list, gen: torch.Generator, steps: int = 4) -> None:
    """The same random gradients into both optimisers; after every step the change from init agrees."""
    init = [p.detach().clone() for p in ours]
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
        for a, b, w in zip(ours, theirs, init, strict=True):
            assert rel_err(a.detach() - w, b.detach() - w) <= 1e-6


@pytest.mark.parametrize("scale", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_torch_variant_equals_torch_muon(scale, nesterov):
    gen = torch.Generator().manual_seed(3)
    ours, theirs = _twins(gen, [(8, 16), (16, 8), (32, 32), (64, 24)])
    opt = MuonWithAuxAdamW([{"params": ours, "use_muon": True, "lr": 0.02, "weight_decay": 0.1, "momentum": 0.9,
                             "nesterov": nesterov, **{**MUON_VARIANTS["torch"], "scale": scale}}])
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=scale)
    _assert_steps_alike(opt, ref, ours, theirs, gen)


def test_adamw_group_equals_torch_adamw():
    gen = torch.Generator().manual_seed(4)
    ours, theirs = _twins(gen, [(10, 4), (7,)])
    opt = MuonWithAuxAdamW([{"params": ours, "use_muon": False, "lr": 0.01, "weight_decay": 0.1, "betas": (0.8, 0.9)}])
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.8, 0.9))
    _assert_steps_alike(opt, ref, ours, theirs, gen)


# ---- which parameters go where ----------------------------------------------------------------------
LAYER_MATRICES = [f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]


@pytest.mark.parametrize("ablation, muon_extra, adamw", [
    ("baseline", [], ["embed.weight", "head.weight"]),
    ("p-lr-block-n8-r32", ["router.embedding_key_proj.weight"], ["embed.weight", "head.weight", "router.queries"]),
    ("s-lr-block-n8-r64", [], ["embed.weight", "head.weight", "router.queries"]),
    ("p-lr-block-n8-r32-dynquery", ["router.embedding_key_proj.weight"],
     ["embed.weight", "head.weight", "router.queries", "router.query_gates"]),
])
def test_parameter_split_on_a_real_decoder(registry, ablation, muon_extra, adamw):
    model = build_decoder(tiny_config(registry, ablation))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, rest = split_parameters(model)
    assert sorted(names[id(p)] for p in muon) == sorted(LAYER_MATRICES + muon_extra)
    assert sorted(names[id(p)] for p in rest) == sorted(adamw)
    opt = build_optimizer(model, kind="muon_adamw", lr=3e-4, weight_decay=0.0, betas=(0.9, 0.95),
                          muon_lr=1e-3, muon_weight_decay=0.1)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["muon"]["use_muon"] and not by_name["adamw"]["use_muon"]
    assert [id(p) for p in by_name["muon"]["params"]] == [id(p) for p in muon]
    assert by_name["muon"]["orthogonalizer"] == "polar_express" and by_name["adamw"]["betas"] == (0.9, 0.95)
    plain = build_optimizer(model, kind="adamw", lr=3e-4, weight_decay=0.0, betas=(0.9, 0.95),
                            muon_lr=1e-3, muon_weight_decay=0.1)
    assert isinstance(plain, torch.optim.AdamW) and len(plain.param_groups[0]["params"]) == len(names)


# ---- schedule and state ----------------------------------------------------------------------------
def test_momentum_schedule_shape():
    m = MomentumSchedule(peak=0.95, low=0.85, warmup_steps=300, cooldown_steps=100)
    T = 1000
    assert m(0, T) == 0.85 and m(150, T) == pytest.approx(0.90) and m(300, T) == 0.95 and m(900, T) == 0.95
    assert m(950, T) == pytest.approx(0.90) and m(999, T) == pytest.approx(0.851) and m(5000, T) == 0.85
    assert MomentumSchedule(warmup_steps=0, cooldown_steps=0)(0, 10) == 0.95


def _small_setup(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    mats = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 16), (24, 8)]]
    vec = torch.nn.Parameter(torch.randn(6, generator=gen))
    opt = MuonWithAuxAdamW([{"params": mats, "use_muon": True, "name": "muon", "lr": 0.05},
                            {"params": [vec], "use_muon": False, "name": "adamw", "lr": 0.01}])
    sched = WarmupStableDecay(opt, 12, 3, 0.25, 0.1, MomentumSchedule(warmup_steps=4, cooldown_steps=3))
    return [*mats, vec], opt, sched


def _grads(step: int, params):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_state_dict_round_trip_resumes_lr_momentum_and_weights_exactly():
    """Saved at step 5 (stable), restored the way Lightning does (fresh optimiser and scheduler, then the
    optimiser's state, then the scheduler's), the run continues through decay and momentum cooldown
    exactly as the uninterrupted one: the scheduler drives the live groups after load_state_dict."""
    params, opt, sched = _small_setup()
    history = []
    for step in range(12):
        _grads(step, params)
        history.append([(g["lr"], g.get("momentum")) for g in opt.param_groups])
        opt.step()
        sched.step()
        if step == 4:
            buf = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(),
                        "weights": [p.detach().clone() for p in params]}, buf)
    final = [p.detach().clone() for p in params]

    params2, opt2, sched2 = _small_setup(seed=6)  # other initial weights: all of it must come from the state
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    with torch.no_grad():
        for p, w in zip(params2, saved["weights"], strict=True):
            p.copy_(w)
    for step in range(5, 12):
        _grads(step, params2)
        assert [(g["lr"], g.get("momentum")) for g in opt2.param_groups] == history[step], step
        opt2.step()
        sched2.step()
    for p, q in zip(params2, final, strict=True):
        assert torch.equal(p.detach(), q)
    assert history[11][0][1] < 0.95 and history[11][0][0] < history[5][0][0]  # decay and cooldown were crossed


# ---- bad options: a clear ValueError naming the field ----------------------------------------------
@pytest.mark.parametrize("group, field", [
    ({"orthogonalizer": "svd"}, "orthogonalizer"),
    ({"orthogonalizer_dtype": "float16"}, "orthogonalizer_dtype"),
    ({"scale": "rms"}, "scale"),
    ({"variance_beta2": 1.5}, "variance_beta2"),
    ({"momentum": 1.0}, "momentum"),
    ({"lr": -1.0}, "lr"),
    ({"nesterov_typo": True}, "nesterov_typo"),
])
def test_bad_muon_group_options(group, field):
    with pytest.raises(ValueError, match=field):
        MuonWithAuxAdamW([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "use_muon": True, **group}])


def test_other_bad_options(registry):
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAuxAdamW([{"params": [torch.nn.Parameter(torch.zeros(4, 4))]}])
    with pytest.raises(ValueError, match="params.*shape \\(4,\\)"):
        MuonWithAuxAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": True}])
    with pytest.raises(ValueError, match="betas"):
        MuonWithAuxAdamW([{"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": False, "betas": (0.9, 1.0)}])
    model = build_decoder(tiny_config(registry, "baseline"))
    with pytest.raises(ValueError, match="muon_variant"):
        build_optimizer(model, kind="muon_adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), muon_lr=1e-3,
                        muon_weight_decay=0.0, muon_variant="keller")
    with pytest.raises(ValueError, match="muon_momentum_min"):
        MomentumSchedule(peak=0.9, low=0.95)
    with pytest.raises(ValueError, match="muon_momentum_cooldown_steps"):
        MomentumSchedule(cooldown_steps=-1)
    with pytest.raises(ValueError, match="model.muon_variant"):
        LRAttnModule.from_names(size="tiny", ablation="baseline", muon_variant="keller")
    _, opt, _ = _small_setup()
    with pytest.raises(ValueError, match="MuonAdamW"):
        opt.load_state_dict({"optimizers": [{}, {}]})
    other = MuonWithAuxAdamW([{"params": opt.param_groups[0]["params"], "use_muon": True, **MUON_VARIANTS["torch"]},
                              {"params": opt.param_groups[1]["params"], "use_muon": False}])
    with pytest.raises(ValueError, match="orthogonalizer='newton_schulz'.*muon_variant"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("total, warmup", [(38146, 500), (1000, 50), (24, 4), (7, 2)])
def test_lr_schedule_is_the_references_warmup_stable_linear_warmdown(total, warmup):
    """The paper's schedule restated: (s + 1) / warmup, then 1, then over the last W = int(0.2 T) steps
    0.1 + 0.9 (T - s) / W. At T = 38146 the warmdown starts at step 30517 (it started one step early)."""
    from lrattn_lightning.train.schedule import wsd_lambda

    factor = wsd_lambda(total, warmup, 0.2, 0.1)
    W = int(0.2 * total)
    for s in range(total):
        expected = (s + 1) / warmup if s < warmup else 1.0 if s < total - W else 0.1 + 0.9 * (total - s) / W
        assert factor(s) == pytest.approx(expected, rel=1e-12), s
    if total == 38146:
        assert factor(30516) == 1.0 and factor(30517) == 1.0 > factor(30518)


# ---- a real run, SIGKILLed in the decay phase and resumed ---------------------------------------------
SCHEDULE = ["--model.warmup_steps", "4", "--model.decay_fraction", "0.25",  # LR: warmup 0-3, decay from 18
            "--model.muon_momentum_warmup_steps", "14", "--model.muon_momentum_cooldown_steps", "4",
            "--trainer.val_check_interval", "10", "--checkpoint_every", "12"]  # val 10, 20, final 24


@pytest.mark.usefixtures("mlflow_store")
def test_resume_after_sigkill_in_decay_matches_uninterrupted_run(tiny_data, tmp_path):  # noqa: F811
    """24 steps: LR warmup (0-3), stable, decay (18-23); momentum warmup (0-13), peak, cooldown (21-23).
    The killed run checkpoints at step 12 and dies at step 19 (inside the decay); resumed from last.ckpt,
    its steps 12-23 cross the momentum peak, the LR decay and the momentum cooldown, and every logged
    loss, learning rate and momentum, and the final validation loss, equal the uninterrupted run's."""
    steps = 24
    full = run_cli(slr_fit_args(tiny_data, *SCHEDULE, "--experiment", "full", steps=steps), tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    (tmp_path / "kill.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: run_hooks.KillAtStep\n      init_args: {step: 19}\n")
    killed = run_process(slr_fit_args(tiny_data, *SCHEDULE, "--experiment", "killed", "--config", "kill.yaml",
                                      steps=steps), tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = tmp_path / "runs/killed/tiny-s-lr-grid-n4-r16-seed0/checkpoints/last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 12
    resumed = run_cli(slr_fit_args(tiny_data, *SCHEDULE, "--experiment", "killed", "--ckpt_path", "last",
                                   steps=steps), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    client, run_full = the_run(tmp_path, "full")
    _, run_resumed = the_run(tmp_path, "killed")
    for key, rel in [("train/loss", 1e-5), ("train/lr/muon", 1e-12), ("train/lr/adamw", 1e-12),
                     ("train/momentum/muon", 1e-12)]:
        a = losses_by_step(client, run_full.info.run_id, key)
        b = losses_by_step(client, run_resumed.info.run_id, key)
        assert sorted(a) == sorted(b) == list(range(steps)), key
        for step in range(steps):
            assert b[step] == pytest.approx(a[step], rel=rel, abs=1e-7), (key, step, a[step], b[step])
    assert run_resumed.data.metrics["val/loss"] == pytest.approx(run_full.data.metrics["val/loss"], rel=1e-5)
    # the final validation (24 is no multiple of 10) sits at step 24 in both: after a resume it was logged at
    # the resume step 12, where MLflow already had values, and dropped
    val_full = losses_by_step(client, run_full.info.run_id, "val/loss")
    val_resumed = losses_by_step(client, run_resumed.info.run_id, "val/loss")
    assert sorted(val_full) == sorted(val_resumed) == [10, 20, 24]
    for step in (10, 20, 24):
        assert val_resumed[step] == pytest.approx(val_full[step], rel=1e-5), step
    # the resumed stretch really crossed the phases
    lr = losses_by_step(client, run_full.info.run_id, "train/lr/muon")
    mom = losses_by_step(client, run_full.info.run_id, "train/momentum/muon")
    assert lr[0] < lr[3] == lr[12] == lr[18] > lr[19] > lr[23]  # decay starts from 1.0 at step 18
    assert mom[12] < mom[14] == mom[20] > mom[21] > mom[23] and mom[20] == pytest.approx(0.95)


@pytest.mark.parametrize("clip", [1e-3, 0.0])
def test_clipping_by_the_logged_norm_is_lightnings_clipping(tiny_data, clip):  # noqa: F811
    """The module clips by the gradient norm it logs (one pass) instead of Lightning's second one: after two
    optimizer steps, with clipping that bites (1e-3) and without, the weights are those of Lightning's own
    configure_gradient_clipping (torch's clip_grad_norm_), and clipping changed them."""
    import lightning as L

    from lrattn_lightning.data.datamodule import TokenDataModule

    class LightningsClipping(LRAttnModule):
        configure_gradient_clipping = L.LightningModule.configure_gradient_clipping

    def trained(cls, clip_val):
        L.seed_everything(0)
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, limit_val_batches=0,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            gradient_clip_val=clip_val)
        module = cls.from_names(size="tiny", ablation="baseline", registry=REGISTRY, warmup_steps=1, lr=1e-2)
        trainer.fit(module, datamodule=TokenDataModule(str(tiny_data), batch_size=2, seq_len=16))
        return torch.cat([p.detach().flatten() for p in module.model.parameters()])

    ours = trained(LRAttnModule, clip)
    torch.testing.assert_close(ours, trained(LightningsClipping, clip), rtol=1e-6, atol=1e-7)
    if clip:
        assert not torch.allclose(ours, trained(LRAttnModule, 0.0), rtol=1e-4, atol=1e-6)


def test_adamw_takes_the_fused_cuda_kernel_only_for_plain_cuda_parameters():
    """Fused AdamW (one launch, its step count on the device) where every parameter is a CUDA tensor (fake ones
    here: no GPU needed); the default elsewhere (CPU, a mix, FSDP2's DTensors by their type's name)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lrattn_lightning.train.optim import adamw_kernel

    with FakeTensorMode():
        cuda = [torch.empty(3, device="cuda"), torch.empty(2, 2, device="cuda")]
        assert adamw_kernel(cuda) == {"fused": True}
        assert adamw_kernel([*cuda, torch.empty(2)]) == {}

    class DTensor:  # (stands for torch.distributed.tensor.DTensor on CUDA: _is_sharded reads the type's name)
        device = torch.device("cuda")

    assert adamw_kernel([DTensor()]) == {}
    assert adamw_kernel([torch.empty(2)]) == {} and adamw_kernel([]) == {}
