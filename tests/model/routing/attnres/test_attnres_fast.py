"""The AttnRes backends `fast` (attnres/fast.py) and `compiled` (attnres/compiled.py) against `reference`.

Both are checked in eager mode: `fast`, the buffered autograd Functions, and `compiled`, the plain tensor
ops Inductor compiles. Parity covers logits, every parameter gradient and the recorded routing weights,
with routing made non-uniform (random queries), for every attnres registry entry plus a grid of
full/block routing x every key source x depth heads 1 and 4 x block summaries and count prior.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import randomize_routing

from lrattn_lightning.model.attention import KVCache
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder, build_router
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.model.routing.attnres import AttnResOptions, compile_impl
from lrattn_lightning.model.routing.attnres.backends import PORTABLE_IMPLS as IMPLS
from lrattn_lightning.model.routing.attnres.compiled import CompiledAttnRes
from lrattn_lightning.model.routing.attnres.fast import FastAttnRes
from lrattn_lightning.model.routing.attnres.reference import ReferenceAttnRes

torch.set_num_threads(1)

REGISTRY = load_registry()
# three layers: M = 6 sublayers, so block counts give uneven blocks (N=4 ends after 2, 3, 5, 6)
SIZE = SizeConfig(name="tiny-l3", doc="tests", n_layers=3, d_model=32, n_heads=2, d_mlp=48, vocab_size=97, seq_len=16)
ATTNRES = [n for n, a in REGISTRY.ablations.items() if a.routing == "attnres"]

_BASE = REGISTRY.ablation("attnres-full")
_EMBEDDING_KEY = {"value": "value", "sliced": "sliced", "projected": "projected",
                  "value_projected": "projected", "value_projected_shared": "static"}


def _grid() -> dict[str, AblationConfig]:
    """Full and block routing x every key source x depth heads 1 and 4, with varied summaries and priors."""
    out = {}
    for key_source, emb in _EMBEDDING_KEY.items():
        for blocks in (None, 4):
            for heads in (1, 4):
                summary, prior = ("mean", 1.0) if heads == 4 else ("sqrt_mean", 0.0)
                name = f"grid-{key_source}-{'block' if blocks else 'full'}-h{heads}"
                out[name] = _BASE.replace(
                    name=name, key_source=key_source, embedding_key=emb, depth_heads=heads,
                    rank=None if key_source == "value" else 16, blocks=blocks, block_summary=summary,
                    count_prior=prior,
                    logit_scale="inv_sqrt_head_dim" if heads == 4 and key_source != "value" else "none",
                )
    return out


GRID = _grid()


def _config(name: str) -> ModelConfig:
    ablation = GRID[name] if name in GRID else fit_to_size(REGISTRY.ablation(name), SIZE)
    return ModelConfig(SIZE, ablation)


def _run(model, idx, *, dtype=torch.float32, autocast=False):
    model.zero_grad(set_to_none=True)
    if autocast:  # float32 weights, bfloat16 matmuls: sublayer outputs bfloat16, the embedding float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.to(dtype)(idx, return_routing=True)
    else:
        out = model.to(dtype)(idx, return_routing=True)
    wide = torch.promote_types(dtype, torch.float32)  # results compared in float32 (float64 models: float64)
    loss = out.logits.to(wide).square().mean() + out.logits.to(wide)[..., :3].sum()
    loss.backward()
    grads = {n: p.grad.to(wide).clone() for n, p in model.named_parameters()}
    return out.logits.detach().to(wide), grads, out.routing


def _pair(name: str, dtype=torch.float32, impl: str = "fast"):
    """The reference model and an `impl` model loaded from its state_dict (the two must be interchangeable)."""
    cfg = _config(name)
    torch.manual_seed(0)
    ref = build_decoder(cfg, impl="reference")
    randomize_routing(ref)  # random queries, query gates and static keys: routing far from uniform
    other = build_decoder(cfg, impl=impl)
    other.load_state_dict(ref.state_dict())  # strict: same parameter names in every backend
    return ref.to(dtype), other.to(dtype)


IDX = torch.randint(0, SIZE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def _served(names: list[str], impls=IMPLS) -> list[tuple[str, str]]:
    """(entry, backend) pairs a decoder builds for: `fast` refuses per-token queries (gated_dynamic) by name."""
    return [(n, i) for n in names for i in impls if not (i == "fast" and n.endswith("-dynquery"))]


@pytest.mark.parametrize(("name", "impl"), _served(ATTNRES + list(GRID), ("fast", "compiled")))
def test_backend_matches_reference_float32(name, impl):
    """Every AttnRes registry entry (and the grid): equal forward, backward and routing weights."""
    ref, fast = _pair(name, impl=impl)
    logits_r, grads_r, routing_r = _run(ref, IDX)
    logits_f, grads_f, routing_f = _run(fast, IDX)
    torch.testing.assert_close(logits_f, logits_r, rtol=1e-5, atol=1e-5)
    assert grads_f.keys() == grads_r.keys()
    for n, g in grads_r.items():
        scale = g.abs().max().item()  # float32 summation order differs: tolerance relative to the tensor
        torch.testing.assert_close(grads_f[n], g, rtol=1e-4, atol=5e-5 * scale, msg=lambda m, n=n: f"grad {n}: {m}")
    # diagnostics: one alpha [S_j, B, T, M] per site j = 1..2L, sources ordered embedding, blocks, partial
    assert len(routing_f) == len(routing_r) == SIZE.n_sublayers
    for a_f, a_r in zip(routing_f, routing_r, strict=True):
        assert a_f.shape == a_r.shape and not a_f.requires_grad
        torch.testing.assert_close(a_f, a_r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a_f.sum(0), torch.ones_like(a_f[0]))


@pytest.mark.parametrize("impl", ["fast", "compiled"])
@pytest.mark.parametrize("name", ["s-lr-block-n8-r64", "p-lr-block-n4-r32", "attnres-full", "attnres-block-n4",
                                  "vp-lr-block-n8-r32", "grid-sliced-block-h4", "grid-projected-full-h4",
                                  "s-lr-block-n8-r64-refdefault"])
def test_backend_matches_reference_bfloat16(name, impl):
    """In bfloat16 both impls round differently; each must be about as close to the float32 truth.

    (Not the qnorm-normal entry: normalised queries give logits up to ~r, a near-argmax softmax whose
    bfloat16 gradients are chaotic; the reference itself is ~40 % off its float32 gradients there.)"""
    ref, fast = _pair(name, impl=impl)
    logits_t, grads_t, _ = _run(ref, IDX)  # float32 truth
    logits_r, grads_r, _ = _run(ref, IDX, dtype=torch.bfloat16)
    logits_f, grads_f, _ = _run(fast, IDX, dtype=torch.bfloat16)

    def err(x, truth):
        return ((x - truth).norm() / (truth.norm() + 1e-12)).item()

    assert err(logits_f, logits_t) <= 2 * err(logits_r, logits_t) + 2e-3
    for n, g in grads_t.items():
        assert err(grads_f[n], g) <= 2 * err(grads_r[n], g) + 2e-2, n


@pytest.mark.parametrize("impl", ["fast", "compiled"])
@pytest.mark.parametrize("name", ["s-lr-block-n8-r64", "p-lr-block-n4-r32", "attnres-full", "attnres-block-n4",
                                  "vp-lr-block-n8-r32", "grid-sliced-block-h4", "grid-projected-full-h4"])
def test_backend_matches_reference_under_bfloat16_autocast(name, impl):
    """`--trainer.precision bf16-mixed`: float32 weights and embedding, bfloat16 sublayer outputs, so a read
    mixes float32 and bfloat16 sources (block partials included). Each backend must run and be about as close
    to the float32 truth as the reference under the same autocast."""
    ref, other = _pair(name, impl=impl)
    logits_t, grads_t, _ = _run(ref, IDX)  # float32 truth
    logits_r, grads_r, _ = _run(ref, IDX, autocast=True)
    logits_o, grads_o, _ = _run(other, IDX, autocast=True)

    def err(x, truth):
        return ((x - truth).norm() / (truth.norm() + 1e-12)).item()

    assert err(logits_o, logits_t) <= 2 * err(logits_r, logits_t) + 2e-3
    for n, g in grads_t.items():
        assert err(grads_o[n], g) <= 2 * err(grads_r[n], g) + 2e-2, n


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["baseline", "gated-residual"])
def test_non_attnres_routing_ignores_the_backend(name, impl):
    ref, other = _pair(name, impl=impl)
    assert type(other.router) is type(ref.router)
    torch.testing.assert_close(_run(other, IDX)[0], _run(ref, IDX)[0], rtol=0, atol=0)


def test_fast_is_the_default_and_state_dicts_are_interchangeable():
    cfg = _config("p-lr-block-n8-r32")
    fast, ref, comp = build_decoder(cfg), build_decoder(cfg, impl="reference"), build_decoder(cfg, impl="compiled")
    assert (type(fast.router), type(ref.router), type(comp.router)) == (FastAttnRes, ReferenceAttnRes, CompiledAttnRes)
    assert fast.state_dict().keys() == ref.state_dict().keys() == comp.state_dict().keys()
    ref.load_state_dict(fast.state_dict())
    with pytest.raises(ValueError, match="impl"):
        build_decoder(cfg, impl="fused")


def test_the_default_backend_serves_every_registry_entry():
    """`fast` builds and runs every entry; the gated dynamic query it serves with `compiled`'s class."""
    size = REGISTRY.size("tiny")
    idx = torch.randint(0, size.vocab_size, (1, 4))
    for name, ablation in REGISTRY.ablations.items():
        model = build_decoder(ModelConfig(size, fit_to_size(ablation, size)))
        assert model(idx).shape == (1, 4, size.vocab_size), name
        if getattr(ablation.options, "query", None) == "gated_dynamic":
            assert type(model.router) is CompiledAttnRes


