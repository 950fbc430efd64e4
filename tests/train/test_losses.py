"""The fused training loss (train/losses.py): (ce, z) and their gradients against the formula written out in
float64, a float64 gradcheck, chunked against unchunked, torch.compile against eager, the module's loss and
gradients, and the memory the chunks bound."""

from __future__ import annotations

import pytest
import torch
from helpers.references import formula64

from lrattn_lightning.tools.bench.profiling import peak_allocated_bytes
from lrattn_lightning.train.lit_module import LRAttnModule
from lrattn_lightning.train.losses import IGNORE_INDEX, chunk_logsumexp, reference_token_losses, token_losses

WHOLE = 2**40  # chunk_bytes that keeps every row in one chunk


def _case(dtype: torch.dtype, B: int = 3, T: int = 7, V: int = 301, seed: int = 0):
    """Logits far from zero (lse ~ 8, so the z-loss's gradient 2 lse p / N is not small), a few ignored targets."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3 + 5).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 2] = targets[-1, -2] = IGNORE_INDEX
    return logits, targets


def _loss_and_grad(fn, logits, targets, a: float = 0.7, b: float = 0.3):
    """(ce, z, d(a ce + b z)/d logits): two different upstream gradients, so each term's backward is checked."""
    x = logits.detach().clone().requires_grad_()
    ce, z = fn(x, targets)
    (a * ce + b * z).backward()
    return ce.detach(), z.detach(), x.grad


