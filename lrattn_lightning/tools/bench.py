"""`lrattn bench`: step time, throughput, memory and MFU of ablations against the baseline, in one process.

For one size and a list of ablations, every model is built and warmed up, then timed round by round:
in each round every ablation runs right after a baseline step (B A1 B A2 ...), so each ablation has a
ratio to the baseline step measured next to it; the table reports medians. Phases:

    train      forward + backward + optimiser step (AdamW on all parameters; see `make_optimizer`)
    forward    inference-style forward of a full sequence (no autograd)
    generate   greedy decoding with the KV cache: a prompt, then one token at a time

Memory is measured in a separate, untimed step. On CUDA: torch.cuda.max_memory_allocated. On CPU: the
same quantity from the profiler's allocation events (live tensor bytes at the step's peak, including
parameters and optimiser state), and, with `--memory alloc,rss`, the peak RSS of a fresh process that
builds the model and runs the same steps (includes the interpreter and torch, ~0.3-0.5 GB).

Model FLOPs come from `accounting.model_flops_per_token`; MFU is against a peak measured on the spot
(the best of a few large matmuls in the same dtype, timed with the steps' clock) unless `--peak-flops`
gives one. An MFU above 100 % is an error (the peak and the steps would disagree on what a second is).

Roofline (train and forward phases): per ablation, the bytes the routing must move per step
(`roofline.routing_traffic`: a minimal-traffic model, net of the residual stream it replaces), the
memory bandwidth measured in the same process with the same clock (a large out-of-place add), the
implied floor time, and routing efficiency = floor / (step - baseline step), the step difference taken
pairwise per round. `--profile N` adds torch.profiler per-op tables (ablation minus baseline).

    python -m lrattn_lightning.tools.bench --size small --ablations s-lr-block-n8-r64,attnres-full --mode both
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lrattn_lightning.errors import Parser

PHASES = ("train", "forward", "generate")
MODES = ("eager", "compile")


def make_optimizer(model: Any, lr: float = 3e-4) -> Any:
    """The optimiser a train step uses. Hook: swap in the training module's optimiser groups (Muon for
    matrices, AdamW for the rest) once `lit_module.py` exists; for now AdamW on every parameter."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="lrattn bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help="registry size name")
    p.add_argument("--ablations", default="s-lr-block-n8-r64,p-lr-block-n8-r32,attnres-block-n8,attnres-full",
                   help="comma-separated ablation names, each timed against --baseline")
    p.add_argument("--baseline", default="baseline", help="the ablation every ratio is taken against")
    p.add_argument("--registry", default=None, help="registry.yaml path (default: the packaged one)")
    p.add_argument("--phase", choices=PHASES, default="train")
    p.add_argument("--mode", choices=(*MODES, "both"), default="eager", help="eager, torch.compile, or both")
    p.add_argument("--impl", choices=("fast", "reference", "compiled"), default="fast",
                   help="AttnRes backend (--mode compile runs fast as compiled)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --mode compile")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="set a torch._inductor.config option for every model (repeatable), e.g. cpp_wrapper=true")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the size's seq_len)")
    p.add_argument("--prompt-len", type=int, default=16, help="generate: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="generate: tokens decoded per timed step")
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model before timing (compilation included)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype; bfloat16 runs under autocast with float32 parameters")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall-clock time, or this process's CPU time (robust on a shared machine; with one "
                        "thread it is single-core compute time, with more it sums the threads; CPU device only)")
    p.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s for MFU (default: measured)")
    p.add_argument("--memory", default="alloc", help="comma list of alloc, rss (fresh-process peak RSS, CPU), or none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", choices=("plain", "module"), default="plain",
                   help="train phase: plain = forward, cross-entropy, backward, AdamW (routing in isolation); "
                        "module = LRAttnModule.training_step under Fabric with the module's own optimiser "
                        "(Muon + AdamW, z-loss), what `lrattn fit` runs (imports Lightning)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory bandwidth in bytes/s for the roofline (default: measured, a large add)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N steps per model and print each ablation's per-op self time "
                        "minus the baseline's (torch.profiler; compiled kernels by their Inductor names)")
    p.add_argument("--fit", action="store_true",
                   help="clip rank and block count of ablations that do not fit the size (smoke tests only)")
    p.add_argument("--json", default=None, help="output JSON path (default: runs/bench/<size>-<phase>-<time>.json)")
    p.add_argument("--mlflow", action="store_true",
                   help="log the results to MLflow (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    p.add_argument("--mlflow-experiment", default="lrattn-bench")
    p.add_argument("--rss-probe", default=None, help=argparse.SUPPRESS)  # internal: "<mode>:<ablation>"
    return p


# ---- models and steps ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Subject:
    """One model under test and its step function."""

    name: str
    cfg: Any
    model: Any
    step: Callable[[], None]
    tokens_per_step: int
    flops_per_step: float
    optimizer: Any = None
    times: list[float] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)


