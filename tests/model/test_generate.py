"""Generation with the KV cache equals full recomputation, for every registry ablation (tiny, CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import ALL_ABLATIONS, randomize_routing, tiny_config, tokens

from lrattn_lightning.model.attention import KVCache
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.generate import generate, sample_next


def _model(registry, name):
    model = build_decoder(tiny_config(registry, name)).eval()
    randomize_routing(model)  # non-uniform routing, so the depth reads matter
    return model


@pytest.mark.parametrize("name", ALL_ABLATIONS)
def test_kv_cache_greedy_generation_equals_recomputation(registry, name):
    model = _model(registry, name)
    prompt = tokens(model.cfg.size.vocab_size, batch=2, length=5)
    cached = generate(model, prompt, 20, use_cache=True)
    recomputed = generate(model, prompt, 20, use_cache=False)
    assert cached.shape == (2, 20)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("name", ["baseline", "s-lr-block-n8-r64", "p-lr-full-r32", "gated-residual"])
def test_incremental_logits_equal_full_forward(registry, name):
    """Prefill 7 tokens, then feed 3 + 1 + 1: every position's logits equal one full forward."""
    model = _model(registry, name)
    idx = tokens(model.cfg.size.vocab_size, batch=2, length=12)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.empty(len(model.layers))
        parts = [model(idx[:, a:b], cache=cache) for a, b in ((0, 7), (7, 10), (10, 11), (11, 12))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)
    assert cache.length == 12


@pytest.mark.parametrize("name", ["s-lr-block-n8-r64", "gated-residual"])
def test_sampled_generation_is_seeded_and_cache_independent(registry, name):
    model = _model(registry, name)
    prompt = tokens(model.cfg.size.vocab_size, batch=3, length=4)

    def run(use_cache, seed=7, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(model, prompt, 16, use_cache=use_cache, temperature=1.0, generator=g, **kw)

    assert torch.equal(run(True), run(False))
    assert torch.equal(run(True, top_k=5), run(False, top_k=5))
    assert not torch.equal(run(True), run(True, seed=8))


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])
    assert sample_next(logits).tolist() == [1, 0]  # temperature 0: argmax
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert sample_next(logits, 1.0, top_k=1, generator=g).tolist() == [1, 0]
        assert sample_next(logits, 1.0, top_p=1e-3, generator=g).tolist() == [1, 0]
        assert set(sample_next(logits, 5.0, top_k=2, generator=g).tolist()) <= {0, 1, 3}


def test_eos_and_stop_condition_end_rows(registry):
    model = _model(registry, "baseline")
    prompt = tokens(model.cfg.size.vocab_size, batch=2, length=3)
    free = generate(model, prompt, 10)
    eos = int(free[0, 2])  # row 0 emits this token at step 2: use it as EOS
    out = generate(model, prompt, 10, eos_id=eos)
    assert out[0, 2] == eos and (out[0, 2:] == eos).all()
    stopped = generate(model, prompt, 10, should_stop=lambda new: torch.full((new.shape[0],), new.shape[1] >= 4))
    assert stopped.shape == (2, 4) and torch.equal(stopped, free[:, :4])
    with pytest.raises(ValueError, match="exceeds seq_len"):
        generate(model, prompt, model.cfg.size.seq_len)


def test_a_request_that_fills_the_window_exactly_is_served(registry):
    """The last new token is returned, never fed back: prompt + new tokens may be seq_len + 1 long."""
    model = _model(registry, "s-lr-block-n8-r64")
    L = model.cfg.size.seq_len
    prompt = tokens(model.cfg.size.vocab_size, batch=2, length=L - 1)
    out = generate(model, prompt, 2)
    assert out.shape == (2, 2)
    assert torch.equal(out, generate(model, prompt, 2, use_cache=False))
    assert generate(model, tokens(model.cfg.size.vocab_size, batch=1, length=L), 1).shape == (1, 1)
    with pytest.raises(ValueError, match=f"needs {L + 1} positions"):
        generate(model, prompt, 3)
