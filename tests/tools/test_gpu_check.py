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
from conftest import REPO_ROOT

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
                          text=True, timeout=300)
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
    assert set(decode) == {"baseline", *gpu_check.ENTRIES}
    assert all(r["tokens"] == 8 and r["tokens_per_s"] > 0 and r["ratio_to_baseline"] > 0 for r in decode.values())
    assert (tmp_path / "gpu-check-cpu-dry-run.md").read_text().count("| ok |") == 10 + 2 + 5


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
def test_bad_input_fails_with_one_line_before_any_work(tmp_path, flags, says):
    """On the GPU machine a typo must cost seconds, not a batch search of paper-0.5b."""
    done = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert says in done.stderr and "Traceback" not in done.stderr
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
