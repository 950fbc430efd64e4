"""The `triton` AttnRes backend (attnres/triton/) against `reference`, run in Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before triton is imported, so the kernels run in one subprocess (this file
run as a script: `_worker`) that measures everything once; the tests below assert on its numbers. Covered:
every AttnRes registry entry at `tiny` (fitted to the size as ../test_attnres_fast.py does; entries whose fitted
configs are identical are computed once) with random queries, forward logits, every gradient
and the routing weights; a pairwise grid at an odd size (D = 24, r = 12, depth heads 4: neither a power of two;
three layers, so uneven blocks with partial reads) over every key source; bfloat16 autocast; KV-cache
decoding; the golden numbers of the paper's code (tests/golden/reference.pt); torch.compile keeping the
custom ops whole. Without CUDA and without the interpreter, the backend is one line naming the fix.
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
from helpers.paths import GOLDEN_DIR, TESTS_DIR  # noqa: E402

from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig, fit_to_size  # noqa: E402
from lrattn_lightning.model.registry import load_registry  # noqa: E402

REGISTRY = load_registry()
ATTNRES = [n for n, a in REGISTRY.ablations.items() if a.routing == "attnres"]
# D = 24, head size 12 (RoPE: even), r = 12 -> with 4 depth heads e = 6, k = 3: no power of two anywhere;
# M = 6 sublayers, so N = 4 blocks end after 2, 3, 5, 6 (uneven, with partial reads)
ODD = SizeConfig(name="odd-l3", doc="tests", n_layers=3, d_model=24, n_heads=2, d_mlp=40, vocab_size=97, seq_len=16)
BF16 = ["s-lr-block-n8-r64", "p-lr-block-n4-r32", "attnres-full", "vp-lr-block-n8-r32", "p-lr-block-n8-r32-dynquery",
        "s-lr-block-size4-r64", "odd-projected-block2-h4"]
KV = ["p-lr-full-r32", "p-lr-block-n8-r32-dynquery", "odd-sliced-block-h4-nokeynorm", "s-lr-block-size4-r64",
      "odd-value_projected-block2-h1"]
# two-phase reads: (entry, {op: calls in one forward}) - one phase-1 kernel per group of >= 2 sites, one merge
# per such site with a partial, the other sites site by site (tiny: M = 4; odd-l3: M = 6)
TWO_PHASE = {"s-lr-block-size4-r64": {"attnres_group": 1, "attnres_merge": 3, "attnres_read": 1},
             "odd-sliced-block2-h4": {"attnres_group": 2, "attnres_merge": 4, "attnres_read": 1},
             "p-lr-block-n8-r32-dynquery": {"attnres_group": 0, "attnres_merge": 0, "attnres_read": 4},
             "attnres-full": {"attnres_group": 0, "attnres_merge": 0, "attnres_read": 4}}
# golden size `small`: 8 layers, up to 17 sources a read (the interpreter's cost); one per kind of read
GOLDEN = ["attnres-full", "s-lr-block-n8-r64-h4", "p-lr-block-n8-r32-projstatic-embkey", "p-lr-block-n8-r32-dynquery"]
# The interpreter runs a launch program by program, so its cost is per program: at d = 128 the GPU's geometry
# (launch.PROGRAM_TILE 1024: 8 tokens a program) made the golden entries 140 s of this file's ~250. The last
# entry keeps that geometry; the others run with 64-token programs (the most launch.geometry gives; 3x faster).
# The kernels' arithmetic does not depend on BLOCK_N; partial and masked tiles are covered at `tiny` and odd-l3.
GOLDEN_WIDE_TILE = {"attnres-full": 8192, "s-lr-block-n8-r64-h4": 8192, "p-lr-block-n8-r32-projstatic-embkey": 8192}
TOL = 1e-5  # float32: logits absolute, gradients relative to each tensor's largest entry


def _odd_grid() -> dict[str, AblationConfig]:
    """Block routing (uneven, partial reads) x every key source x depth heads 1 / 4, with mean summaries +
    prior (4 heads) or sqrt-mean (1 head) and the logit scale; full routing is covered at `tiny`. Four blocks
    (ends after 2, 3, 5, 6: one two-site group) and two (ends after 3, 6: groups of sites 1-2 and 3-5;
    every site merges a partial but site 3, read just after a block ended): the two-phase kernels with G = 2 and 3 (BLOCK_G 4,
    masked)."""
    base = REGISTRY.ablation("attnres-full")
    emb = {"value": "value", "sliced": "sliced", "projected": "projected", "value_projected": "projected",
           "value_projected_shared": "projected_plus_static"}
    out = {}
    for blocks, tag in ((4, "block"), (2, "block2")):
        for key_source, embedding_key in emb.items():
            for heads in (1, 4):
                summary, prior = ("mean", 1.0) if heads == 4 else ("sqrt_mean", 0.0)
                name = f"odd-{key_source}-{tag}-h{heads}"
                out[name] = base.replace(
                    name=name, key_source=key_source, embedding_key=embedding_key, depth_heads=heads,
                    rank=None if key_source == "value" else 12, blocks=blocks, block_summary=summary,
                    count_prior=prior, logit_scale="inv_sqrt_head_dim" if key_source != "value" else "none",
                )
    out["odd-sliced-block-h4-nokeynorm"] = out["odd-sliced-block-h4"].replace(
        name="odd-sliced-block-h4-nokeynorm", key_norm="none")
    return out


GRID = _odd_grid()
# The grid's parity tests, pairwise: every key source at both blockings and both head counts, and every blocking
# at both head counts, with no full product (each h4 entry at four blocks costs ~5 s of the interpreter). Key
# sources in turn take (four blocks, h4) + (two blocks, h1) or (four blocks, h1) + (two blocks, h4).
PAIRWISE = [f"odd-{key}-{tag}-h{heads}" for i, key in enumerate(dict.fromkeys(n.split("-")[1] for n in GRID))
            for tag, heads in ((("block", 4), ("block2", 1)) if i % 2 == 0 else (("block", 1), ("block2", 4)))]
PAIRWISE.append("odd-sliced-block-h4-nokeynorm")


def _config(name: str) -> ModelConfig:
    if name in GRID:
        return ModelConfig(ODD, GRID[name])
    tiny = REGISTRY.size("tiny")
    return ModelConfig(tiny, fit_to_size(REGISTRY.ablation(name), tiny))


# ---- the worker (runs under TRITON_INTERPRET=1) -------------------------------------------------------
def _pair(name: str):
    from helpers.models import randomize_routing

    from lrattn_lightning.model.decoder import build_decoder

    cfg = _config(name)
    torch.manual_seed(0)
    ref = build_decoder(cfg, impl="reference")
    randomize_routing(ref)
    tri = build_decoder(cfg, impl="triton")
    tri.load_state_dict(ref.state_dict())  # strict: the same parameter names
    return ref, tri


def _idx(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.size.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))


def _run(model, idx, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(idx, return_routing=True)
    logits = out.logits.float()
    (logits.square().mean() + logits[..., :3].sum()).backward()
    return logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}, out.routing


def _parity(name: str) -> dict:
    ref, tri = _pair(name)
    idx = _idx(ref.cfg)
    lr, gr, ar = _run(ref, idx)
    lt, gt, at = _run(tri, idx)
    grads = {n: float((gt[n] - g).abs().max()) / max(float(g.abs().max()), 1e-30) for n, g in gr.items()}
    shapes = [list(a.shape) for a in at] == [list(a.shape) for a in ar]  # one alpha [S_j, B, T, m] per site
    dalpha = max(float((a - b).abs().max()) for a, b in zip(ar, at, strict=True)) if shapes else float("inf")
    return {"dlogit": float((lt - lr).abs().max()), "dgrad": max(grads.values()), "worst": max(grads, key=grads.get),
            "same_names": sorted(gt) == sorted(gr), "dalpha": dalpha, "shapes": shapes}


def _bf16(name: str) -> dict:
    """Relative errors against the float32 truth, of the reference and of triton under the same autocast."""
    ref, tri = _pair(name)
    idx = _idx(ref.cfg)
    lt, gt, _ = _run(ref, idx)
    runs = {"reference": _run(ref, idx, autocast=True), "triton": _run(tri, idx, autocast=True)}

    def err(x, truth):
        return float((x - truth).norm() / (truth.norm() + 1e-12))

    return {impl: {"logits": err(lo, lt), "grads": {n: err(g[n], t) for n, t in gt.items()}}
            for impl, (lo, g, _) in runs.items()}


def _kv(name: str) -> float:
    from lrattn_lightning.model.attention import KVCache

    _, tri = _pair(name)
    idx = torch.randint(0, tri.cfg.size.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = tri(idx)
        cache = KVCache.empty(tri.cfg.size.n_layers)
        steps = [tri(idx[:, :4], cache=cache)] + [tri(idx[:, t : t + 1], cache=cache) for t in range(4, idx.shape[1])]
    return float((torch.cat(steps, dim=1) - full).abs().max())


def _compiled(name: str) -> dict:
    """aot_eager torch.compile of the triton decoder: one graph, the reads kept as custom ops (counted by
    name), same numbers."""
    import torch._dynamo

    ref, tri = _pair(name)
    idx = _idx(ref.cfg)
    explanation = torch._dynamo.explain(tri)(idx)
    torch._dynamo.reset()
    lr, gr, _ = _run(ref, idx)
    compiled = torch.compile(tri, backend="aot_eager", fullgraph=True)
    tri.zero_grad(set_to_none=True)
    logits = compiled(idx).float()
    (logits.square().mean() + logits[..., :3].sum()).backward()
    dgrad = max(float((p.grad - gr[n]).abs().max()) / float(gr[n].abs().max()) for n, p in tri.named_parameters())
    # the reads are autograd.Functions (their gradient chain, ops.read): dynamo keeps each as one node whose
    # forward is a subgraph holding the custom op
    targets = [str(node.target) for g in explanation.graphs for m in g.modules() if hasattr(m, "graph")
               for node in m.graph.nodes]
    ops = {op: sum(t.startswith(f"lrattn.{op}.") for t in targets)
           for op in ("attnres_read", "attnres_group", "attnres_merge")}
    return {"graph_breaks": explanation.graph_break_count, "graphs": explanation.graph_count, "ops": ops,
            "dlogit": float((logits.detach() - lr).abs().max()), "dgrad": dgrad}


def _float64(name: str) -> dict:
    """A float64 model routes in float64: triton's logits and every gradient equal the reference's to
    ~1e-16, not ~1e-7 (so the backward kernels are the exact derivative, not only close in float32)."""
    ref, tri = _pair(name)
    ref, tri = ref.double(), tri.double()
    idx = _idx(ref.cfg)
    out = {}
    for label, model in (("ref", ref), ("tri", tri)):
        model.zero_grad(set_to_none=True)
        logits = model(idx)
        (logits.square().mean() + logits[..., :3].sum()).backward()
        out[label] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (lr, gr), (lt, gt) = out["ref"], out["tri"]
    dgrad = max(float((gt[n] - g).abs().max()) / max(float(g.abs().max()), 1e-300) for n, g in gr.items())
    return {"dlogit": float((lt - lr).abs().max()), "dgrad": dgrad}


def _op_calls(name: str) -> dict[str, int]:
    """How many times each custom op runs in one eager forward of the triton decoder."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = dict.fromkeys(("attnres_read", "attnres_group", "attnres_merge"), 0)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = str(func).split(".")
            if op[0] == "lrattn" and op[1] in calls:
                calls[op[1]] += 1
            return func(*args, **(kwargs or {}))

    _, tri = _pair(name)
    with torch.no_grad(), Count():
        tri(_idx(tri.cfg))
    return calls


