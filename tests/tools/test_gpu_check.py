"""benchmarks/gpu-check: the CPU dry run, the package arms' math contracts, and their router wiring.

The package operators (fast-attnres, Liger's AttnRes) are CUDA-only; here a plain-torch operator with
fast-attnres's documented contract stands in for them, so the wiring (source order, partial block,
query of each site) is checked against the reference router on CPU with non-zero queries."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import subprocess
import sys
from importlib.machinery import SourceFileLoader

import pytest
import torch
from helpers.paths import REPO_ROOT

from lrattn_lightning.model.config import ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import load_registry

SCRIPT = REPO_ROOT / "benchmarks" / "gpu-check"
REGISTRY = load_registry()
SIZE = SizeConfig(name="tiny-l3", doc="tests", n_layers=3, d_model=32, n_heads=2, d_mlp=48, vocab_size=97, seq_len=16)


def _load():
    loader = SourceFileLoader("gpu_check", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("gpu_check", loader))
    loader.exec_module(module)
    return module


gpu_check = _load()  # (which puts benchmarks/ on sys.path: the script's parts lie beside it)
gpu_check_arms = importlib.import_module("gpu_check_arms")
gpu_check_report = importlib.import_module("gpu_check_report")
gpu_check_litgpt = importlib.import_module("gpu_check_litgpt")
gpu_check_profile = importlib.import_module("gpu_check_profile")


def contract_op(sources, query, eps=2.0**-23, scale=1.0):
    """fast-attnres's documented equation: keys are the last R value dims, RMSNorm, softmax, weighted sum."""
    V = torch.stack(sources).float()
    t = V[..., -query.shape[-1] :]
    k = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps)
    p = (scale * (k * query.float()).sum(-1)).softmax(0)
    return (p.unsqueeze(-1) * V).sum(0)


