"""benchmarks/gpu-check's report: the triton kernels compiled for the GPU's architecture and as the driver loaded
them, the JSON report's metadata and its markdown. Imported by the script from its own folder.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import sys
import time

from gpu_check_profile import markdown as profile_markdown

HEAVY = ("mlflow", "litdata", "lm_eval")  # not on the GPU machine; Lightning and torchmetrics are


def compile_table(reg, sizes: list[str], device, arch: int, jobs: int, entries: list[str] | None = None) -> dict:
    """The triton kernels compiled for this GPU's architecture (docs/benchmarks.md, as CI does for sm_80/90/100):
    every launch of every AttnRes entry at `sizes` recorded on `device` (nothing runs), each distinct
    specialisation compiled for sm_`arch` with this machine's triton; registers, spills, shared memory and
    programs per SM per (kernel, width, dtype)."""
    from lrattn_lightning.tools.kernels import compile_check as triton_compile
    from lrattn_lightning.tools.kernels import specs as triton_specs

    t0 = time.perf_counter()
    records = triton_specs.launches(sizes, entries=entries, device=device, reg=reg)
    report = triton_compile.check(records, (arch,), jobs)
    return {"arch": arch, "sizes": sizes, "seconds": time.perf_counter() - t0, "triton": report["triton"],
            "specs": len(report["specs"]), "unsupported": report["archs"][str(arch)]["unsupported"],
            "failures": triton_compile.failures(report), "summary": triton_specs.summary(records, report)}


def jit_resources() -> list[dict]:
    """The kernels the triton arms JIT-compiled here, as the driver loaded them: registers and spills per
    thread (a check of the compile table's cuobjdump numbers)."""
    import importlib

    try:
        kernels = importlib.import_module("lrattn_lightning.model.routing.attnres.triton.kernels")
    except ImportError:
        return []
    rows = []
    for name in ("read_fwd", "read_bwd", "group_fwd", "group_bwd", "merge_fwd", "merge_bwd"):
        for entry in getattr(getattr(kernels, name, None), "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) and isinstance(entry[0], dict) else {}
            for kernel in cache.values():
                with contextlib.suppress(Exception):  # (a triton whose internals differ: no rows)
                    kernel._init_handles()
                    rows.append({"kernel": name, "num_warps": kernel.metadata.num_warps, "n_regs": kernel.n_regs,
                                 "n_spills": kernel.n_spills, "shared": kernel.metadata.shared})
    return rows


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {}
    for dist in ("torch", "triton", "lightning", "litgpt", "fast-attnres", "liger-kernel"):
        with contextlib.suppress(Exception):
            versions[dist] = md.version(dist)
    return versions


def _report(args, rows, *, device, device_name, batch, search, peak, peak_source, notes, t_start) -> dict:
    import torch

    return {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": "benchmarks/gpu-check "
            + " ".join(sys.argv[1:]), "dry_run": args.dry_run, "device": str(device), "device_name": device_name,
            "size": args.size, "seq_len": args.seq_len, "batch": batch, "batch_search": search, "dtype": "bfloat16 autocast",
            "train_step": "LRAttnModule.training_step under Fabric (bf16-mixed)", "optimizer": args.optimizer,
            "loss_impl": "auto: the head fused into the loss in row chunks in eager arms on CUDA (no [tokens, vocab] "
            "logits), the logits when compiled or on CPU; AdamW fused on CUDA",
            "compile_backend": args.compile_backend, "warmup": args.warmup, "rounds": args.rounds,
            "peak_flops": peak, "peak_flops_source": peak_source, "versions": _versions(), "packages": notes,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "seconds": time.perf_counter() - t_start, "budget_s": args.budget_s,
            "heavy_modules_imported": sorted(m for m in HEAVY if m in sys.modules),
        },
        "results": rows,
    }


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"# gpu-check: {m['device_name']}", "",
             f"{m['date']}, size {m['size']}, seq {m['seq_len']}, batch {m['batch']}, {m['dtype']}, torch "
             f"{m['versions'].get('torch')}, compile backend {m['compile_backend']}, peak {m['peak_flops'] / 1e12:.0f} "
             f"TFLOP/s ({m['peak_flops_source']}), {m['rounds']} rounds after {m['warmup']} warm-up steps, "
             f"{m['seconds']:.0f} s.", "",
             "| mode | arm | step ms | tok/s | × base | p25-p75 | MFU % | peak GB | × base | status |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['arm']} | | | | | | | | {r['status']} |")
            continue
        q = r["ratio_quartiles"]
        if r["mode"] == "decode":  # step ms: per token; no MFU or memory
            lines.append(f"| decode | {r['arm']} | {r['median_step_s'] * 1e3:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{r['ratio_to_baseline']:.3f} | {q[0]:.2f}-{q[1]:.2f} | - | - | - | ok |")
            continue
        mem = f"{r['peak_mem_bytes'] / 1e9:.1f}" if r.get("peak_mem_bytes") else "-"
        mr = f"{r['mem_ratio']:.3f}" if r.get("mem_ratio") else "-"
        lines.append(f"| {r['mode']} | {r['arm']} | {r['median_step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['ratio_to_baseline']:.3f} | {q[0]:.2f}-{q[1]:.2f} | {100 * r['mfu']:.1f} | {mem} | {mr} | ok |")
    return "\n".join(lines + anchor_markdown(report) + profile_markdown(report.get("profiles") or [])
                     + compile_markdown(report)) + "\n"