def _canonical() -> dict[str, str]:
    """Entry -> the first entry whose fitted config is identical (computed once for all of them)."""
    seen: dict[tuple, str] = {}
    out = {}
    for name in ATTNRES:
        a = _config(name).ablation
        key = repr((a.routing, a.options))
        out[name] = seen.setdefault(key, name)
    return out


def _golden_row(name: str) -> dict:
    """`lrattn fidelity`'s row of one entry, at the launch geometry GOLDEN_WIDE_TILE gives it (program_tile)."""
    from lrattn_lightning.model.routing.attnres.triton import launch
    from lrattn_lightning.tools.fidelity.fidelity import fidelity_rows

    production = launch.PROGRAM_TILE
    launch.PROGRAM_TILE = GOLDEN_WIDE_TILE.get(name, production)
    try:
        (row,) = fidelity_rows(str(GOLDEN_DIR / "reference.pt"), impl="triton", only=[name])
    finally:
        launch.PROGRAM_TILE = production
    return {**row, "program_tile": GOLDEN_WIDE_TILE.get(name, production), "production_tile": production}


def _worker(path: str) -> None:
    from lrattn_lightning.model.decoder import build_decoder

    torch.set_num_threads(1)
    canon = _canonical()
    computed = {n: _parity(n) for n in dict.fromkeys(canon.values())}
    # the paper's golden numbers through `lrattn fidelity`'s rows: its comparison, once for both tests
    rows = [_golden_row(name) for name in GOLDEN]
    results = {
        "registry": {n: {**computed[c], "computed_as": c} for n, c in canon.items()},
        "grid": {n: _parity(n) for n in PAIRWISE},
        "bf16": {n: _bf16(n) for n in BF16},
        "kv": {n: _kv(n) for n in KV},
        "golden": {row["entry"]: row for row in rows},
        "compile": {n: _compiled(n) for n in ("p-lr-block-n4-r32", "s-lr-block-size4-r64")},
        "float64": {n: _float64(n) for n in ("s-lr-block-n8-r64-refdefault", "s-lr-block-size4-r64",
                                             "odd-projected-block2-h4", "odd-value-block2-h1")},
        "two_phase": {n: _op_calls(n) for n in TWO_PHASE},
        "impl": type(build_decoder(_config("attnres-full"), impl="triton").router).__name__,
    }
    Path(path).write_text(json.dumps(results))


