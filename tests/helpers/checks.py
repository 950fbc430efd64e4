"""Checks every routing kind's tests make of a tiny model: what flows between its named parts (capture), causality
and KV-cache decoding, a float64 gradcheck of the router, bf16 autocast against float32."""

from __future__ import annotations

import dataclasses

import torch

from helpers.models import tokens


@dataclasses.dataclass
class Trace:
    emb: torch.Tensor  # o_0 [B, T, D]
    inputs: list[torch.Tensor]  # RMSNorm(h_j) fed to sublayer j + 1, j = 0..2L-1
    outputs: list[torch.Tensor]  # o_1 .. o_2L as the sublayers return them ([B, T, D] or [B, T, D + r])
    final: torch.Tensor  # RMSNorm(h_2L) fed to the head
    logits: torch.Tensor
    routing: list[torch.Tensor] | None  # alpha per site j = 1..2L (attnres only)


def capture(model: torch.nn.Module, idx: torch.Tensor) -> Trace:
    """Run the decoder, recording through module hooks only what flows between its named parts."""
    emb, inputs, outputs, final = [], [], [], []
    handles = [model.embed.register_forward_hook(lambda m, a, out: emb.append(out.detach()))]

    def record(module, args, out):
        inputs.append(args[0].detach())
        outputs.append(out.detach())

    for layer in model.layers:
        handles += [layer.attn.register_forward_hook(record), layer.mlp.register_forward_hook(record)]
    handles.append(model.head.register_forward_pre_hook(lambda m, args: final.append(args[0].detach())))
    try:
        out = model(idx, return_routing=True)
    finally:
        for h in handles:
            h.remove()
    return Trace(emb[0], inputs, outputs, final[0], out.logits.detach(), out.routing)


def assert_causal_and_decodes_with_the_kv_cache(model: torch.nn.Module, length: int = 12, at: int = 7) -> None:
    """Changing token `at` moves no logit before it, and greedy decoding with the KV cache gives the tokens of
    full recomputation (a router's own decoding state, or none, is right)."""
    from lrattn_lightning.model.generate import generate

    vocab = model.cfg.size.vocab_size
    idx = tokens(vocab, batch=2, length=length)
    with torch.no_grad():
        full = model(idx)
        changed = idx.clone()
        changed[:, at] = (changed[:, at] + 1) % vocab
        torch.testing.assert_close(model(changed)[:, :at], full[:, :at], rtol=0, atol=0)
    prompt = idx[:, :4]
    assert torch.equal(generate(model, prompt, 10, use_cache=True), generate(model, prompt, 10, use_cache=False))


def assert_router_gradcheck(model: torch.nn.Module, idx: torch.Tensor) -> None:
    """float64 gradcheck of every router parameter through the whole decoder (a loss that weighs all logits)."""
    names = [n for n, _ in model.router.named_parameters()]

    def loss(*params):
        state = {f"router.{n}": p for n, p in zip(names, params, strict=True)}
        logits = torch.func.functional_call(model, state, (idx,))
        return logits.square().mean() + logits[..., :3].sum()

    inputs = tuple(p.detach().clone().requires_grad_() for p in model.router.parameters())
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6)


def assert_bf16_autocast_close(model: torch.nn.Module, idx: torch.Tensor) -> None:
    """Under CPU bf16 autocast the logits stay within 10 % of the float32 ones' largest magnitude."""
    with torch.no_grad():
        exact = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(idx).float()
    assert (low - exact).abs().max() < 0.1 * exact.abs().max()
