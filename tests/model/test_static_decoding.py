"""The static KV cache and its compiled decode step (model/generate.py `cache="static"`, issue 54): the same greedy
tokens as the dynamic cache, for every routing kind that supports it; one graph for every step (no recompile, no
graph break)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import ALL_ABLATIONS, randomize_routing, tiny_config, tokens

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.attention import KVCache, StaticKVCache
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.generate import generate

PAPER = ["baseline", "s-lr-block-n8-r64", "p-lr-block-n8-r32", "attnres-block-n8", "attnres-full"]


def _model(registry, name):
    torch.manual_seed(0)
    model = build_decoder(tiny_config(registry, name)).eval()
    randomize_routing(model)  # non-uniform routing, so the depth reads matter
    return model


def _keeps_own_cache(model) -> bool:
    new_cache = getattr(model.router, "new_cache", None)
    return callable(new_cache) and new_cache() is not None


@pytest.mark.parametrize("name", ALL_ABLATIONS)
def test_static_cache_greedy_tokens_equal_dynamic(registry, name):
    model = _model(registry, name)
    prompt = tokens(model.cfg.size.vocab_size, batch=2, length=5)
    if _keeps_own_cache(model):  # the gated residual's running means: the dynamic cache only
        with pytest.raises(InputError, match="dynamic cache"):
            generate(model, prompt, 4, cache="static")
        return
    dynamic = generate(model, prompt, 20, cache="dynamic")
    assert torch.equal(generate(model, prompt, 20, cache="static"), dynamic)
    assert torch.equal(generate(model, prompt[:, :3], 20, cache="static"), generate(model, prompt[:, :3], 20))


@pytest.mark.parametrize("name", ["baseline", "s-lr-block-n8-r64"])
def test_static_logits_equal_full_forward(registry, name):
    """Prefill 7 tokens, then 3 + 1 + 1 into the static cache: every position's logits equal one full forward."""
    model = _model(registry, name)
    idx = tokens(model.cfg.size.vocab_size, batch=2, length=12)
    with torch.no_grad():
        full = model(idx)
        cache = StaticKVCache.for_model(model, 2, "cpu", torch.float32)
        parts = [model(idx[:, a:b], cache=cache) for a, b in ((0, 7), (7, 10), (10, 11), (11, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)
    assert int(cache.position) == 12


def test_static_cache_with_document_masking(registry):
    """Separators in the prompt and in the new tokens: the static mask keeps each document apart as the dynamic
    path does."""
    model = _model(registry, "s-lr-block-n8-r64")
    model.doc_separator = 3
    idx = tokens(model.cfg.size.vocab_size, batch=2, length=12)
    idx[0, 2], idx[1, 6], idx[0, 9] = 3, 3, 3
    with torch.no_grad():
        full = model(idx)
        dyn, static = KVCache.empty(len(model.layers)), StaticKVCache.for_model(model, 2, "cpu", torch.float32)
        parts_dyn = [model(idx[:, a:b], cache=dyn) for a, b in ((0, 5), (5, 9), (9, 10), (10, 12))]
        parts = [model(idx[:, a:b], cache=static) for a, b in ((0, 5), (5, 9), (9, 10), (10, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), torch.cat(parts_dyn, dim=1), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)
    prompt = idx[:, :6]
    assert torch.equal(generate(model, prompt, 16, cache="static"), generate(model, prompt, 16))


@pytest.mark.parametrize(("name", "backend"), [(n, "aot_eager") for n in PAPER] + [("s-lr-block-n8-r64", "inductor")])
def test_compiled_static_step_equals_dynamic_without_recompiling(registry, name, backend):
    """The decode step compiled with fullgraph=True (a graph break raises) and static shapes gives today's greedy
    tokens; a second generation, a different prompt length and every step reuse the one graph (a recompile
    raises). aot_eager traces what Inductor would compile (a graph break or a recompile shows alike); one entry
    also through Inductor (~40 s on a 2-core CPU)."""
    torch._dynamo.reset()
    model = _model(registry, name)
    prompt = tokens(model.cfg.size.vocab_size, batch=1, length=5)
    dynamic = generate(model, prompt, 24)
    options = {"cache": "static", "compile": True, "compile_backend": backend}
    assert torch.equal(generate(model, prompt, 24, **options), dynamic)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(generate(model, prompt[:, :2], 24, **options), generate(model, prompt[:, :2], 24))