# ---- the tests (plain pytest process) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("triton") / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TESTS_DIR)}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ATTNRES)
def test_every_registry_entry_matches_reference(measured, name):
    r = measured["registry"][name]
    assert r["same_names"] and r["shapes"], r
    assert r["dlogit"] <= TOL and r["dgrad"] <= TOL and r["dalpha"] <= TOL, r


@pytest.mark.parametrize("name", PAIRWISE)
def test_odd_sizes_uneven_blocks_every_key_source(measured, name):
    r = measured["grid"][name]
    assert r["same_names"] and r["shapes"], r
    assert r["dlogit"] <= TOL and r["dgrad"] <= TOL and r["dalpha"] <= TOL, r


@pytest.mark.parametrize("name", BF16)
def test_bfloat16_autocast_within_the_bound_of_the_other_backends(measured, name):
    """As ../test_attnres_fast.py holds `fast` and `compiled`: about as close to the float32 truth as the reference
    under the same autocast."""
    ref, tri = measured["bf16"][name]["reference"], measured["bf16"][name]["triton"]
    assert tri["logits"] <= 2 * ref["logits"] + 2e-3
    for n, e in tri["grads"].items():
        assert e <= 2 * ref["grads"][n] + 2e-2, n


@pytest.mark.parametrize("name", KV)
def test_kv_cache_decoding_equals_full_recomputation(measured, name):
    assert measured["kv"][name] <= 1e-5


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_numbers_of_the_papers_code(measured, name):
    r = measured["golden"][name]  # tests/model/test_golden.py's tolerances
    assert r["dlogit"] <= 2e-4 and r["dgrad"] <= 2e-4 and r["dloss"] <= 1e-5, r


