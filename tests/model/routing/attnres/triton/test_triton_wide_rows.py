"""The backward read (kernels.py read_bwd) at rows wider than one chunk, in float64 under Triton's CPU interpreter.

The model-level tests (test_attnres_triton.py) run at widths where a head's row fits one chunk of
launch.BWD_CHUNK columns; read_bwd walks wider rows chunk by chunk (the key's columns, the value's, the key's
again), so here one `lrattn::attnres_read` at D = 640 (three chunks, the last masked) with a 320-wide key (two)
is held to torch autograd of the same formula, float64: carried keys with one and two depth heads, a sliced key
lying in the value, value keys. TRITON_INTERPRET=1 must be set before triton is imported: the kernels run in a
subprocess (this file as a script).
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
CASES = {"carried-h1": ("carried", 320, 1), "carried-h2": ("carried", 640, 2), "sliced-h1": ("sliced", 320, 1),
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
    from lrattn_lightning.model.routing.attnres.triton.ops import attnres_read

    torch.manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    vs = [rand(1, N, D) for _ in range(4)]  # embedding, two summaries, the partial block
    koff = D - R if mode == "sliced" else 0
    ks = [rand(1, N, R) for _ in range(4)] if mode == "carried" else [v[..., koff:] for v in vs]
    q = rand(R)
    grad = torch.randn(1, N, D, dtype=torch.float64)
    inputs = [*vs, q, *(ks if mode == "carried" else [])]
    emb_k, keys, part_k = (ks[0], ks[1:3], ks[3]) if mode == "carried" else (None, [], None)
    out, _, _ = attnres_read(vs[0], emb_k, vs[1:3], keys, vs[3], part_k, q, CONSTS, SCALE, heads, True, koff, False)
    expected = _formula(vs, ks, q, heads)
    got, want = torch.autograd.grad(out, inputs, grad), torch.autograd.grad(expected, inputs, grad)
    return {"dout": float((out - expected).abs().max()),
            "dgrad": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True))}


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
    assert r["dout"] < 1e-13 and r["dgrad"] < 1e-13, r  # measured: <= 8.3e-15 (2026-12-07)


if __name__ == "__main__":
    torch.set_num_threads(1)
    Path(sys.argv[1]).write_text(json.dumps({name: _case(*args) for name, args in CASES.items()}))
