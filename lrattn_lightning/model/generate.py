"""Autoregressive generation with the Decoder's own forward, with or without its KV cache.

Depth routing is per token: the read at site j for token t mixes only token t's own sublayer
outputs. So an incremental step needs the token attention's cached keys/values of earlier
positions (`attention.KVCache`, one entry per layer) and nothing else; the gated residual's causal
means continue from cached running sums. `generate(..., use_cache=True)` prefills the cache with
the prompt, then feeds one token per step; `use_cache=False` recomputes the whole window every
step. Both call `Decoder.forward`, so greedy decoding gives the same tokens either way (tested for
every registry ablation).

`cache="static"` (issue 54): an `attention.StaticKVCache` of fixed shape, written in place at a position tensor,
the attention over the whole buffer under a mask, so a one-token step has the same shapes at every position:
`compile=True` compiles it once (fullgraph, no recompiles across steps; mode reduce-overhead, CUDA graphs, on
CUDA), replacing a step's hundreds of Python-driven launches by one graph replay. The same greedy tokens as the
dynamic cache (tests/model/test_static_decoding.py) for every router that keeps no decoding state of its own
(all but the gated residual). On CPU (size small, batch 1, one thread, loaded 2-core AMD EPYC): baseline 53 ->
74 (static) -> 84 tok/s (static, Inductor), S-LR see docs/benchmarks.md; the GPU's ratio is gpu-check's rows.


Measured (size small, random init, 16-token prompt + 240 greedy tokens = 256 positions, CPU, one
torch thread on a shared 2-core machine, best of 3): cache vs recompute 1.9 s vs 5.2 s (2.7x) for
baseline, 2.4 s vs 10.3 s (4.3x) for s-lr-block-n8-r64, 2.9 s vs 11.0 s (3.9x) attnres-full, 2.7 s vs
10.6 s (3.9x) p-lr-block-n8-r32, 4.8 s vs 16.8 s (3.5x) gated-residual; identical tokens in every case.
At d=128 a cached step is bound by per-op overhead (~8 ms for 16 sublayers), so the ratio grows with
width and with sequence length (recomputation is O(T) per step, the cached step O(1) in compute).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.attention import KVCache, StaticKVCache
from lrattn_lightning.model.decoder import Decoder, build_router

CACHES = ("dynamic", "static", "none")  # generate_stream's `cache`: how earlier positions are kept
COMPILE_BACKEND = "inductor"  # torch.compile's backend for the static decode step, unless a caller names one


def sample_next(
    logits_BV: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token per row [B]: argmax when temperature == 0, else a draw from the tempered,
    top-k / nucleus (top-p) filtered softmax."""
    if temperature <= 0.0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class StaticDecoding:
    """A model's StaticKVCache and its decode step, kept across generate calls (`static_decoding`).

    prefill(prompt) runs the prompt through the forward eagerly (any length); step(token) feeds one token per row
    through `step_fn`, the same forward compiled once with fullgraph=True and static shapes when `compile`
    (mode "reduce-overhead", CUDA graphs, on CUDA): the position lives in a tensor, so every step replays the one
    graph. The returned logits may be a CUDA graph's output, overwritten by the next step: read them first.
    """

    def __init__(self, model: Decoder, batch: int, device: torch.device, dtype: torch.dtype, *,
                 compile: bool = False, mode: str | None = None, backend: str = "inductor") -> None:
        self.model = model
        self.cache = StaticKVCache.for_model(model, batch, device, dtype)
        stepper = _traceable_twin(model) if compile else model

        def step_fn(token_B1: Tensor) -> Tensor:
            return stepper(token_B1, cache=self.cache)[:, -1]  # (B, V)

        if compile and mode is None and device.type == "cuda" and backend == "inductor":  # (a mode is Inductor's)
            mode = "reduce-overhead"
        self.step_fn = torch.compile(step_fn, fullgraph=True, dynamic=False, mode=mode, backend=backend) \
            if compile else step_fn

    def prefill(self, prompt_BT: Tensor) -> Tensor:
        self.cache.reset()
        return self.model(prompt_BT, cache=self.cache)[:, -1]

    def step(self, token_B: Tensor) -> Tensor:
        return self.step_fn(token_B[:, None])


def supports_static(model: Decoder) -> bool:
    """Whether the model's router decodes with the static cache: it keeps no decoding state of its own."""
    return model.router.new_cache() is None