def test_torch_compile_keeps_the_reads_whole(measured):
    r = measured["compile"]["p-lr-block-n4-r32"]  # tiny: four one-sublayer blocks, so full routing's reads
    assert r["graph_breaks"] == 0 and r["graphs"] == 1, r
    assert r["ops"] == {"attnres_read": 4, "attnres_group": 0, "attnres_merge": 0}, r  # sites 1..2L, one op each
    assert r["dlogit"] <= TOL and r["dgrad"] <= TOL, r
    r = measured["compile"]["s-lr-block-size4-r64"]  # one block of 4: a group of sites 1-3, then site 4
    assert r["graph_breaks"] == 0 and r["graphs"] == 1, r
    assert r["ops"] == TWO_PHASE["s-lr-block-size4-r64"], r
    assert r["dlogit"] <= TOL and r["dgrad"] <= TOL, r


@pytest.mark.parametrize("name", list(TWO_PHASE))
def test_block_reads_are_two_phase(measured, name):
    """The completed sources are read once per group (attnres_group), each partial merged (attnres_merge);
    full routing and per-token (gated dynamic) queries read site by site."""
    assert measured["two_phase"][name] == TWO_PHASE[name]


@pytest.mark.parametrize("name", ["s-lr-block-n8-r64-refdefault", "s-lr-block-size4-r64", "odd-projected-block2-h4",
                                  "odd-value-block2-h1"])
