"""The loss with the head fused in (train/losses.py head_token_losses): the [N, V] logits formed a chunk of rows at
a time, forward and backward. Against the unfused formula in float64 (x W^T, then ce and z), a float64 gradcheck,
every chunk boundary, bf16 autocast against the head + token_losses path, the module's two paths, torch.compile,
and the memory it holds: never the logits whole, at most a chunk's rows at a time."""

from __future__ import annotations

import pytest
import torch
from helpers.references import formula64

from lrattn_lightning.tools.bench.profiling import peak_allocated_bytes
from lrattn_lightning.train.lit_module import LRAttnModule
from lrattn_lightning.train.losses import IGNORE_INDEX, head_token_losses, token_losses

N, D, V = 24, 16, 301


def _case(dtype=torch.float64, n=N, d=D, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=g) * 2).to(dtype)
    w = (torch.randn(v, d, generator=g) + 0.5).to(dtype)  # logits ~ N(.., 8): lse far from 0, z's gradient counts
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = t[-1] = IGNORE_INDEX
    return x, w, t


def _grads(fn, x, w, t, a=0.7, b=0.3):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ce, z = fn(x, w, t)
    (a * ce + b * z).backward()
    return ce.detach(), z.detach(), x.grad, w.grad


@pytest.mark.parametrize("rows", [1, 5, 8, 23, 24, 25], ids=lambda r: f"{r}-rows")
def test_float64_losses_and_gradients_are_the_unfused_formula(rows):
    """Chunks of one row, chunks not dividing N (last chunk short), dividing it, N - 1, N and more than N."""
    x, w, t = _case()
    fused = _grads(lambda x, w, t: head_token_losses(x, w, t, chunk_bytes=rows * V * 8, max_chunks=10**6), x, w, t)
    formula = _grads(lambda x, w, t: formula64(x @ w.T, t), x, w, t)
    assert formula[1] > 10  # z not degenerate
    for a, b in zip(fused, formula, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_max_chunks_bounds_the_count():
    x, w, t = _case(n=100)
    for max_chunks, expected_rows in ((1, 100), (3, 34), (100, 1)):
        ce, _ = head_token_losses(x.requires_grad_(), w, t, chunk_bytes=1, max_chunks=max_chunks)
        assert ce.grad_fn.rows == expected_rows  # (the autograd node is the function's ctx)
        fused = _grads(lambda x, w, t, m=max_chunks: head_token_losses(x, w, t, chunk_bytes=1, max_chunks=m), x, w, t)
        formula = _grads(lambda x, w, t: formula64(x @ w.T, t), x, w, t)
        for a, b in zip(fused, formula, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64():
    x, w, t = _case(n=5, d=3, v=7, seed=1)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: head_token_losses(x, w, t, chunk_bytes=2 * 7 * 8), (x, w))


def test_bf16_autocast_matches_the_head_then_token_losses():
    """Under bf16 autocast both paths multiply bf16 features by the bf16 weight; the losses agree to float32
    rounding and the gradients to bf16's (each path rounds the logits' gradient to bf16 once)."""
    x, w, t = _case(torch.float32, n=64, d=32, v=1000, seed=2)
    head = torch.nn.Linear(32, 1000, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)

    def unfused(x, w, t):
        return token_losses(torch.nn.functional.linear(x, w), t)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _grads(lambda x, w, t: head_token_losses(x, w, t, chunk_bytes=7 * 1000 * 4), x, w, t)
        plain = _grads(unfused, x, w, t)
    assert all(g.dtype == torch.float32 for g in fused[2:])
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-6, atol=0)
    for a, b in zip(fused[2:], plain[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_the_modules_chunked_loss_is_its_logits_loss():
    """LRAttnModule's two paths (`--model.loss_impl logits|chunked`): the same losses and parameter gradients; on
    CPU `auto` takes the logits."""
    torch.manual_seed(0)
    base = LRAttnModule.from_names(size="tiny", ablation="p-lr-block-n4-r32", z_loss=0.05)
    chunked = LRAttnModule.from_names(size="tiny", ablation="p-lr-block-n4-r32", z_loss=0.05, loss_impl="chunked")
    chunked.load_state_dict(base.state_dict())
    with torch.no_grad():
        for m in (base, chunked):
            m.model.router.queries.normal_(generator=torch.Generator().manual_seed(3))  # routing off uniform
    assert not base.chunked_loss() and chunked.chunked_loss()
    batch = torch.randint(0, base.cfg.size.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    out = []
    for m in (base, chunked):
        ce, z = m.model_losses(batch[:, :-1], batch[:, 1:])
        (ce + 0.05 * z).backward()
        out.append((ce.detach(), z.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-6, atol=0)
    assert set(out[1][2]) == set(out[0][2]) and "model.head.weight" in out[1][2]
    for name, g in out[0][2].items():
        torch.testing.assert_close(out[1][2][name], g, rtol=1e-4, atol=1e-6 * max(1.0, g.abs().max().item()), msg=name)


def test_compiles_without_a_graph_break_and_agrees():
    x, w, t = _case(torch.float32, seed=5)
    fn = lambda x, w, t: head_token_losses(x, w, t, chunk_bytes=7 * V * 4)  # noqa: E731
    compiled = _grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x, w, t)
    eager = _grads(fn, x, w, t)
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_logits_never_exist_whole():
    """Peak bytes allocated during forward + backward, above the inputs: the two gradients (x's, and W's summed in
    float32) and one chunk's working set (its logits and their float32 gradient), never the [N, V] logits."""
    n, d, v, rows = 2048, 64, 4096, 32
    x, w, t = _case(torch.float32, n=n, d=d, v=v, seed=6)
    x.requires_grad_()
    w.requires_grad_()

    def run():
        ce, z = head_token_losses(x, w, t, chunk_bytes=rows * v * 4, max_chunks=10**6)
        (ce + 1e-4 * z).backward()
        x.grad = w.grad = None

    peak = peak_allocated_bytes(run)
    gradients = (n * d + v * d) * 4 * 2  # each gradient, and its copy in the parameter's dtype
    chunk = rows * v * 4 * 3  # a chunk's logits, their shifted copy, its gradient
    vectors = 64 * n
    assert peak <= gradients + chunk + vectors, (peak, gradients + chunk + vectors)
    assert peak < n * v * 4 / 4  # a quarter of the float32 logits: they never exist at once


def test_shapes_must_agree():
    x, w, t = _case()
    with pytest.raises(ValueError, match="head weight"):
        head_token_losses(x, w[:, :-1], t)