def _traceable_twin(model: Decoder) -> Decoder:
    """The model itself, or where its AttnRes backend cannot be traced (`fast`) a twin sharing every module and
    parameter whose router is the backend's compiled substitute (the kind's resolve_impl; the same
    parameters, assigned, so the same tensors; the same results)."""
    impl = model.cfg.kind.resolve_impl(model.cfg, model.impl, compiled=True)
    if impl == model.impl:
        return model
    param = next(model.parameters())
    router = build_router(model.cfg, impl).to(device=param.device, dtype=param.dtype)
    router.load_state_dict(model.router.state_dict(), assign=True)
    router.train(model.router.training)
    twin = copy.copy(model)
    twin.__dict__ = dict(model.__dict__, _modules=dict(model._modules, router=router), impl=impl)
    return twin


def static_decoding(model: Decoder, batch: int, device: torch.device, *, compile: bool = False,
                    backend: str = "inductor") -> StaticDecoding:
    """The model's StaticDecoding for this batch, device, cache dtype (autocast's where it is on) and compile
    choice, made once and kept on the model (a compiled step is compiled once)."""
    param_dtype = next(model.parameters()).dtype
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else param_dtype
    key = (batch, str(device), dtype, compile, backend)
    kept = model.__dict__.setdefault("_static_decodings", {})
    if key not in kept:
        kept[key] = StaticDecoding(model, batch, device, dtype, compile=compile, backend=backend)
    return kept[key]


@torch.no_grad()
def generate_stream(
    model: Decoder,
    prompt_BT: Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    cache: str | None = None,
    compile: bool = False,
    compile_backend: str | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    should_stop: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[Tensor]:
    """Yield the next token of every row [B] as it is decoded (see `generate` for the rules).

    cache: `dynamic` (KVCache, grown by concatenation), `static` (StaticKVCache and a fixed-shape step, compiled
    when `compile` by torch.compile's `compile_backend`, default COMPILE_BACKEND) or `none` (recompute the window
    every step); default: `dynamic`, or `none` where use_cache=False."""
    cache = cache or ("dynamic" if use_cache else "none")
    if cache not in CACHES:
        raise InputError(f"cache must be one of {list(CACHES)}, got {cache!r}")
    B, T = prompt_BT.shape
    seq_len = model.cfg.size.seq_len
    if T < 1:
        raise InputError("generate needs a prompt of at least one token")
    if T + max_new_tokens - 1 > seq_len:  # the last new token is returned, never fed back
        raise InputError(f"prompt of {T} tokens + {max_new_tokens} new tokens needs {T + max_new_tokens - 1} "
                         f"positions, which exceeds seq_len={seq_len}; shorten the prompt or max_new_tokens")
    static = None
    if cache == "static":
        static = static_decoding(model, B, prompt_BT.device, compile=compile,
                                 backend=compile_backend or COMPILE_BACKEND)
        logits = static.prefill(prompt_BT)
        kv = None
    else:
        kv = KVCache.empty(len(model.layers)) if cache == "dynamic" else None
        logits = model(prompt_BT, cache=kv)[:, -1]  # prefill: (B, V)
    done = torch.zeros(B, dtype=torch.bool, device=prompt_BT.device)
    may_stop = eos_id is not None or should_stop is not None  # else no host read of `done` per step
    new: list[Tensor] = []
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
            done = done | (token == eos_id)
        new.append(token)
        yield token
        if should_stop is not None:
            done = done | should_stop(torch.stack(new, dim=1))
        if step == max_new_tokens - 1 or (may_stop and bool(done.all())):
            break
        if static is not None:
            logits = static.step(token)
        elif kv is not None:
            logits = model(token[:, None], cache=kv)[:, -1]
        else:
            logits = model(torch.cat((prompt_BT, torch.stack(new, dim=1)), dim=1))[:, -1]


@torch.no_grad()
def generate(model: Decoder, prompt_BT: Tensor, max_new_tokens: int, **options: Any) -> Tensor:
    """Continue each row of `prompt_BT` (equal lengths, no padding) -> new tokens [B, n], n <= max_new_tokens.

    A row is finished when it emits `eos_id` or when `should_stop(new_BN)` (a bool [B]) says so;
    finished rows are filled with `eos_id` (or keep being decoded when there is none) and decoding
    stops once every row is finished. Prompt plus new tokens must fit the model's seq_len.
    Options: use_cache, cache (dynamic, static, none), compile (the static step), temperature, top_k, top_p,
    generator, eos_id, should_stop.
    """
    new = list(generate_stream(model, prompt_BT, max_new_tokens, **options))
    if not new:
        return prompt_BT.new_empty(prompt_BT.shape[0], 0)
    return torch.stack(new, dim=1)
