"""Each completed source's gradient is one buffer, accumulated by the reads' backward kernels, not summed by
autograd (issue 54). Checked without running a kernel: the launches are recorded (tools/kernels/specs.py,
recorded_launches), so a tiny model's forward and backward build and walk the real autograd graph on CPU;
the numbers are held to `reference` by test_attnres_triton.py and test_triton_wide_rows.py (interpreter).

A read (ops.read, ops.group) hands its completed sources on (the embedding, the block summaries, their carried
keys) as views, and the next read takes those: so autograd sees each source taken by one read, and each read's
backward receives the gradient the later reads gave the source, adds its own share there in the kernel and
returns that same buffer. Before, every read took the sources themselves and returned new gradients for each,
which autograd then added: a source read by k reads had k gradient buffers and k - 1 additions.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from lrattn_lightning.model.config import ModelConfig, fit_to_size  # noqa: E402
from lrattn_lightning.model.decoder import build_decoder  # noqa: E402
from lrattn_lightning.model.registry import load_registry  # noqa: E402
from lrattn_lightning.tools.kernels.specs import recorded_launches  # noqa: E402

# entry at `tiny` (4 sublayers) -> (reads, gradients of completed sources that a read received from a later read
# and added into, buffers): the gradients autograd summed before (counted on the previous code: 1, 18, 9, 18
# extra gradient tensors, each a sum over [B, T, D] or [B, T, r]), the buffers one per completed source.
# Two-phase block reads (a group of sites 1-3, then site 4), per-token queries (single reads, carried keys:
# the embedding, its key and four one-sublayer summaries with theirs), full routing with value keys (the
# embedding and four summaries: reads 1..4 take 2 + 3 + 4 + 5 of them), static P-LR.
EXPECTED = {"s-lr-block-size4-r64": (2, 1, 2), "p-lr-block-n8-r32-dynquery": (4, 18, 10), "attnres-full": (4, 9, 5),
            "p-lr-block-n4-r32": (4, 18, 10)}
READS = ("_ReadBackward", "_GroupBackward")


def _graph(loss: torch.Tensor) -> list:
    """Every node of loss's autograd graph, once."""
    seen, stack, nodes = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return nodes


def _step(name: str) -> dict:
    """A tiny triton decoder's forward and backward, recorded: per read node, its completed sources' edges and
    the gradient tensors its backward received for them and returned."""
    reg = load_registry()
    tiny = reg.size("tiny")
    cfg = ModelConfig(tiny, fit_to_size(reg.ablation(name), tiny))
    torch.manual_seed(0)
    seen: dict = {}
    with recorded_launches():
        model = build_decoder(cfg, impl="triton")
        idx = torch.randint(0, cfg.size.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = model(idx).float().square().mean()
        reads = [n for n in _graph(loss) if type(n).__name__ in READS]

        def hook(node):
            def record(grad_inputs, grad_outputs):
                seen[node] = (list(grad_inputs), list(grad_outputs))
            return record

        for node in reads:
            node.register_hook(hook(node))
        loss.backward()
    return {"reads": reads, "grads": seen}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_source_is_taken_by_one_read_and_has_one_gradient_buffer(name):
    run = _step(name)
    reads, grads = run["reads"], run["grads"]
    assert set(grads) == set(reads)
    takers: dict = {}  # (node, output) -> the reads that take it as a completed source
    origins = set()  # completed sources as autograd first sees them (not a read's handed-on view)
    chained = fresh = 0
    for node in reads:
        grad_in, grad_out = grads[node]
        n_handed = len(grad_out) - 3  # outputs: out, lse, alpha, then the sources handed on
        assert n_handed >= 1
        for k in range(n_handed):
            fn, nr = node.next_functions[k]  # (its tensor inputs: the completed sources first)
            takers.setdefault((fn, nr), []).append(node)
            if type(fn).__name__ not in READS:
                origins.add((fn, nr))
            incoming, returned = grad_out[3 + k], grad_in[k]
            if incoming is None:  # no later read took it: the buffer the chain accumulates into starts here
                fresh += 1
                continue
            # added in place: the read returns the very buffer the later reads' gradient arrived in
            assert returned.data_ptr() == incoming.data_ptr(), (name, type(node).__name__, k)
            chained += 1
    # each completed source, and each read's view of it, is taken by one read: autograd sums no read's share
    assert all(len(nodes) == 1 for nodes in takers.values()), name
    # one gradient buffer per completed source (its last read's), however many reads take it
    assert fresh == len(origins), (fresh, len(origins))
    assert (len(reads), chained, fresh) == EXPECTED[name]