def _autocast(device, dtype):
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _model_config(args, reg, ablation: str):
    from lrattn_lightning.model.config import ModelConfig, fit_to_size

    if args.fit:
        size = reg.size(args.size)
        return ModelConfig(size, fit_to_size(reg.ablation(ablation), size))
    return reg.model(args.size, ablation)


def _size_for(cfg, seq_len: int):
    """The config with seq_len replaced (for FLOPs of the sequence actually run)."""
    from lrattn_lightning.model.config import ModelConfig

    return ModelConfig(dataclasses.replace(cfg.size, seq_len=seq_len), cfg.ablation)


def plain_train_step(model, inputs, targets, device, dtype, mode: str = "eager",
                     backend: str = "inductor") -> tuple[Callable[[], None], Any]:
    """The plain train step: forward, float32 cross-entropy, backward, AdamW (`make_optimizer`); in compile
    mode the forward and the loss are one torch.compile region. -> (step, optimizer)."""
    import torch
    import torch.nn.functional as F

    def loss_of(x, y):
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    loss_fn = torch.compile(loss_of, backend=backend) if mode == "compile" else loss_of
    opt = make_optimizer(model)

    def step() -> None:
        with _autocast(device, dtype):
            loss = loss_fn(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def make_subject(args, reg, ablation: str, mode: str, device, dtype) -> Subject:
    import torch

    from lrattn_lightning.model.accounting import model_flops_per_token
    from lrattn_lightning.model.decoder import KVCache, build_decoder
    from lrattn_lightning.model.routing.base import compile_impl

    cfg = _model_config(args, reg, ablation)
    T = args.seq_len or cfg.size.seq_len
    B = args.batch_size
    torch.manual_seed(args.seed)
    model = build_decoder(cfg, impl=compile_impl(args.impl) if mode == "compile" else args.impl).to(device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx = torch.randint(0, cfg.size.vocab_size, (B, T + 1), generator=gen).to(device)
    inputs, targets = idx[:, :-1], idx[:, 1:]

    if args.phase == "train" and args.step == "module":
        return _module_subject(args, cfg, ablation, mode, device, dtype, idx)

    if args.phase == "train":
        step, opt = plain_train_step(model, inputs, targets, device, dtype, mode, args.compile_backend)
        flops = model_flops_per_token(_size_for(cfg, T), training=True) * B * T
        return Subject(ablation, cfg, model, step, B * T, flops, optimizer=opt)

    if args.phase == "forward":
        fwd = torch.compile(model, backend=args.compile_backend) if mode == "compile" else model

        def step() -> None:
            with torch.inference_mode(), _autocast(device, dtype):
                fwd(inputs)

        flops = model_flops_per_token(_size_for(cfg, T), training=False) * B * T
        return Subject(ablation, cfg, model, step, B * T, flops)

    # generate: prefill the prompt, then decode new tokens one by one with the KV cache
    if mode == "compile":
        raise ValueError("--phase generate supports --mode eager only (the KV cache changes shape every token)")
    P, G = args.prompt_len, args.new_tokens
    if P + G > cfg.size.seq_len:
        raise ValueError(f"--prompt-len + --new-tokens = {P + G} exceeds seq_len={cfg.size.seq_len}")
    prompt = idx[:, :P]

    def step() -> None:
        with torch.inference_mode(), _autocast(device, dtype):
            cache = KVCache.empty(cfg.size.n_layers)
            nxt = model(prompt, cache=cache)[:, -1].argmax(-1, keepdim=True)
            for _ in range(G - 1):
                nxt = model(nxt, cache=cache)[:, -1].argmax(-1, keepdim=True)

    # decode FLOPs: the forward of one token attending over its context (the mean context of the run)
    per_token = model_flops_per_token(_size_for(cfg, 1), training=False)
    mean_ctx = P + (G - 1) / 2
    attention = 2 * 2 * cfg.size.n_layers * cfg.size.d_model * mean_ctx
    flops = (per_token + attention) * B * G
    return Subject(ablation, cfg, model, step, B * G, flops)


def _module_subject(args, cfg, ablation: str, mode: str, device, dtype, idx) -> Subject:
    """The train step `lrattn fit` runs: LRAttnModule.training_step (loss + z-loss, logging calls) under
    Fabric (no loggers), backward, and the module's own optimiser (`make_optimizer`: Muon + AdamW by
    default), without the LR schedule. Compile mode compiles the decoder as the module's `compile` does."""
    import torch
    from lightning.fabric import Fabric

    from lrattn_lightning.model.accounting import model_flops_per_token
    from lrattn_lightning.model.routing.base import compile_impl
    from lrattn_lightning.train.lit_module import LRAttnModule

    torch.manual_seed(args.seed)
    module = LRAttnModule(model_config=cfg.to_dict(), impl=compile_impl(args.impl) if mode == "compile" else args.impl)
    fabric = Fabric(accelerator=device.type, devices=1, precision="32-true")
    opt = module.make_optimizer()
    module, opt = fabric.setup(module, opt)
    if mode == "compile":
        module.model.compile(backend=args.compile_backend)
    batch = idx.to(fabric.device)
    counter = iter(range(1 << 62))

    def step() -> None:
        with _autocast(device, dtype):
            loss = module.training_step(batch, next(counter))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    B, T = batch.shape[0], batch.shape[1] - 1
    flops = model_flops_per_token(_size_for(cfg, T), training=True) * B * T
    return Subject(ablation, cfg, module.model, step, B * T, flops, optimizer=opt)


# ---- measurements -----------------------------------------------------------------------------------
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


def measure_peak_flops(device, dtype, clock: Callable[[], float] = time.perf_counter) -> float:
    """FLOP/s of the best of a few large square matmuls in `dtype` on `device`, timed with `clock` (the
    clock the steps are timed with: with --clock cpu, FLOP per CPU-second, like the steps)."""
    import torch

    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(8):
        _sync(device)
        t0 = clock()
        for _ in range(4):
            a @ b
        _sync(device)
        if i:  # the first call warms up
            best = min(best, (clock() - t0) / 4)
    return 2 * n**3 / max(best, 1e-12)


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
    from torch.profiler import ProfilerActivity

    from lrattn_lightning.tools.profiling import quiet_profile

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        subject.step()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    opt_state = subject.optimizer.state if subject.optimizer is not None else None
    return _param_and_state_bytes(subject.model, opt_state) + peak


def rss_probes(args, mode: str, ablations: list[str]) -> dict[str, int]:
    """Peak RSS (bytes) of fresh processes, one per ablation, that build the model and run warm-up + 2
    steps. They run concurrently (each process's own peak is what is read), after the timing."""
    env = dict(os.environ)  # the probe imports this very package, wherever it is installed from
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    common = []
    for key in ("size", "phase", "step", "impl", "compile_backend", "batch_size", "seq_len", "prompt_len", "new_tokens",
                "warmup", "dtype", "device", "threads", "seed", "registry"):
        value = getattr(args, key)
        if value is not None:
            common += [f"--{key.replace('_', '-')}", str(value)]
    if args.fit:
        common.append("--fit")
    for item in args.inductor:
        common += ["--inductor", item]
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "lrattn_lightning.tools.bench", "--rss-probe", f"{mode}:{name}", *common],
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


def _run_rss_probe(args, device, dtype, reg) -> int:
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


# ---- the benchmark ------------------------------------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    with contextlib.suppress(Exception):
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    return None


def _quartiles(values: list[float]) -> list[float]:
    """[p25, p75] of the pairwise ratios: how much the machine's noise moved them."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def apply_inductor_options(options: list[str]) -> dict[str, Any]:
    """--inductor KEY=VALUE: set torch._inductor.config attributes (dotted keys reach sub-configs)."""
    import torch._inductor.config as config

    applied = {}
    for item in options:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--inductor {item!r}: expected KEY=VALUE")
        value: Any = {"true": True, "false": False}.get(raw.lower(), raw)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(raw) if "." in raw else int(raw)
        *path, leaf = key.split(".")
        target = config
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, leaf):
            raise ValueError(f"--inductor {item!r}: torch._inductor.config has no option {key!r}")
        setattr(target, leaf, value)
        applied[key] = value
    return applied


def _clock(args) -> Callable[[], float]:
    return time.process_time if args.clock == "cpu" else time.perf_counter


def _value_bytes(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def roofline_row(subject: Subject, base: Subject, args, dtype, bandwidth: float, peak: float) -> dict:
    """Analytic routing bytes, floor time and routing efficiency of one ablation (train/forward phases)."""
    from lrattn_lightning.tools.roofline import routing_traffic

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


def run_mode(args, reg, mode: str, names: list[str], device, dtype, peak: float, bandwidth: float,
             memory: set[str]) -> list[dict]:
    import torch

    if args.profile and mode == "compile":  # compiled CPU kernels show up in the profile under their names
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    subjects = {name: make_subject(args, reg, name, mode, device, dtype) for name in [args.baseline, *names]}
    for s in subjects.values():  # warm-up (and compilation) per model
        for _ in range(args.warmup):
            s.step()
    base = subjects[args.baseline]
    clock = _clock(args)
    for _ in range(args.steps):  # B A1 B A2 ...: each ablation's ratio is against the baseline step just before
        for name in names:
            t_base = timed(base, device, clock)
            base.times.append(t_base)
            t = timed(subjects[name], device, clock)
            subjects[name].times.append(t)
            subjects[name].ratios.append(t / t_base)
    if not names:
        base.times.extend(timed(base, device, clock) for _ in range(args.steps))
    base.ratios = [1.0] * len(base.times)
    mem = {n: measure_peak_memory(s, device) for n, s in subjects.items()} if "alloc" in memory else {}
    rss = {}
    if "rss" in memory and device.type == "cpu":
        rss = rss_probes(args, mode, list(subjects))
    profiles = {}
    if args.profile:
        from lrattn_lightning.tools.profiling import op_diff, op_times

        times = {n: op_times(s.step, args.profile) for n, s in subjects.items()}
        profiles = {n: op_diff(times[n], times[args.baseline]) for n in names}
    rows = []
    for name, s in subjects.items():
        median = statistics.median(s.times)
        achieved = s.flops_per_step / median
        row = {
            "mode": mode, "ablation": name, "impl": args.impl,
            "median_step_s": median, "step_times_s": s.times,
            "tokens_per_s": s.tokens_per_step / median,
            "ratio_to_baseline": statistics.median(s.ratios),
            "ratio_quartiles": _quartiles(s.ratios),
            "ratios_per_pair": s.ratios,
            "peak_mem_bytes": mem.get(name), "mem_ratio": None,
            "peak_rss_bytes": rss.get(name), "rss_ratio": None,
            "model_flops_per_step": s.flops_per_step,
            "achieved_flops": achieved, "mfu": achieved / peak,
            **roofline_row(s, base, args, dtype, bandwidth, peak),
            "profile": profiles.get(name),
        }
        if mem:
            row["mem_ratio"] = mem[name] / mem[args.baseline]
        if rss:
            row["rss_ratio"] = rss[name] / rss[args.baseline]
        rows.append(row)
    del subjects
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run_bench(args) -> dict[str, Any]:
    import torch

    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.tools.roofline import measure_bandwidth

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    reg = load_registry(args.registry)
    inductor_options = apply_inductor_options(args.inductor)
    names = [n for n in args.ablations.split(",") if n and n != args.baseline]
    for name in [args.baseline, *names]:  # fail on a bad name or pair before any timing
        _model_config(args, reg, name)
    memory = {m for m in args.memory.split(",") if m and m != "none"}
    if memory - {"alloc", "rss"}:
        raise ValueError(f"--memory: unknown {sorted(memory - {'alloc', 'rss'})}; use alloc, rss or none")
    if args.clock == "cpu" and device.type != "cpu":
        raise ValueError("--clock cpu measures this process's CPU time: use it with --device cpu")
    clock = _clock(args)  # the peak, the bandwidth and the steps are all timed with this one clock
    peak_source = "given" if args.peak_flops else f"measured: best {args.dtype} matmul, {args.clock} clock"
    peak = args.peak_flops or measure_peak_flops(device, dtype, clock)
    bandwidth_source = "given" if args.bandwidth else f"measured: best large add (c = a + b), {args.clock} clock"
    bandwidth = args.bandwidth or measure_bandwidth(device, clock)
    modes = list(MODES) if args.mode == "both" else [args.mode]
    rows = []
    for mode in modes:
        rows += run_mode(args, reg, mode, names, device, dtype, peak, bandwidth, memory)
    size = reg.size(args.size)
    return {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "lrattn bench " + " ".join(args.argv),
            "size": args.size, "baseline": args.baseline, "phase": args.phase, "impl": args.impl,
            "step": args.step if args.phase == "train" else None,
            "compile_backend": args.compile_backend if args.mode != "eager" else None,
            "inductor_options": inductor_options,
            "batch_size": args.batch_size, "seq_len": args.seq_len or size.seq_len,
            "prompt_len": args.prompt_len if args.phase == "generate" else None,
            "new_tokens": args.new_tokens if args.phase == "generate" else None,
            "steps": args.steps, "warmup": args.warmup, "clock": args.clock, "dtype": args.dtype, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "peak_flops": peak, "peak_flops_source": peak_source,
            "bandwidth_bytes_per_s": bandwidth, "bandwidth_source": bandwidth_source,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "memory": "cuda max_memory_allocated" if device.type == "cuda" else "profiler allocation peak" + (
                " + fresh-process peak RSS" if "rss" in memory else ""),
            "git_commit": _git_commit(), "registry_sha256": reg.sha256,
        },
        "results": rows,
    }


def check_report(report: dict[str, Any]) -> None:
    """An MFU above 100 % means the peak and the steps disagree (different clocks, a wrong --peak-flops)."""
    over = [f"{r['mode']}/{r['ablation']}: {100 * r['mfu']:.0f} %" for r in report["results"] if r["mfu"] > 1.0]
    if over:
        m = report["meta"]
        raise RuntimeError(f"MFU above 100 % ({', '.join(over)}) against a peak of {m['peak_flops'] / 1e9:.1f} "
                           f"GFLOP/s ({m['peak_flops_source']}): the peak is wrong for this clock/device; "
                           "measure it (omit --peak-flops) or give the device's true peak")


def format_table(report: dict[str, Any]) -> str:
    m = report["meta"]
    bw = m.get("bandwidth_bytes_per_s")
    lines = [
        f"lrattn bench  size={m['size']} phase={m['phase']} impl={m['impl']} dtype={m['dtype']} "
        f"device={m['device_name']} threads={m['threads']} clock={m['clock']} batch={m['batch_size']} seq={m['seq_len']} "
        f"steps={m['steps']} peak={m['peak_flops'] / 1e9:.1f} GFLOP/s ({m['peak_flops_source']})"
        + (f" bandwidth={bw / 1e9:.1f} GB/s" if bw else ""),
        f"{'mode':8s} {'ablation':28s} {'step ms':>9s} {'tok/s':>9s} {'x base':>7s} {'p25-p75':>11s} {'mem MB':>8s} {'x base':>7s} "
        f"{'rss MB':>8s} {'x base':>7s} {'GFLOP/s':>8s} {'MFU %':>6s} {'MB net':>7s} {'floor ms':>8s} {'+ms':>7s} {'eff':>5s}",
    ]

    def num(v, fmt):
        return format(v, fmt) if v is not None else format("-", f">{fmt.split('.')[0]}")

    for r in report["results"]:
        traffic = r.get("traffic")
        lines.append(
            f"{r['mode']:8s} {r['ablation']:28s} {r['median_step_s'] * 1e3:9.1f} {r['tokens_per_s']:9.0f} "
            f"{r['ratio_to_baseline']:7.3f} {r['ratio_quartiles'][0]:5.2f}-{r['ratio_quartiles'][1]:<5.2f} "
            f"{num(r['peak_mem_bytes'] and r['peak_mem_bytes'] / 2**20, '8.1f')} "
            f"{num(r['mem_ratio'], '7.3f')} {num(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 2**20, '8.1f')} "
            f"{num(r['rss_ratio'], '7.3f')} {r['achieved_flops'] / 1e9:8.2f} {100 * r['mfu']:6.2f} "
            f"{num(traffic and traffic['net_bytes'] / 1e6, '7.1f')} {num(r.get('floor_s') and r['floor_s'] * 1e3, '8.2f')} "
            f"{num(r.get('overhead_s') and r['overhead_s'] * 1e3, '7.1f')} {num(r.get('routing_efficiency'), '5.2f')}"
        )
    for r in report["results"]:
        if r.get("profile"):
            lines.append(f"profile {r['mode']}/{r['ablation']}: self time per step, minus {m['baseline']}")
            lines += [f"  {p['delta_ms']:+8.2f} ms  {p['op'][:90]:90s} {p['calls']:6.0f} calls (base {p['base_calls']:.0f})"
                      for p in r["profile"]]
    return "\n".join(lines)


def log_mlflow(report: dict[str, Any], experiment: str) -> None:
    import mlflow

    m = report["meta"]
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri("sqlite:///mlflow.db")
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=f"bench-{m['size']}-{m['phase']}-{m['impl']}"):
        mlflow.log_params({k: v for k, v in m.items() if not isinstance(v, list | dict)})
        for r in report["results"]:
            prefix = f"bench/{r['mode']}/{r['ablation']}"
            for key in ("median_step_s", "tokens_per_s", "ratio_to_baseline", "peak_mem_bytes", "mem_ratio",
                        "peak_rss_bytes", "rss_ratio", "achieved_flops", "mfu", "floor_s", "overhead_s",
                        "routing_efficiency"):
                if r[key] is not None:
                    mlflow.log_metric(f"{prefix}/{key}", float(r[key]))
        mlflow.log_dict(report, "bench.json")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.rss_probe:
        import torch

        from lrattn_lightning.model.registry import load_registry

        if args.threads:
            torch.set_num_threads(args.threads)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        apply_inductor_options(args.inductor)
        return _run_rss_probe(args, device, getattr(torch, args.dtype), load_registry(args.registry))
    report = run_bench(args)
    print(format_table(report))
    path = Path(args.json or f"runs/bench/{args.size}-{args.phase}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    check_report(report)  # after writing: the numbers stay inspectable
    if args.mlflow:
        log_mlflow(report, args.mlflow_experiment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