def test_the_kind_resolves_impl_once_and_never_swaps_a_named_backend():
    """`auto` (the default) takes `compiled` for the gated dynamic query and `fast` elsewhere; `fast` asked for by
    name for per-token queries is one line naming `compiled`, never another backend in its place."""
    from lrattn_lightning.core.errors import InputError

    dynamic, static = _config("p-lr-block-n8-r32-dynquery"), _config("p-lr-block-n8-r32")
    assert build_decoder(dynamic).impl == "compiled" and build_decoder(static).impl == "fast"
    assert build_decoder(static, compiled=True).impl == "compiled"
    assert dynamic.kind.resolve_impl(dynamic, "auto", compiled=True) == "compiled"
    for ask in (lambda: build_decoder(dynamic, impl="fast"), lambda: build_router(dynamic, "fast")):
        with pytest.raises(InputError) as info:
            ask()
        message = str(info.value)
        assert "\n" not in message and "'fast'" in message and "'compiled'" in message and "gated_dynamic" in message


def _one_line_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and "'fast'" in message and "'compiled'" in message, message
    return message


def test_unsupported_cases_raise_one_line_naming_the_backend_that_can():
    import torch._dynamo

    dynamic = _config("p-lr-block-n8-r32-dynquery")
    assert "gated_dynamic" in _one_line_error(lambda: FastAttnRes(dynamic))
    fast = build_router(_config("s-lr-block-n8-r64"), "fast")
    emb = torch.randn(1, 4, SIZE.d_model)
    traced = torch.compile(lambda x: fast.read(fast.start(x), 0), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        traced(emb)
    assert "backend 'fast' cannot run under torch.compile" in str(info.value)
    assert [compile_impl(i) for i in IMPLS] == ["compiled", "reference", "compiled"]


def test_the_backend_table_answers_where_a_backend_runs_and_which_runs(monkeypatch):
    """Callers ask the table (backends.py), never a backend's name: the portable backends run on any device;
    triton's answer is its own check's (CUDA, or TRITON_INTERPRET=1); only triton's own kernels need a parity check
    before a benchmark times them; an unknown name is one line."""
    from lrattn_lightning.core.errors import InputError
    from lrattn_lightning.model.routing.attnres import availability, needs_parity_check, resolve_impl

    pytest.importorskip("triton")
    for impl in IMPLS:
        assert availability(impl) is None and availability(impl, "cuda") is None
        assert availability(impl, torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert availability("triton", "cuda") is None
    why = availability("triton", torch.device("cpu"))
    assert why.startswith("model.impl 'triton' needs a CUDA GPU, or TRITON_INTERPRET=1") and "\n" not in why
    assert availability("triton") == (None if torch.cuda.is_available() else why)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read when asked: the interpreter serves CPU tensors)
    assert availability("triton", "cpu") is None
    assert [resolve_impl(i) for i in (*IMPLS, "triton")] == [*IMPLS, "triton"]
    assert [resolve_impl(i, compiled=True) for i in (*IMPLS, "triton")] == ["compiled", "reference", "compiled",
                                                                             "triton"]
    assert [needs_parity_check(i) for i in (*IMPLS, "triton")] == [False, False, False, True]
    for ask in (lambda: availability("fsat", "cpu"), lambda: resolve_impl("fsat"), lambda: needs_parity_check("fsat")):
        with pytest.raises(InputError, match=r"^impl: unknown AttnRes backend 'fsat' \(closest: fast"):
            ask()


@pytest.mark.parametrize(("name", "impl"), _served(["s-lr-block-n8-r64", "p-lr-full-r32", "attnres-block-n4",
                                                    "p-lr-block-n8-r32-dynquery"]))
def test_kv_cache_decoding_matches_full_forward(name, impl):
    ref, other = _pair(name, impl=impl)
    model = ref if impl == "reference" else other
    with torch.no_grad():
        full = model(IDX)
        cache = KVCache.empty(SIZE.n_layers)
        steps = [model(IDX[:, :5], cache=cache)]
        steps += [model(IDX[:, t : t + 1], cache=cache) for t in range(5, IDX.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_buffers_do_not_leak_between_steps():
    """Two training steps in a row give the same gradients as two fresh models (buffers are per pass)."""
    _, fast = _pair("s-lr-block-n8-r64")
    first = _run(fast, IDX)[1]
    second = _run(fast, IDX)[1]
    for n, g in first.items():
        torch.testing.assert_close(second[n], g, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "impl"), _served(["s-lr-block-n8-r64-refdefault", "p-lr-block-n4-r32", "attnres-full",
                                                    "vp-lr-block-n8-r32", "grid-sliced-block-h4",
                                                    "p-lr-block-n8-r32-dynquery"]))
def test_repeated_backward_accumulates_exactly(name, impl):
    """backward(retain_graph=True) twice gives twice the gradients of one backward (no stale buffers)."""
    ref, fast = _pair(name, impl=impl)
    model = ref if impl == "reference" else fast
    once = _run(model, IDX)[1]
    model.zero_grad(set_to_none=True)
    logits = model(IDX)
    loss = logits.float().square().mean() + logits.float()[..., :3].sum()
    loss.backward(retain_graph=True)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n], rtol=1e-5, atol=1e-6 * once[n].abs().max().item(),
                                   msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize("name", ["s-lr-block-n8-r64-refdefault", "p-lr-block-n4-r32", "attnres-block-n4",
                                  "vp-shared-lr-block-n8-r32", "grid-projected-full-h4"])
def test_float64_models_route_in_float64(name):
    """A float64 model routes in float64: every backend agrees to ~1e-12, and KV-cache decoding
    reproduces the full forward to ~1e-12 (a float32 softmax anywhere would show at ~1e-7)."""
    ref, fast = _pair(name, dtype=torch.float64)
    _, comp = _pair(name, dtype=torch.float64, impl="compiled")
    with torch.no_grad():
        out_r = ref(IDX, return_routing=True)
        assert out_r.logits.dtype == torch.float64
        for model in (fast, comp):
            torch.testing.assert_close(model(IDX), out_r.logits, rtol=1e-12, atol=1e-12)
        for model in (ref, fast, comp):
            cache = KVCache.empty(SIZE.n_layers)
            steps = [model(IDX[:, :5], cache=cache)]
            steps += [model(IDX[:, t : t + 1], cache=cache) for t in range(5, IDX.shape[1])]
            torch.testing.assert_close(torch.cat(steps, dim=1), out_r.logits, rtol=1e-12, atol=1e-12)
    logits64, grads64, _ = _run(fast, IDX, dtype=torch.float64)
    _, grads_ref64, _ = _run(ref, IDX, dtype=torch.float64)
    for n, g in grads_ref64.items():
        torch.testing.assert_close(grads64[n], g, rtol=1e-10, atol=1e-12 * max(1.0, g.abs().max().item()))


# ---- torch.compile ----------------------------------------------------------------------------------
def _signature(a: AblationConfig) -> tuple:
    """The code path an ablation takes (rank and block count change no control flow)."""
    o = a.options
    if not isinstance(o, AttnResOptions):
        return (a.routing,)
    return (a.routing, o.key_source, o.embedding_key, o.key_norm, o.query_norm, o.is_block, o.block_summary,
            o.count_prior != 0, o.depth_heads > 1, o.logit_scale, o.query)


_BY_SIGNATURE: dict[tuple, str] = {}
for _name, _ablation in REGISTRY.ablations.items():
    _BY_SIGNATURE.setdefault(_signature(_ablation), _name)


def test_every_ablation_has_a_graph_break_check():
    assert {_signature(a) for a in REGISTRY.ablations.values()} == set(_BY_SIGNATURE)


@pytest.mark.parametrize("name", sorted(_BY_SIGNATURE.values()))
def test_no_graph_breaks(name):
    """Dynamo traces the tiny decoder of every ablation (one per code path) into one graph."""
    import torch._dynamo

    size = REGISTRY.size("tiny")
    model = build_decoder(ModelConfig(size, fit_to_size(REGISTRY.ablation(name), size)), impl="compiled")
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(torch.randint(0, size.vocab_size, (2, 8)))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_training_step_matches_reference():
    """Under torch.compile (aot_eager: the graphs AOTAutograd builds, without Inductor codegen) the
    `compiled` backend's values and gradients match the eager reference. Uneven blocks with partial reads
    and carried (projected) keys."""
    ref, fast = _pair("p-lr-block-n4-r32", impl="compiled")
    logits_r, grads_r, _ = _run(ref, IDX)
    compiled = torch.compile(fast, backend="aot_eager", fullgraph=True)
    fast.zero_grad(set_to_none=True)
    logits = compiled(IDX)
    (logits.float().square().mean() + logits.float()[..., :3].sum()).backward()
    torch.testing.assert_close(logits.detach(), logits_r, rtol=1e-5, atol=1e-5)
    for n, g in grads_r.items():
        torch.testing.assert_close(dict(fast.named_parameters())[n].grad, g, rtol=1e-4, atol=5e-5 * g.abs().max().item())
