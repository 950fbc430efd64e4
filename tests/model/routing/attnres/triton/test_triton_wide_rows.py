"""The backward read (kernels.py read_bwd) at rows wider than one chunk, in float64 under Triton's CPU interpreter.

The model-level tests (test_attnres_triton.py) run at widths where a head's row fits one chunk of
launch.BWD_CHUNK columns; read_bwd walks wider rows chunk by chunk (the key's columns, the value's, the key's
again; a key that fits one chunk, KEY_ONE, is loaded once and held), so here reads at D = 640 (three chunks,
the last masked) with a 320-wide key (two chunks) or a 64-wide one (held) are held to torch autograd of the
same formula, float64: carried keys with one and two depth heads, sliced keys with one head (lying in the
value) and two (a key gradient of their own, folded), value keys. Two reads of the same completed sources (each with its own partial block and query), the
second taking the sources the first handed on (ops.read): the second's backward writes their gradients and
the first's adds its share in place (eager), or into new tensors (torch.compile, aot_eager, fullgraph: the
functional op). TRITON_INTERPRET=1 must be set before triton is imported: the kernels run in a subprocess
(this file as a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

N, D = 6, 640
CASES = {"carried-h1": ("carried", 320, 1), "carried-h2": ("carried", 640, 2), "carried-r64": ("carried", 64, 1),
         "sliced-h1": ("sliced", 320, 1),
         "sliced-h2": ("sliced", 320, 2),
         "value-h1": ("value", 640, 1)}
CONSTS = [0.0, 0.3, 0.7, 0.2, 1e-6, 2e-6, 1e-6, 3e-6]  # priors, then eps: embedding, two summaries, partial
SCALE = 0.5


def _formula(vs, ks, q, heads):
    """h = sum_s softmax_s(scale rstd_s <x_s, q> + b_s) v_s per depth head, in plain torch."""
    S = len(vs)
    K, E = ks[0].shape[-1] // heads, D // heads
    logits = []
    for s in range(S):
        x = ks[s].reshape(-1, heads, K)
        rstd = 1 / torch.sqrt((x * x).mean(-1) + CONSTS[S + s])
        logits.append(SCALE * rstd * (x * q.reshape(heads, K)).sum(-1) + CONSTS[s])
    a = torch.softmax(torch.stack(logits), 0)
    return sum(a[s][..., None] * vs[s].reshape(-1, heads, E) for s in range(S)).reshape(vs[0].shape)


def _case(mode: str, R: int, heads: int) -> dict:
    from lrattn_lightning.model.routing.attnres.triton.ops import read

    torch.manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    vs = [rand(1, N, D) for _ in range(5)]  # embedding, two summaries, the partial block of each read
    koff = D - R if mode == "sliced" else 0
    ks = [rand(1, N, R) for _ in range(5)] if mode == "carried" else [v[..., koff:] for v in vs]
    qs = [rand(R), rand(R)]
    grads = [torch.randn(1, N, D, dtype=torch.float64) for _ in range(2)]
    inputs = [*vs, *qs, *(ks if mode == "carried" else [])]

    def two_reads(vs, ks, qs):
        emb_k, keys = (ks[0], ks[1:3]) if mode == "carried" else (None, [])
        outs = []
        emb_v, values = vs[0], vs[1:3]
        for i in range(2):
            part_k = ks[3 + i] if mode == "carried" else None
            out, _, handed = read(emb_v, emb_k, values, keys, vs[3 + i], part_k, qs[i], CONSTS, SCALE, heads, True,
                                  koff, False)
            emb_v, emb_k, values, keys = handed
            outs.append(out)
        return outs

    def loss(outs):
        return sum((o * g).sum() for o, g in zip(outs, grads, strict=True))

    outs = two_reads(vs, ks, qs)
    expected = [_formula([*vs[:3], vs[3 + i]], [*ks[:3], ks[3 + i]], qs[i], heads) for i in range(2)]
    got, want = torch.autograd.grad(loss(outs), inputs), torch.autograd.grad(loss(expected), inputs)
    compiled = torch.compile(lambda vs, ks, qs: loss(two_reads(vs, ks, qs)), backend="aot_eager", fullgraph=True)
    got_c = torch.autograd.grad(compiled(vs, ks, qs), inputs)

    def dgrad(got):
        return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))

    return {"dout": max(float((o - e).detach().abs().max()) for o, e in zip(outs, expected, strict=True)),
            "dgrad": dgrad(got), "dgrad_compiled": dgrad(got_c)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("wide") / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_backward_read_over_several_chunks_is_the_exact_derivative(measured, case):
    from lrattn_lightning.model.routing.attnres.triton import launch

    assert D > 2 * launch.BWD_CHUNK  # (three chunks a row)
    r = measured[case]
    assert r["dout"] < 1e-13 and r["dgrad"] < 1e-13 and r["dgrad_compiled"] < 1e-13, r


if __name__ == "__main__":
    torch.set_num_threads(1)
    Path(sys.argv[1]).write_text(json.dumps({name: _case(*args) for name, args in CASES.items()}))