@pytest.mark.parametrize("chunk_bytes", [WHOLE, 4 * 301 * 5], ids=["whole", "5-row-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_losses_and_gradient_are_the_float64_formula(dtype, chunk_bytes):
    logits, targets = _case(dtype)
    ce, z, grad = _loss_and_grad(lambda x, t: token_losses(x, t, chunk_bytes=chunk_bytes), logits, targets)
    ce64, z64, grad64 = _loss_and_grad(formula64, logits.double(), targets)
    assert ce.dtype == z.dtype == torch.float32 and grad.dtype == dtype
    # the losses are float32 sums of the exact low-precision logits: float32 tolerance whatever the input dtype
    torch.testing.assert_close(ce.double(), ce64, rtol=1e-6, atol=0)
    torch.testing.assert_close(z.double(), z64, rtol=1e-6, atol=0)
    assert z64 > 50 and ce64 > 1  # the case is not degenerate
    # the gradient is float32 math (exp(x - lse) with lse ~ 8: a few float32 ulps of lse) rounded once to the
    # logits' dtype
    tol = max(torch.finfo(dtype).eps, 2e-6)
    torch.testing.assert_close(grad.double(), grad64, rtol=tol, atol=tol * grad64.abs().max().item())
    assert grad[0, 2].abs().sum() > 0  # an ignored token still has the z-loss's gradient


@pytest.mark.parametrize("chunk_bytes", [WHOLE, 8 * 7 * 2], ids=["whole", "2-row-chunks"])
def test_gradcheck_float64(chunk_bytes):
    logits, targets = _case(torch.float64, B=1, T=5, V=7, seed=1)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_losses(x, targets, chunk_bytes=chunk_bytes), (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_is_unchunked(dtype):
    logits, targets = _case(dtype, B=4, T=16, V=1000, seed=2)
    whole = _loss_and_grad(lambda x, t: token_losses(x, t, chunk_bytes=WHOLE), logits, targets)
    for rows in (1, 7, 63):  # one row at a time, chunks that do not divide the 64 rows, the last chunk one row
        chunked = _loss_and_grad(lambda x, t, r=rows: token_losses(x, t, chunk_bytes=r * 4 * 1000), logits, targets)
        for a, b in zip(chunked, whole, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_the_old_two_logsumexp_code_agrees():
    """reference_token_losses (the code token_losses replaced) gives the same losses and gradient."""
    logits, targets = _case(torch.float32, seed=3)
    fused = _loss_and_grad(token_losses, logits, targets)
    old = _loss_and_grad(reference_token_losses, logits, targets)
    for a, b in zip(fused, old, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype,chunk_bytes", [(torch.float32, WHOLE), (torch.float32, 4 * 301 * 6),
                                               (torch.bfloat16, 4 * 301 * 6)],
                         ids=["float32-whole", "float32-6-row-chunks", "bfloat16-6-row-chunks"])
def test_inductor_compiles_it_whole_and_agrees_with_eager(dtype, chunk_bytes):
    """fullgraph: no graph break, so `--model.compile true` keeps the decoder and the loss one region."""
    logits, targets = _case(dtype, seed=4)
    fn = lambda x, t: token_losses(x, t, chunk_bytes=chunk_bytes)  # noqa: E731
    compiled = _loss_and_grad(torch.compile(fn, backend="inductor", fullgraph=True), logits, targets)
    eager = _loss_and_grad(fn, logits, targets)
    eps = torch.finfo(dtype).eps
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=max(eps, 1e-5), atol=1e-6)


def test_the_modules_loss_and_gradients_are_the_formulas():
    """The training step's loss ce + z_loss * z (z_loss large enough that the z term's gradient counts)."""
    torch.manual_seed(0)
    module = LRAttnModule.from_names(size="tiny", ablation="p-lr-block-n4-r32", z_loss=0.05)
    batch = torch.randint(0, module.cfg.size.vocab_size, (2, 17))
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def grads(loss_fn):
        module.zero_grad(set_to_none=True)
        ce, z = loss_fn(inputs, targets)
        (ce + module.hparams.z_loss * z).backward()
        return float(ce), float(z), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    ce, z, fused = grads(module.model_losses)
    ce64, z64, formula = grads(lambda i, t: formula64(module.model(i), t))
    assert ce == pytest.approx(ce64, rel=1e-6) and z == pytest.approx(z64, rel=1e-6)
    assert set(fused) == set(formula) and len(fused) > 10
    for name, g in formula.items():
        torch.testing.assert_close(fused[name], g.float(), rtol=1e-4, atol=1e-6 * max(1.0, g.abs().max().item()),
                                   msg=name)


def test_chunks_bound_the_working_set():
    """Logits [N x V]: at its peak the fused loss holds the gradient and, for bf16 logits, one chunk of float32
    rows (float32 logits are worked in the gradient's own rows); the old code held float32 copies of all of them
    (the upcast, log-softmax, the gradient)."""
    N, V, rows = 512, 4096, 32
    targets = torch.randint(0, V, (N,))

    def peak(fn, dtype):
        logits = torch.randn(N, V).to(dtype).requires_grad_()

        def run():
            ce, z = fn(logits, targets)
            (ce + 1e-4 * z).backward()
            logits.grad = None
        return peak_allocated_bytes(run)

    chunked = lambda x, t: token_losses(x, t, chunk_bytes=rows * V * 4)  # noqa: E731
    vectors = 64 * N  # lse, the targets' masks and coefficients: [N] each
    assert N * V * 2 < peak(chunked, torch.bfloat16) <= N * V * 2 + rows * V * 4 + vectors
    assert N * V * 4 <= peak(chunked, torch.float32) <= N * V * 4 + vectors
    assert peak(reference_token_losses, torch.bfloat16) >= 3 * N * V * 4  # three float32 [N, V] at once


def test_chunk_logsumexp_of_infinite_rows_is_torchs():
    inf = float("inf")
    x = torch.tensor([[-inf, -inf, -inf], [1.0, inf, 2.0], [-inf, 0.0, 1.0], [300.0, 1.0, 2.0]]).bfloat16()
    torch.testing.assert_close(chunk_logsumexp(x, torch.float32), torch.logsumexp(x.float(), -1), rtol=0, atol=1e-5)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="logits against"):
        token_losses(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
