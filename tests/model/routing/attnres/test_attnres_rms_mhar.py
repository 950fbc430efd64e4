"""Two AttnRes options of the field (docs/method.md §10): RMS Block AttnRes (`block_summary: rms`) and MHAR's key norm over
the whole key once per source (`depth_head_norm: full`) with its per-site key gain (`key_gain`).

The formulas in float64 against an independent implementation below (random queries and gains: at init every
formula routes uniformly), every backend against `reference` (the triton one in Triton's CPU interpreter, one
tiny case; the registry entries also run in the sweep of triton/test_attnres_triton.py), accounting, the
optimizer split, causality and decoding, and the one-line errors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.checks import assert_causal_and_decodes_with_the_kv_cache, assert_router_gradcheck, capture
from helpers.models import DEEPER, tokens
from helpers.paths import TESTS_DIR
from helpers.references import ref_head_rms_norm, ref_rms_norm

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import count_params, routing_params
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import load_registry, parse_registry
from lrattn_lightning.tools.fidelity.interface import NotExpressible
from lrattn_lightning.train.optim import split_parameters

REGISTRY = load_registry()
SIZE = DEEPER  # three layers (6 sublayers), d = 32
M, D = SIZE.n_sublayers, SIZE.d_model
EPS64 = torch.finfo(torch.float64).eps

# (entry, changes) at DEEPER: 4 blocks end after 2, 3, 5, 6, so reads see completed blocks and partial ones
CASES = {
    "rms-value": ("attnres-block-n8-rms", {"blocks": 4}),
    "rms-sliced": ("s-lr-block-n8-r64-rms", {"blocks": 4, "rank": 16}),
    "rms-projected-h2": ("p-lr-block-n8-r32", {"blocks": 4, "rank": 16, "block_summary": "rms", "depth_heads": 2}),
    "mhar-h4": ("mhar-h4", {}),
    "mhar-sliced-block": ("s-lr-block-n8-r64", {"blocks": 3, "rank": 16, "depth_heads": 4,
                                                 "depth_head_norm": "full", "key_gain": True}),
    "mhar-projected-rms": ("p-lr-block-n8-r32", {"blocks": 4, "rank": 16, "depth_heads": 4, "depth_head_norm": "full",
                                                 "key_gain": True, "block_summary": "rms", "count_prior": 1.0}),
    "full-norm-no-gain": ("attnres-full", {"depth_heads": 2, "depth_head_norm": "full"}),
}
# the backends' cases: the formula's, plus value_projected keys and the gated dynamic query
BACKEND_CASES = {**CASES,
                 "mhar-vp-rms": ("vp-lr-block-n8-r32", {"blocks": 4, "rank": 16, "depth_heads": 4, "key_gain": True,
                                                         "depth_head_norm": "full", "block_summary": "rms"}),
                 "mhar-dynquery-rms": ("p-lr-block-n8-r32-dynquery", {"blocks": 4, "rank": 16, "depth_heads": 2,
                                                                      "depth_head_norm": "full", "key_gain": True,
                                                                      "block_summary": "rms"})}


def case_config(case: str) -> ModelConfig:
    """The registry entry of BACKEND_CASES[case] with its changes, at SIZE (not helpers.models.kind_config: the
    cases are registry entries changed, not a kind's options alone)."""
    name, changes = BACKEND_CASES[case]
    return ModelConfig(SIZE, REGISTRY.ablation(name).replace(**changes))


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random queries, gates and key gains (far from their init), so routing is far from uniform; from a generator of
    its own, whatever the model's dtype (not helpers.models.randomized: the backends' models share these values)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.router.named_parameters():
            if name in ("queries", "query_gates"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name == "key_gain":
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return model


def model_for(case: str, impl: str = "reference", dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return randomize(build_decoder(case_config(case), impl=impl)).to(dtype)


# ---- the formula, written out (docs/method.md §10; rms-block-attnres HiddenNormalizedSum; hcfactory depth_attention) ----
def formula_reads(cfg: ModelConfig, params: dict, trace) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """h_j and alpha_j [S, B, T, m] for j = 1..2L from the emitted outputs, in float64."""
    o = cfg.options
    r, m = o.rank or D, o.depth_heads
    norm_groups = m if o.depth_head_norm == "per_head" else 1

    def key_norm(x):
        return ref_head_rms_norm(x, norm_groups)

    outs = [x.double() for x in trace.outputs]
    emb = trace.emb.double()
    value = [emb, *(x[..., :D] for x in outs)]
    if o.key_source == "projected":  # emitted keys are normalised where they are emitted
        emitted = [key_norm(emb @ params["embedding_key_proj.weight"].double().T),
                   *(key_norm(x[..., D : D + r]) for x in outs)]
    ends = cfg.block_ends() or list(range(1, M + 1))  # full routing: every output its own block
    reads, weights = [], []
    for j in range(1, M + 1):
        blocks, start = [[0]], 1  # the embedding, completed blocks, the partial block
        for end in ends:
            if end <= j:
                blocks.append(list(range(start, end + 1)))
                start = end + 1
        partial = list(range(start, j + 1))
        values, keys = [], []
        for members in [*blocks, *([partial] if partial else [])]:
            completed = members != partial and members != [0]
            if completed and o.block_summary == "rms":  # sum_i RMS(o_i), eps 1e-6, no gain
                v = sum(ref_rms_norm(value[i], 1e-6) for i in members)
            else:  # the embedding, a raw sum (partial blocks always)
                v = sum(value[i] for i in members)
            if o.key_source == "value":
                k = v
            elif o.key_source == "sliced":
                k = v[..., -r:]
            else:
                k = sum(emitted[i] for i in members)
            values.append(v)
            keys.append(key_norm(k))
        q = params["queries"][j - 1].double()
        if o.key_gain:  # <q, gamma * k>
            q = q * params["key_gain"][j - 1].double()
        logits = torch.stack([(k.unflatten(-1, (m, -1)) * q.view(m, -1)).sum(-1) for k in keys])  # [S, B, T, m]
        prior = [o.count_prior * math.log(len(b)) for b in [*blocks, *([partial] if partial else [])]]
        logits = logits + torch.tensor(prior, dtype=torch.float64).view(-1, 1, 1, 1)
        alpha = logits.softmax(0)
        h = sum(a.repeat_interleave(D // m, dim=-1) * v for a, v in zip(alpha, values, strict=True))
        reads.append(h)
        weights.append(alpha)
    return reads, weights


@pytest.mark.parametrize("case", list(CASES))
def test_the_formula_in_float64_with_random_queries_and_gains(case):
    model = model_for(case)
    cfg = model.cfg
    params = {k: p.detach() for k, p in model.router.named_parameters()}
    trace = capture(model, tokens(SIZE.vocab_size, 2, 6))
    reads, weights = formula_reads(cfg, params, trace)
    for j in range(1, M + 1):
        read = trace.final if j == M else trace.inputs[j]
        torch.testing.assert_close(read, ref_rms_norm(reads[j - 1]), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(trace.routing[j - 1].double(), weights[j - 1], rtol=1e-6, atol=1e-7)
    assert max(float(a.std(0).max()) for a in weights) > 0.05  # not uniform
    if cfg.options.depth_heads > 1:  # the heads route differently
        assert max(float((a - a[..., :1]).abs().max()) for a in weights) > 0.01


def test_rms_summaries_normalise_completed_blocks_only():
    """The same weights with sum summaries: site 1 reads the embedding and the raw partial block [o_1] in both;
    site 2, after the block [o_1, o_2] completed, reads its summary: RMS(o_1) + RMS(o_2) against o_1 + o_2."""
    rms = model_for("rms-value")
    plain = build_decoder(ModelConfig(SIZE, rms.cfg.ablation.replace(block_summary="sum")), impl="reference").double()
    plain.load_state_dict(rms.state_dict())
    assert rms.cfg.block_ends()[0] == 2
    idx = tokens(SIZE.vocab_size, 2, 6)
    a, b = capture(rms, idx), capture(plain, idx)
    torch.testing.assert_close(a.inputs[1], b.inputs[1], rtol=0, atol=0)
    assert (a.inputs[2] - b.inputs[2]).abs().max() > 1e-2


def test_mhar_at_init_is_full_attnres_at_init():
    """Zero queries route uniformly whatever the key norm and gain: at init mhar-h4 computes attnres-full."""
    torch.manual_seed(0)
    mhar = build_decoder(ModelConfig(SIZE, REGISTRY.ablation("mhar-h4"))).double()
    full = build_decoder(ModelConfig(SIZE, REGISTRY.ablation("attnres-full"))).double()
    full.load_state_dict({k: v for k, v in mhar.state_dict().items() if "key_gain" not in k})
    assert bool((mhar.router.key_gain == 1).all()) and not mhar.router.queries.any()
    idx = tokens(SIZE.vocab_size, 2, 8)
    torch.testing.assert_close(mhar(idx), full(idx), rtol=0, atol=1e-12)


# ---- backends ------------------------------------------------------------------------------------------
def _forward_backward(model, idx):
    model.zero_grad(set_to_none=True)
    out = model(idx, return_routing=True)
    (out.logits.square().mean() + out.logits[..., :3].sum()).backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, out.routing


@pytest.mark.parametrize("impl", ["auto", "compiled"])  # auto: fast, compiled for the dynamic query
@pytest.mark.parametrize("case", list(BACKEND_CASES))
def test_backends_agree_with_reference_in_float64(case, impl):
    ref = model_for(case)
    other = build_decoder(ref.cfg, impl=impl).double()
    other.load_state_dict(ref.state_dict())
    idx = tokens(SIZE.vocab_size, 2, 7)
    (lr, gr, ar), (lo, go, ao) = _forward_backward(ref, idx), _forward_backward(other, idx)
    torch.testing.assert_close(lo, lr, rtol=1e-10, atol=1e-10)
    assert go.keys() == gr.keys() and (not ref.cfg.options.key_gain or "router.key_gain" in gr)
    for n, g in gr.items():
        torch.testing.assert_close(go[n], g, rtol=1e-9, atol=1e-10 * g.abs().max().item(), msg=n)
    for a, b in zip(ao, ar, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_fast_backward_of_the_full_key_norm_passes_gradcheck():
    """`fast` differentiates the whole-key norm by hand (fast_functions._key_grads): float64 gradcheck of the
    router's parameters (queries, key gains) through completed and partial block reads."""
    model = model_for("mhar-sliced-block", impl="fast")
    idx = tokens(SIZE.vocab_size, 1, 4)
    assert_router_gradcheck(model, idx)


def test_bf16_autocast_is_close_to_float32():
    for case in ("rms-value", "mhar-h4"):
        model = model_for(case, impl="fast", dtype=torch.float32).eval()
        idx = tokens(SIZE.vocab_size, 2, 10)
        with torch.no_grad():
            exact = model(idx)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                low = model(idx).float()
        assert (low - exact).abs().max() < 0.1 * exact.abs().max(), case


@pytest.mark.parametrize("case", ["rms-value", "mhar-h4"])
def test_causal_and_decodes_with_the_kv_cache(case):
    assert_causal_and_decodes_with_the_kv_cache(model_for(case, impl="fast").eval())


def _triton_worker() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: one case through the triton backend against `reference`."""
    torch.set_num_threads(1)
    ref = model_for("mhar-projected-rms")
    tri = build_decoder(ref.cfg, impl="triton").double()
    tri.load_state_dict(ref.state_dict())
    idx = tokens(SIZE.vocab_size, 1, 5)
    (lr, gr, ar), (lt, gt, at) = _forward_backward(ref, idx), _forward_backward(tri, idx)
    print(json.dumps({"dlogit": float((lt - lr).abs().max()), "grads": sorted(gt) == sorted(gr),
                      "dgrad": max(float((gt[n] - g).abs().max() / g.abs().max()) for n, g in gr.items()),
                      "dalpha": max(float((a - b).abs().max()) for a, b in zip(at, ar, strict=True))}))


def test_the_triton_backend_agrees_in_its_interpreter():
    """P-LR keys, 4 depth heads, whole-key norm, key gains, rms summaries, a count prior: reads site by site,
    two-phase groups and partial merges (the keys reach the kernels normalised, the kernels' norm off)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS_DIR)}
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grads"] and result["dlogit"] < 1e-12 and result["dgrad"] < 1e-10 and result["dalpha"] < 1e-12, result


# ---- accounting, optimizer, the paper's code, errors ------------------------------------------------------------
@pytest.mark.parametrize("case, expected", [
    ("mhar-h4", 2 * M * D),  # the queries and the key gains, [2L, d] each
    ("rms-value", M * D),  # rms summaries add no parameter
    ("mhar-sliced-block", 2 * M * 16),
    ("rms-projected-h2", M * 16 + SIZE.n_layers * 16 * (D + SIZE.d_mlp) + 16 * D),  # docs/method.md §3's P-LR count
])
def test_parameter_counts(case, expected):
    """Analytic count = the router's parameters (+ P-LR's key rows, in the output projections) = accounting's."""
    cfg = case_config(case)
    model = build_decoder(cfg)
    rows = SIZE.n_layers * 16 * (D + SIZE.d_mlp) if cfg.options.key_source == "projected" else 0
    assert routing_params(cfg) == expected == sum(p.numel() for p in model.router.parameters()) + rows
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_adamw_takes_the_key_gains():
    model = build_decoder(case_config("mhar-h4"))
    muon, _ = split_parameters(model)
    assert not any(p is q for p in model.router.parameters() for q in muon)
    assert model.router.key_gain.shape == (M, D)


@pytest.mark.parametrize("name", ["attnres-block-n8-rms", "attnres-block-size4-rms", "s-lr-block-n8-r64-rms", "mhar-h4"])
def test_the_papers_code_cannot_express_them(name):
    from lrattn_lightning.tools.fidelity.interface import reference_flags

    with pytest.raises(NotExpressible):
        reference_flags(REGISTRY.model("small", name))


@pytest.mark.parametrize("fields, message", [
    ({"depth_head_norm": "whole"}, "field 'depth_head_norm': 'whole' is not one of ['per_head', 'full']"),
    ({"key_gain": 1}, "field 'key_gain': must be true or false, got 1"),
    ({"block_summary": "rms"}, "field 'block_summary': 'rms' normalises the outputs of completed blocks"),
    ({"key_gain": True, "key_norm": "none"}, "field 'key_gain': "),
])
def test_a_bad_value_is_one_line(fields, message):
    raw = {"sizes": {}, "ablations": {"x": {"doc": "d", "control": None, "routing": "attnres", **fields}}}
    with pytest.raises(InputError) as err:
        parse_registry(raw)
    assert message in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("ablations.x")


if __name__ == "__main__":
    _triton_worker()
