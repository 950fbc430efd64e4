"""Muon's orthogonalisers in float32 and batched: the float32 iteration against a float64 evaluation of the same
polynomials, a batched step against one matrix at a time, `auto` per device capability, the option's checks, a
resume across dtypes, and the recipe fingerprint."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers.models import tiny_config
from helpers.references import BF16_BOUND, polar_express_float64, rel_err
from torch.utils.flop_counter import FlopCounterMode

from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.train import fingerprint as fingerprints
from lrattn_lightning.train.lit_module import LRAttnModule
from lrattn_lightning.train.muon import (
    NEWTON_SCHULZ_COEFFS,
    ORTHOGONALIZERS,
    iterate_float32,
    native_bfloat16,
    newton_schulz,
    polar_express,
    resolve_muon_dtype,
)
from lrattn_lightning.train.optim import (
    MUON_VARIANTS,
    MuonWithAuxAdamW,
    muon_dtype_of,
    same_shape_batches,
    split_parameters,
)


def newton_schulz_float64(g: torch.Tensor, dtype=None) -> torch.Tensor:
    """torch.optim.Muon's iteration restated, every step in float64: X <- G / ||G||_F on the wide orientation,
    then five times X <- a X + (b A + c A^2) X with A = X X^T."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    tall = g.size(-2) > g.size(-1)
    x = g.double().mT if tall else g.double()
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def gradient_like(gen: torch.Generator, m: int, n: int, decades: float = 2.5) -> torch.Tensor:
    """A matrix with the decaying spectrum of a real gradient: singular values 1 down to 10^-decades."""
    k = min(m, n)
    q1, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return ((q1 * torch.logspace(0, -decades, k, dtype=torch.float64)) @ q2.T).float()


SHAPES = [(48, 16), (16, 40), (32, 32)]


# ---- float32 against float64 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("orth, float64", [(polar_express, polar_express_float64),
                                           (newton_schulz, newton_schulz_float64)])
def test_float32_orthogonalisers_follow_the_float64_iteration(orth, float64):
    """In float32 both orthogonalisers are their polynomial iteration up to float32 rounding (measured <= 3e-5 of
    the largest element, also on (384, 128) and (128, 704)), in the direct form (square) and the Gram form (the
    others), also where the spectrum spans six decades (the Gram form without its restart: 4e-4..2e-3 there); the
    bfloat16 path, rounded between iterations, is 1e-2 to 1 away on the same inputs: the bound tells them apart."""
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(s, generator=gen) for s in SHAPES] + [gradient_like(gen, *s) for s in SHAPES]
    inputs.append(torch.stack([gradient_like(gen, 24, 56) for _ in range(3)]))  # a batch (3, 24, 56)
    inputs += [gradient_like(gen, 16, 112, decades=6), gradient_like(gen, 112, 16, decades=6)]
    for g in inputs:
        out, ref = orth(g, torch.float32), float64(g)
        assert out.dtype == torch.float32 and out.shape == g.shape
        assert rel_err(out, ref) <= 5e-5, (tuple(g.shape), rel_err(out, ref))
        assert rel_err(orth(g, torch.bfloat16), ref) >= 1e-3  # the rounding the float32 path leaves out


@pytest.mark.parametrize("shape", [(16, 16), (16, 24), (16, 25), (16, 112), (3, 16, 112)])
def test_float32_takes_the_form_with_fewer_flops(shape):
    """Five float32 iterations cost 10 m^3 + 20 m^2 n flops directly and 28 m^3 + 8 m^2 n in the Gram form with its
    restart (two Gram matrices, two applications of Q, m^3 products between): the one taken is the cheaper, the
    direct form at a tie (n = 1.5 m). Counted by torch's own flop counter, per matrix of a batch."""
    batch, m, n = (1, *shape) if len(shape) == 2 else shape
    x = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        iterate_float32(x / x.norm(), (NEWTON_SCHULZ_COEFFS,) * 5)
    assert counter.get_total_flops() == batch * min(10 * m**3 + 20 * m * m * n, 28 * m**3 + 8 * m * m * n)


# ---- batched == one matrix at a time -------------------------------------------------------------------------
def test_same_shape_batches_groups_by_shape_and_respects_the_element_cap():
    shapes = [torch.Size(s) for s in [(4, 8), (8, 4), (4, 8), (4, 8), (4, 8), (4, 8), (8, 4)]]
    assert same_shape_batches(shapes, 1 << 20) == [[0, 2, 3, 4, 5], [1, 6]]
    assert same_shape_batches(shapes, 64) == [[0, 2], [3, 4], [5], [1, 6]]  # 64 elements: two 4x8 matrices
    assert same_shape_batches(shapes, 1) == [[0], [2], [3], [4], [5], [1], [6]]