@pytest.mark.parametrize("name", ["s-lr-block-n8-r64", "attnres-block-n8", "attnres-full"])
def test_package_router_matches_reference(name):
    cfg = ModelConfig(SIZE, fit_to_size(REGISTRY.ablation(name), SIZE))
    assert gpu_check_arms.contract_mismatch(cfg, "fast-attnres") is None
    torch.manual_seed(0)
    ref = build_decoder(cfg, impl="reference")
    with torch.no_grad():
        ref.router.queries.normal_(std=0.5)
    arm = gpu_check_arms.build_model(cfg, "fast", torch.device("cpu"), contract_op)
    arm.load_state_dict(ref.state_dict())
    idx = torch.randint(0, SIZE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for label, model in (("ref", ref), ("arm", arm)):
        logits = model(idx)
        (logits.square().mean() + logits[..., :3].sum()).backward()
        out[label] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(out["arm"][0], out["ref"][0], rtol=1e-5, atol=1e-5)
    for n, g in out["ref"][1].items():
        torch.testing.assert_close(out["arm"][1][n], g, rtol=1e-4, atol=5e-5 * g.abs().max().item())


def test_contracts():
    def cfg(name):
        return REGISTRY.model("paper-0.5b", name)

    assert gpu_check_arms.contract_mismatch(cfg("s-lr-block-n8-r64"), "fast-attnres") is None
    assert "key_source" in gpu_check_arms.contract_mismatch(cfg("s-lr-block-n8-r64"), "liger")
    for name in ("attnres-block-n8", "attnres-full"):
        assert gpu_check_arms.contract_mismatch(cfg(name), "liger") is None
        assert gpu_check_arms.contract_mismatch(cfg(name), "fast-attnres") is None
    for package in ("flash-attn-res", "fla"):  # standard AttnRes only, like Liger's
        assert "key_source" in gpu_check_arms.contract_mismatch(cfg("s-lr-block-n8-r64"), package)
        for name in ("attnres-block-n8", "attnres-full"):
            assert gpu_check_arms.contract_mismatch(cfg(name), package) is None
    odd = dataclasses.replace(cfg("attnres-full"), size=dataclasses.replace(REGISTRY.size("paper-0.5b"), d_model=768))
    assert "power of two" in gpu_check_arms.contract_mismatch(odd, "flash-attn-res")  # its kernel has no D mask
    assert gpu_check_arms.contract_mismatch(odd, "fla") is None
    for package in gpu_check.PACKAGES:
        assert "projected" in gpu_check_arms.contract_mismatch(cfg("p-lr-block-n8-r32"), package)
        assert gpu_check_arms.contract_mismatch(cfg("s-lr-block-n8-r64-refdefault"), package) is not None  # means, prior
        assert "depth_heads" in gpu_check_arms.contract_mismatch(cfg("s-lr-block-n8-r64-h4"), package)


def test_dry_run(tmp_path):
    """The CPU dry run: every entry, eager and compiled (aot_eager), through the LightningModule's train step,
    without MLflow, litdata or lm-eval."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check-cpu-dry-run.json").read_text())
    assert report["meta"]["heavy_modules_imported"] == []
    ok = {(r["mode"], r["arm"]) for r in report["results"] if r["status"] == "ok"}
    for mode in ("eager", "compile"):
        for arm in ("baseline", *gpu_check.ENTRIES):
            assert (mode, arm) in ok
    skipped = [r for r in report["results"] if r["package"]]
    assert skipped and all(r["status"].startswith(("skipped", "not comparable")) for r in skipped)
    # document masking through the dense mask trains on CPU; FlexAttention (no CPU backward) is skipped, saying why
    assert ("eager", "docmask-sdpa:baseline") in ok and ("eager", "docmask-sdpa:p-lr-block-n8-r32") in ok
    flex = [r for r in report["results"] if r["arm"].startswith("docmask-flex:")]
    assert len(flex) == 2 and all(r["status"] == "skipped: FlexAttention has no backward on cpu" for r in flex)
    decode = {r["arm"]: r for r in report["results"] if r["mode"] == "decode" and r["status"] == "ok"}
    paths = ("", "static:", "static-compiled:")
    assert set(decode) == {"baseline", *gpu_check.ENTRIES} | {  # static arms: baseline and S-LR in a dry run
        p + e for p in paths[1:] for e in ("baseline", gpu_check.ENTRIES[0])}
    assert all(r["ratio_to_path_baseline"] > 0 for r in decode.values())
    assert all(r["tokens"] == 8 and r["tokens_per_s"] > 0 and r["ratio_to_baseline"] > 0 for r in decode.values())
    # first in each mode: litgpt's GPT at the baseline's shape and the profiled S-LR entry beside our baseline
    results = report["results"]
    for mode in ("eager", "compile"):
        first = [r["arm"] for r in results if r["mode"] == mode][:3]
        assert first == ["baseline", "litgpt", "s-lr-block-n8-r64"], first
        litgpt = next(r for r in results if r["mode"] == mode and r["arm"] == "litgpt")
        assert litgpt["status"] == "ok" and litgpt["source"] == "litgpt.utils.chunked_cross_entropy"
    # train arms 10 + litgpt 2 + the later phases' baselines 2, document masking 2, decoding 5 + static 4
    md = (tmp_path / "gpu-check-cpu-dry-run.md").read_text()
    assert md.count("| ok |") == 10 + 2 + 2 + 2 + 5 + 4
    assert "our baseline" in md and "x litgpt's tokens/s" in md
    # the profile: one step each of the baseline, litgpt and S-LR per mode, written beside the report too
    profiles = json.loads((tmp_path / "gpu-check-cpu-dry-run-profile.json").read_text())["profiles"]
    assert profiles == report["profiles"]
    assert [(p["mode"], p["arm"]) for p in profiles] == [(m, a) for m in ("eager", "compile")
                                                         for a in ("baseline", "litgpt", "s-lr-block-n8-r64")]
    for p in profiles:
        eager_ours = p["mode"] == "eager" or p["arm"] == "litgpt"  # compiled: the loss inside the decoder's region
        assert list(p["phases"]) == (["data", "forward", "loss", "backward", "optimizer"] if eager_ours
                                     else ["data", "forward+loss", "backward", "optimizer"])
        total = sum(ph["host_ms"] for ph in p["phases"].values())
        assert 0.5 * p["step_ms"] < total <= p["step_ms"] * 1.01, (total, p["step_ms"])
        assert len(p["top"]) == gpu_check_profile.TOP and p["top"][0]["ms"] >= p["top"][-1]["ms"] > 0
        assert "aten::is_nonzero" in p["host_reads"]  # bool() of the loss's finiteness (ours) or of the grad norm
    assert "## Where a step's time goes" in md and md.count("Top 15 by self CPU time") == 6


def test_litgpt_anchor_has_our_baselines_shape():
    """litgpt's GPT at paper-0.5b, unpadded, holds our baseline's parameters exactly, less its RMSNorm weights
    (ours are parameter-free); litgpt's padding adds (padded - vocab) rows to the embedding and the head."""
    Config, GPT, loss, source = gpu_check_litgpt.load()
    cfg = REGISTRY.model("paper-0.5b", "baseline")
    with torch.device("meta"):
        theirs = GPT(gpu_check_litgpt.config(Config, cfg, pad=1))
        padded = GPT(gpu_check_litgpt.config(Config, cfg))
        ours = build_decoder(cfg)

    def count(model, norms=True):  # litgpt's RMSNorm weights: norm_1, norm_2, norm_q, norm_k, ln_f
        return sum(p.numel() for n, p in model.named_parameters() if norms or not ("norm" in n or "ln_f" in n))

    assert count(theirs, norms=False) == count(ours) > 3e8
    assert count(theirs) - count(theirs, norms=False) == (2 * 24 + 1) * 1024 + 24 * 2 * 64  # pre-norms, final, QK
    extra = padded.config.padded_vocab_size - cfg.size.vocab_size
    assert padded.config.padded_vocab_size % 512 == 0 and count(padded) - count(theirs) == 2 * extra * 1024


@pytest.mark.parametrize("rows", [1, 127, 128, 129, 300])
def test_chunked_cross_entropy_stand_in_equals_litgpts(rows):
    """The stand-in loss (where litgpt.utils cannot be imported) is litgpt's chunked cross-entropy, at every
    position of its 128-row chunk boundary, and the plain mean cross-entropy."""
    import litgpt.utils  # (litgpt's own, loaded by gpu_check_litgpt.load above without its package __init__)

    gen = torch.Generator().manual_seed(rows)
    logits, targets = torch.randn(1, rows, 97, generator=gen, dtype=torch.float64), torch.randint(0, 97, (1, rows))
    ours = gpu_check_litgpt.chunked_cross_entropy(logits, targets)
    torch.testing.assert_close(ours, litgpt.utils.chunked_cross_entropy(logits, targets), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, torch.nn.functional.cross_entropy(logits[0], targets[0]), rtol=1e-12, atol=1e-12)


def test_phase_clock_and_summary():
    """The phase clock sums each phase between marks, names a forward without a loss mark forward+loss, and the
    CPU summary sorts ops by self time and counts host reads."""
    clock = gpu_check_profile.PhaseClock(torch.device("cpu"))
    clock("forward")  # not armed: nothing recorded
    assert clock.marks == []
    clock.arm()
    for phase in ("data", "forward", "backward", "optimizer", "end"):
        clock(phase)
    assert list(clock.phases()) == ["data", "forward+loss", "backward", "optimizer"]
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (x @ x).sum().item()
        bool((x > 0).any())
    summary = gpu_check_profile.summarise(prof.key_averages(), torch.device("cpu"), 1.0)
    assert summary["host_reads"]["aten::_local_scalar_dense"] == 4 and summary["host_reads"]["aten::is_nonzero"] == 1
    assert [t["ms"] for t in summary["top"]] == sorted((t["ms"] for t in summary["top"]), reverse=True)
    assert summary["kernels_launched"] is None and summary["syncs"] == {}


def test_parity_check_runs_and_flags_a_wrong_operator():
    """The on-device parity check, run on CPU with the contract stand-in (passes) and a wrong operator (fails)."""
    args = gpu_check.parse_args(["--dry-run"])
    cpu = torch.device("cpu")
    good = gpu_check_arms.parity(REGISTRY, args, cpu, "s-lr-block-n8-r64", contract_op)
    assert good["ok"] and good["worst_rel_err_package"] < 0.1

    def uniform(sources, query):  # ignores the query: routing always uniform
        return torch.stack(sources).float().mean(0)

    assert not gpu_check_arms.parity(REGISTRY, args, cpu, "s-lr-block-n8-r64", uniform)["ok"]


@pytest.mark.parametrize("flags, says", [(["--modes", "eagr"], "--modes: unknown 'eagr'"),
                                         (["--packages", "liger-kernel"], "--packages: unknown 'liger-kernel'"),
                                         (["--doc-masking", "flash"], "--doc-masking: unknown 'flash'"),
                                         (["--doc-masking-arms", "p-lr-blok-n8-r32"], "closest: p-lr-block-n8-r32"),
                                         (["--arms", "s-lr-blok-n8-r64"], "closest: s-lr-block-n8-r64")])
def test_bad_input_fails_with_one_line_before_any_work(tmp_path, monkeypatch, capsys, flags, says):
    """On the GPU machine a typo must cost seconds, not a batch search of paper-0.5b (the script's main in this
    process, as test_dry_run runs it whole in its own)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # (main puts the checkout first)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # (main sets it for the GPU)
    try:
        code = gpu_check.main([*flags, "--out", str(tmp_path)])
    except SystemExit as stop:  # argparse's error
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert says in err.strip().splitlines()[-1], err  # one line (argparse's usage above it), no traceback
    assert not list(tmp_path.iterdir())  # nothing written


def test_compile_table_of_the_gpus_architecture():
    """The GPU run's compile table, here for sm_90 at size small and one entry: every kernel it launches (block
    reads two-phase) compiled, one row per (kernel, width, dtype), within the register budget."""
    pytest.importorskip("triton")
    table = gpu_check_report.compile_table(REGISTRY, ["small"], torch.device("cpu"), 90, 1, entries=["s-lr-block-size4-r64"])
    assert table["unsupported"] is None and table["failures"] == [] and table["specs"] >= 6
    rows = {(r["kernel"], r["dtype"]) for r in table["summary"]}
    assert {k for k, _ in rows} == {"read_fwd", "read_bwd", "group_fwd", "group_bwd", "merge_fwd", "merge_bwd"}
    assert all(0 < r["regs"] <= 128 and r["programs_per_sm"] >= 1 for r in table["summary"])
    md = gpu_check_report.compile_markdown({"triton_compile": table, "triton_jit": []})
    assert any(line.startswith("| group_bwd | 128 | bf16-autocast |") for line in md)


def test_impls_are_the_backend_tables_names():
    """gpu-check reads the backend names from backends.py's source (its argument check needs no torch): the
    same names, in the same order, as the table itself."""
    from lrattn_lightning.model.routing.attnres.backends import IMPLS

    assert gpu_check.IMPLS == IMPLS