def anchor_markdown(report: dict) -> list[str]:
    """Our baseline against litgpt's GPT, per mode: tokens/s of each and their ratio (the same rounds)."""
    lines = []
    for r in report["results"]:
        if r["arm"] == "litgpt" and r["status"] == "ok":
            ours = 1.0 / r["ratio_to_baseline"]  # the pairwise median of litgpt's step over our baseline's
            q = r["ratio_quartiles"]
            lines.append(f"- {r['mode']}: our baseline {ours:.3f}x litgpt's tokens/s (p25-p75 {1 / q[1]:.2f}-"
                         f"{1 / q[0]:.2f}; litgpt {r['tokens_per_s']:.0f} tok/s, MFU {100 * r['mfu']:.1f} %; loss: "
                         f"{r.get('source')})")
        elif r["arm"] == "litgpt":
            lines.append(f"- {r['mode']}: litgpt {r['status']}")
    if not lines:
        return []
    return ["", "## Against litgpt (its GPT at our baseline's shape, its pretraining step, interleaved rounds)", "",
            *lines]


def compile_markdown(report: dict) -> list[str]:
    """The compile table of this GPU's architecture and the driver's view of the kernels the arms ran."""
    c = report.get("triton_compile")
    if not c:
        return []
    if "error" in c:
        return ["", f"Triton compile table: failed ({c['error']})."]
    lines = ["", f"## Triton kernels compiled for sm_{c['arch']} (triton {c['triton']}, sizes {', '.join(c['sizes'])})",
             "", f"{c['specs']} specialisations, {len(c['failures'])} over the budget (<= 128 registers per thread, "
             "no spills); occupancy is a proxy until the rows above measure time.", "",
             "| kernel | d | dtype | specs | warps | registers | shared KiB | spilled B | programs per SM |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in c["summary"]:
        lines.append(f"| {r['kernel']} | {r['d_model']} | {r['dtype']} | {r['specs']} | "
                     f"{','.join(map(str, r['warps']))} | {r['regs']} | {r['shared'] / 1024:.1f} | {r['spills']} | "
                     f"{r['programs_per_sm']} |")
    lines += [f"- {f}" for f in c["failures"]]
    jit = report.get("triton_jit") or []
    if jit:
        lines += ["", "Loaded by the driver (kernels the triton arms ran): " + "; ".join(
            f"{j['kernel']} {j['num_warps']} warps {j['n_regs']} registers {j['n_spills']} spills" for j in jit)]
    return lines