def _twin_decoders(registry, ablation: str):
    """Two copies of a tiny decoder (two layers: every Muon shape twice) with the same random gradients."""
    torch.manual_seed(0)
    a = build_decoder(tiny_config(registry, ablation))
    b = build_decoder(tiny_config(registry, ablation))
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("variant", ["reference", "torch"])
@pytest.mark.parametrize("dtype, steps, bound", [("float32", 3, 1e-5), ("bfloat16", 1, BF16_BOUND)])
def test_batched_step_equals_one_matrix_at_a_time(registry, monkeypatch, variant, dtype, steps, bound):
    """The optimiser's step stacks each shape's matrices into one orthogonalisation; every weight, momentum buffer
    and second moment then equals the step that orthogonalises one matrix at a time (max_batch_elements=1), to
    rounding (float32: three steps; bfloat16: one step, a flipped rounding per iteration at most; on the machine
    this was written on both are bit for bit equal)."""
    calls: list[tuple[int, ...]] = []
    orth = ORTHOGONALIZERS[MUON_VARIANTS[variant]["orthogonalizer"]]

    def recorded(u, dt):
        calls.append(tuple(u.shape))
        return orth(u, dt)

    monkeypatch.setitem(ORTHOGONALIZERS, MUON_VARIANTS[variant]["orthogonalizer"], recorded)
    batched, single = _twin_decoders(registry, "p-lr-block-n8-r32")
    opts = []
    for model, cap in ((batched, 1 << 26), (single, 1)):
        muon, _ = split_parameters(model)
        opts.append(MuonWithAuxAdamW([{"params": muon, "use_muon": True, "lr": 0.05, "weight_decay": 0.1,
                                       "orthogonalizer_dtype": dtype, **MUON_VARIANTS[variant]}],
                                     max_batch_elements=cap))
    pairs = list(zip(split_parameters(batched)[0], split_parameters(single)[0], strict=True))
    init = [p.detach().clone() for p, _ in pairs]
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, q in pairs:
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        calls.clear()
        opts[0].step()
        shapes_batched = list(calls)
        calls.clear()
        opts[1].step()
        shapes_single = list(calls)
    # 2 layers x (qkv, proj, fc1, fc2): four batches of two; the router's key projection alone
    count = Counter(tuple(p.shape) for p, _ in pairs)
    assert sorted(shapes_batched) == sorted((n, *s) if n > 1 else s for s, n in count.items())
    assert sorted(count.values()) == [1, 2, 2, 2, 2] and len(shapes_single) == len(pairs)
    for (p, q), w in zip(pairs, init, strict=True):
        assert rel_err(p.detach() - w, q.detach() - w) <= bound, (tuple(p.shape), rel_err(p - w, q - w))
        for key in opts[0].state[p]:
            assert rel_err(opts[0].state[p][key], opts[1].state[q][key]) <= bound, key


# ---- auto: bfloat16 where the device computes it, float32 elsewhere -----------------------------------------
def probes(cuda_bf16=False, cpu_amx=False, cpu_avx512_bf16=False):
    """The capabilities torch would report, injected (the resolver's argument, not a patched torch)."""
    return {"cuda_bf16": lambda: cuda_bf16, "cpu_amx": lambda: cpu_amx, "cpu_avx512_bf16": lambda: cpu_avx512_bf16}


@pytest.mark.parametrize("device, caps, expected", [
    ("cpu", {}, "float32"),  # AVX2 / AVX-512 without BF16 (Zen 2/3, Skylake): bfloat16 matmuls are emulated
    ("cpu", {"cpu_avx512_bf16": True}, "bfloat16"),  # Cooper Lake, Zen 4
    ("cpu", {"cpu_amx": True, "cpu_avx512_bf16": True}, "bfloat16"),  # Sapphire Rapids
    ("cuda", {"cuda_bf16": True}, "bfloat16"),  # Ampere and later
    ("cuda", {}, "float32"),  # Volta, Turing: bfloat16 only emulated
    ("cuda", {"cpu_amx": True}, "float32"),  # the host CPU's bfloat16 says nothing of the GPU's
    ("mps", {"cuda_bf16": True, "cpu_amx": True}, "float32"),
])
def test_auto_resolves_by_the_devices_bfloat16(device, caps, expected):
    assert resolve_muon_dtype("auto", device, probes(**caps)) == expected
    for pinned in ("bfloat16", "float32"):  # an explicit dtype wins on every device
        assert resolve_muon_dtype(pinned, device, probes(**caps)) == pinned


