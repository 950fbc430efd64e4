"""How `lrattn bench` measures its subjects (steps.py): interleaved timing, peak memory, the roofline.

Every model is warmed up, then timed round by round: in each round every ablation runs right after a
baseline step (B A1 B A2 ...), so each ablation has a ratio to the baseline step measured next to it.
Memory is measured in a separate, untimed step: on CUDA torch.cuda.max_memory_allocated; on CPU the same
quantity from the profiler's allocation events, and optionally the peak RSS of fresh processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lrattn_lightning.core.files import PACKAGE_ROOT
from lrattn_lightning.tools.bench.steps import Subject, make_subject


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(subject: Subject, device, clock: Callable[[], float] = time.perf_counter) -> float:
    _sync(device)
    t0 = clock()
    subject.step()
    _sync(device)
    return clock() - t0


def _param_and_state_bytes(model, opt_state: dict | None = None) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in (opt_state or {}).values():
        total += sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "numel"))
    return total


def measure_peak_memory(subject: Subject, device) -> int:
    """Peak bytes of live tensors during one step (the subject has already run, so optimiser state exists)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        subject.step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from lrattn_lightning.tools.bench.profiling import peak_allocated_bytes

    peak = peak_allocated_bytes(subject.step)
    opt_state = subject.optimizer.state if subject.optimizer is not None else None
    return _param_and_state_bytes(subject.model, opt_state) + peak


# ---- peak RSS of fresh processes ------------------------------------------------------------------------
def rss_probes(args, mode: str, ablations: list[str]) -> dict[str, int]:
    """Peak RSS (bytes) of fresh processes, one per ablation, that build the model and run warm-up + 2
    steps. They run concurrently (each process's own peak is what is read), after the timing."""
    env = dict(os.environ)  # the probe imports this very package, wherever it is installed from
    root = str(PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    common = []
    for key in ("size", "phase", "optimizer", "impl", "compile_backend", "batch_size", "seq_len", "prompt_len",
                "new_tokens", "warmup", "dtype", "device", "threads", "seed", "registry"):
        value = getattr(args, key)
        if value is not None:
            common += [f"--{key}", str(value)]
    if args.fit:
        common.append("--fit")
    for item in args.inductor:
        common += ["--inductor", item]
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "lrattn_lightning.tools.bench.bench", "--rss-probe", f"{mode}:{name}", *common],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name in ablations
    }
    peaks = {}
    for name, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"RSS probe for {name} failed:\n{err[-2000:]}")
        peaks[name] = int(json.loads(out.strip().splitlines()[-1])["peak_rss_bytes"])
    return peaks


def run_rss_probe(args, device, dtype, reg) -> int:
    """The probe process's side: build, run warm-up + 2 steps, print this process's peak RSS as JSON."""
    mode, ablation = args.rss_probe.split(":", 1)
    subject = make_subject(args, reg, ablation, mode, device, dtype)
    for _ in range(max(args.warmup, 1) + 2):
        subject.step()
    print(json.dumps({"peak_rss_bytes": _peak_rss_bytes()}))
    return 0


def _peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM is the high-water mark of the current address space; ru_maxrss
    would also count the parent's pages at fork, which survive exec in Linux's accounting."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# ---- one mode: the rounds and the rows -----------------------------------------------------------------
def _quartiles(values: list[float]) -> list[float]:
    """[p25, p75] of the pairwise ratios: how much the machine's noise moved them."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def _value_bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def roofline_row(subject: Subject, base: Subject, args, dtype, bandwidth: float, peak: float) -> dict:
    """Analytic routing bytes, floor time and routing efficiency of one ablation (train/forward phases)."""
    from lrattn_lightning.tools.bench.roofline import routing_traffic

    if args.phase == "generate":
        return {"traffic": None, "floor_s": None, "overhead_s": None, "routing_efficiency": None}
    traffic = routing_traffic(subject.cfg, tokens=subject.tokens_per_step, value_bytes=_value_bytes(dtype),
                              training=args.phase == "train")
    floor = traffic.floor_s(bandwidth, peak)
    # the step difference to the baseline, pairwise per round (each ablation step follows a baseline step)
    if subject is base:
        overhead = 0.0
    else:  # ratio = t / t_base of the same round
        overhead = statistics.median(t - t / r for t, r in zip(subject.times, subject.ratios, strict=True))
    return {
        "traffic": traffic.to_dict(), "floor_s": floor, "overhead_s": overhead,
        "routing_efficiency": floor / overhead if subject is not base and overhead > 0 else None,
    }


def _interleaved_rounds(subjects: dict[str, Subject], base: Subject, names: list[str], steps: int, device,
                        clock: Callable[[], float]) -> None:
    """B A1 B A2 ...: each ablation's ratio is against the baseline step just before it."""
    for _ in range(steps):
        for name in names:
            t_base = timed(base, device, clock)
            base.times.append(t_base)
            t = timed(subjects[name], device, clock)
            subjects[name].times.append(t)
            subjects[name].ratios.append(t / t_base)
    if not names:
        base.times.extend(timed(base, device, clock) for _ in range(steps))
    base.ratios = [1.0] * len(base.times)


def run_mode(args, reg, mode: str, names: list[str], device, dtype, peak: float, bandwidth: float,
             memory: set[str], clock: Callable[[], float]) -> list[dict]:
    """Build, warm up and time the baseline and every ablation in one mode -> one result row each."""
    import torch

    if args.profile and mode == "compile":  # compiled CPU kernels show up in the profile under their names
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    subjects = {name: make_subject(args, reg, name, mode, device, dtype) for name in [args.baseline, *names]}
    for s in subjects.values():  # warm-up (and compilation) per model
        for _ in range(args.warmup):
            s.step()
    base = subjects[args.baseline]
    _interleaved_rounds(subjects, base, names, args.steps, device, clock)
    mem = {n: measure_peak_memory(s, device) for n, s in subjects.items()} if "alloc" in memory else {}
    rss = rss_probes(args, mode, list(subjects)) if "rss" in memory and device.type == "cpu" else {}
    profiles = {}
    if args.profile:
        from lrattn_lightning.tools.bench.profiling import op_diff, op_times

        times = {n: op_times(s.step, args.profile) for n, s in subjects.items()}
        profiles = {n: op_diff(times[n], times[args.baseline]) for n in names}
    rows = []
    for name, s in subjects.items():
        median = statistics.median(s.times)
        achieved = s.flops_per_step / median
        rows.append({
            "mode": mode, "ablation": name, "impl": args.impl,
            "median_step_s": median, "step_times_s": s.times,
            "tokens_per_s": s.tokens_per_step / median,
            "ratio_to_baseline": statistics.median(s.ratios),
            "ratio_quartiles": _quartiles(s.ratios),
            "ratios_per_pair": s.ratios,
            "peak_mem_bytes": mem.get(name), "mem_ratio": mem[name] / mem[args.baseline] if mem else None,
            "peak_rss_bytes": rss.get(name), "rss_ratio": rss[name] / rss[args.baseline] if rss else None,
            "model_flops_per_step": s.flops_per_step,
            "achieved_flops": achieved, "mfu": achieved / peak,
            **roofline_row(s, base, args, dtype, bandwidth, peak),
            "profile": profiles.get(name),
        })
    del subjects, base
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