def test_float64_models_route_in_float64(measured, name):
    r = measured["float64"][name]
    assert r["dlogit"] <= 1e-12 and r["dgrad"] <= 1e-12, r


def test_fidelity_tool_runs_the_triton_backend(measured):
    """`lrattn fidelity --impl triton`'s rows (the golden test's numbers come from them): each entry at the
    reference's parameter count, within the fidelity table's bounds."""
    assert list(measured["golden"]) == GOLDEN
    rows = measured["golden"].values()
    assert all(r["program_tile"] == GOLDEN_WIDE_TILE.get(r["entry"], r["production_tile"]) for r in rows)
    assert sum(r["program_tile"] == r["production_tile"] for r in rows) == 1  # one entry at the GPU's geometry
    for name, row in measured["golden"].items():
        assert row["entry"] == name and row["params"] == row["reference_params"], row
        assert row["dlogit"] <= 2e-4 and row["dgrad"] <= 2e-4 and not row["clipped"], row


def test_without_cuda_or_interpreter_it_is_one_line(tmp_path):
    """No GPU here and no TRITON_INTERPRET: building the backend, and `lrattn fit --model.impl triton`, say
    what to do in one line (exit 2) before any work."""
    from helpers.cli import in_process

    from lrattn_lightning.data.prepare import prepare

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.pop("MLFLOW_TRACKING_URI", None)
    code = ("from lrattn_lightning.model.decoder import build_decoder\n"
            "from lrattn_lightning.model.registry import load_registry\n"
            "r = load_registry(); build_decoder(r.model('tiny', 's-lr-grid-n4-r16'), impl='triton')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr and "impl 'fast'" in proc.stderr
    data = tmp_path / "data"
    prepare(source="stdlib-docs", out_dir=data, tokenizer="byte", max_documents=20, val_fraction=0.1,
            cloze_items=0, perplexity_documents=0)
    work = tmp_path / "work"
    work.mkdir()
    proc = in_process(["fit", "--config", "experiments/cpu-demo.yaml", "--size", "tiny", "--ablation",
                       "s-lr-grid-n4-r16", "--model.impl", "triton", "--trainer.max_steps", "1",
                       "--data.data_dir", str(data)], work, TRITON_INTERPRET="0")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[-1].startswith("lrattn: error: model.impl 'triton'") and "TRITON_INTERPRET=1" in lines[-1], lines
    assert list(work.iterdir()) == []  # nothing half-written
    golden_file = str(GOLDEN_DIR / "reference.pt")
    for tool in (["bench", "--size", "tiny", "--fit", "--impl", "triton", "--steps", "1"],
                 ["fidelity", "--golden", golden_file, "--impl", "triton"]):
        proc = in_process(tool, work, TRITON_INTERPRET="0")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and lines == [lines[-1]], proc.stderr[-2000:]
        assert lines[-1].startswith("lrattn: error: --impl triton: model.impl 'triton' needs a CUDA GPU"), lines
    assert list(work.iterdir()) == []


if __name__ == "__main__":
    _worker(sys.argv[1])