def test_torchs_own_probes_answer_on_this_machine():
    """The real probes run (a private torch function that moved would raise here, not in a run's first step)."""
    native = native_bfloat16("cpu")
    assert isinstance(native, bool)
    assert resolve_muon_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert native_bfloat16("cuda") == (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8)


def test_the_module_passes_its_muon_dtype_to_the_optimizer():
    for setting, expected in (("auto", resolve_muon_dtype("auto", "cpu")), ("float32", "float32"),
                              ("bfloat16", "bfloat16")):
        module = LRAttnModule.from_names(size="tiny", ablation="baseline", muon_dtype=setting)
        opt = module.make_optimizer()
        assert muon_dtype_of([opt]) == expected
        assert {g["orthogonalizer_dtype"] for g in opt.param_groups if g["use_muon"]} == {expected}
    plain = LRAttnModule.from_names(size="tiny", ablation="baseline", optimizer="adamw").make_optimizer()
    assert muon_dtype_of([plain]) is None


def test_a_bad_muon_dtype_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"^--model\.muon_dtype float16: must be one of auto, bfloat16, float32$"):
        LRAttnModule.from_names(size="tiny", ablation="baseline", muon_dtype="float16")
    with pytest.raises(ValueError, match=r"orthogonalizer_dtype: 'half' is not one of auto, bfloat16, float32"):
        MuonWithAuxAdamW([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "use_muon": True,
                           "orthogonalizer_dtype": "half"}])
    with pytest.raises(ValueError, match=r"^muon_dtype: 'fp32' is not one of auto, bfloat16, float32$"):
        resolve_muon_dtype("fp32", "cpu")


# ---- a resume keeps its dtype ---------------------------------------------------------------------------------
def _muon_opt(dtype: str) -> MuonWithAuxAdamW:
    gen = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(8, 16, generator=gen))
    opt = MuonWithAuxAdamW([{"params": [w], "use_muon": True, "name": "muon", "orthogonalizer_dtype": dtype}])
    w.grad = torch.randn(8, 16, generator=gen)
    opt.step()
    return opt


def test_a_resume_in_another_dtype_is_one_line_and_old_states_ran_bfloat16():
    """torch would restore the checkpoint's dtype over this run's silently (and `auto` on another machine may
    resolve otherwise): one line with the fix. A state from before the option ran bfloat16 and says so."""
    saved = _muon_opt("bfloat16").state_dict()
    with pytest.raises(ValueError, match=r"orthogonalizer_dtype='bfloat16', this run has 'float32' "
                                         r"\(model\.muon_dtype\); pass --model\.muon_dtype bfloat16"):
        _muon_opt("float32").load_state_dict(saved)
    old = {**saved, "param_groups": [{k: v for k, v in g.items() if k != "orthogonalizer_dtype"}
                                     for g in saved["param_groups"]]}
    resumed = _muon_opt("bfloat16")
    resumed.load_state_dict(old)
    assert resumed.param_groups[0]["orthogonalizer_dtype"] == "bfloat16"
    resumed.step()  # the restored group carries every option the step reads
    with pytest.raises(ValueError, match="orthogonalizer_dtype='bfloat16'"):
        _muon_opt("float32").load_state_dict(old)


# ---- the recipe fingerprint ------------------------------------------------------------------------------------
def test_float32_muon_is_part_of_the_recipe_and_bfloat16_keeps_old_fingerprints():
    def parts(**kw):
        return fingerprints.recipe_parts(size="tiny", max_steps=10, tokens_per_step=64, seq_len=32, data="d",
                                         settings={"optimizer": "muon_adamw"}, gradient_clip_val=1.0,
                                         precision="32-true", init_from="none", **kw)

    before = parts()  # a run recorded before the part existed (it ran bfloat16)
    assert fingerprints.fingerprint(parts(muon_dtype="bfloat16")) == fingerprints.fingerprint(before)
    assert fingerprints.fingerprint(parts(muon_dtype=None)) == fingerprints.fingerprint(before)  # no Muon
    fp32 = parts(muon_dtype="float32")
    assert fingerprints.fingerprint(fp32) != fingerprints.fingerprint(before)
    assert fingerprints.differences(fp32, before) == [("optimizer.muon_dtype", "float32", None)]
