"""`lrattn bench`: step time, throughput, memory and MFU of ablations against the baseline, in one process.

For one size and a list of ablations, every model is built and warmed up, then timed round by round:
in each round every ablation runs right after a baseline step (B A1 B A2 ...), so each ablation has a
ratio to the baseline step measured next to it; the table reports medians (runner.py).
Phases, each the package's own code (steps.py):

    train      LRAttnModule.training_step under Fabric, backward and the module's own optimiser
               (`--optimizer`: adamw by default, or fit's muon_adamw); loss with z-loss, as `lrattn fit`
    forward    inference-style forward of a full sequence (no autograd)
    generate   greedy decoding with the KV cache (`model.generate.generate`): a prompt, then one token at a time

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

    python -m lrattn_lightning.tools.bench.bench --size small --ablations s-lr-block-n8-r64,attnres-full --mode both
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import write_file
from lrattn_lightning.core.flags import Parser
from lrattn_lightning.model.routing.attnres.backends import AUTO, IMPLS, availability
from lrattn_lightning.tools.bench.steps import OPTIMIZERS

PHASES = ("train", "forward", "generate")
MODES = ("eager", "compile")


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
    p.add_argument("--impl", choices=(AUTO, *IMPLS), default=AUTO,
                   help="AttnRes backend (auto: fast, or compiled for query gated_dynamic; --mode compile runs fast as "
                        "compiled; triton: CUDA or TRITON_INTERPRET=1)")
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
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="train phase: the LightningModule's optimiser (its `optimizer` argument): adamw = AdamW on "
                        "every parameter (the routing with the least else around it), muon_adamw = `lrattn fit`'s "
                        "default (Muon for hidden matrices: Newton-Schulz work that is not routing)")
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


# ---- the benchmark ------------------------------------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def apply_inductor_options(options: list[str]) -> dict[str, Any]:
    """--inductor KEY=VALUE: set torch._inductor.config attributes (dotted keys reach sub-configs)."""
    import torch._inductor.config as config

    applied = {}
    for item in options:
        key, sep, raw = item.partition("=")
        if not sep:
            raise InputError(f"--inductor {item!r}: expected KEY=VALUE")
        value: Any = {"true": True, "false": False}.get(raw.lower(), raw)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(raw) if "." in raw else int(raw)
        *path, leaf = key.split(".")
        target = config
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, leaf):
            raise InputError(f"--inductor {item!r}: torch._inductor.config has no option {key!r}")
        setattr(target, leaf, value)
        applied[key] = value
    return applied


def _clock(args) -> Callable[[], float]:
    return time.process_time if args.clock == "cpu" else time.perf_counter


def _device(args):
    """The torch device of the run (--device, else CUDA when there is one), with --threads applied."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _check_args(args, reg, device) -> set[str]:
    """Fail on a bad name, pair or option before any timing. -> the --memory kinds."""
    from lrattn_lightning.tools.bench.steps import model_config

    for name in [args.baseline, *_ablations(args)]:
        model_config(args, reg, name)
    memory = {m for m in args.memory.split(",") if m and m != "none"}
    if memory - {"alloc", "rss"}:
        raise InputError(f"--memory: unknown {sorted(memory - {'alloc', 'rss'})}; use alloc, rss or none")
    if args.clock == "cpu" and device.type != "cpu":
        raise InputError("--clock cpu measures this process's CPU time: use it with --device cpu")
    if (error := availability(args.impl, device)) is not None:  # (triton: CUDA or the interpreter)
        raise InputError(f"--impl {args.impl}: {error}")
    return memory


def _ablations(args) -> list[str]:
    return [n for n in args.ablations.split(",") if n and n != args.baseline]


def run_bench(args) -> dict[str, Any]:
    import torch

    from lrattn_lightning.model.registry import load_registry
    from lrattn_lightning.tools.bench.roofline import measure_bandwidth, measure_peak_flops
    from lrattn_lightning.tools.bench.runner import run_mode

    device = _device(args)
    dtype = getattr(torch, args.dtype)
    reg = load_registry(args.registry)
    inductor_options = apply_inductor_options(args.inductor)
    memory = _check_args(args, reg, device)
    clock = _clock(args)  # the peak, the bandwidth and the steps are all timed with this one clock
    ceilings = {
        "peak_flops": args.peak_flops or measure_peak_flops(device, dtype, clock),
        "peak_flops_source": "given" if args.peak_flops else f"measured: best {args.dtype} matmul, {args.clock} clock",
        "bandwidth_bytes_per_s": args.bandwidth or measure_bandwidth(device, clock),
        "bandwidth_source": "given" if args.bandwidth else f"measured: best large add (c = a + b), {args.clock} clock",
    }
    rows = []
    for mode in list(MODES) if args.mode == "both" else [args.mode]:
        rows += run_mode(args, reg, mode, _ablations(args), device, dtype, ceilings["peak_flops"],
                         ceilings["bandwidth_bytes_per_s"], memory, clock)
    return {"meta": _meta(args, reg, device, inductor_options, memory, ceilings), "results": rows}


def _meta(args, reg, device, inductor_options: dict, memory: set[str], ceilings: dict) -> dict[str, Any]:
    """What the numbers were measured on and with: the run's settings, machine, versions and commit."""
    import torch

    from lrattn_lightning.train.settings import current_git_commit

    train = args.phase == "train"
    generate = args.phase == "generate"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "lrattn bench " + " ".join(args.argv),
        "size": args.size, "baseline": args.baseline, "phase": args.phase, "impl": args.impl,
        "step": "module" if train else None, "optimizer": args.optimizer if train else None,
        "compile_backend": args.compile_backend if args.mode != "eager" else None,
        "inductor_options": inductor_options,
        "batch_size": args.batch_size, "seq_len": args.seq_len or reg.size(args.size).seq_len,
        "prompt_len": args.prompt_len if generate else None, "new_tokens": args.new_tokens if generate else None,
        "steps": args.steps, "warmup": args.warmup, "clock": args.clock, "dtype": args.dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        **ceilings,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory": "cuda max_memory_allocated" if device.type == "cuda" else "profiler allocation peak" + (
            " + fresh-process peak RSS" if "rss" in memory else ""),
        "git_commit": current_git_commit(), "registry_sha256": reg.sha256,
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

    from lrattn_lightning.train.artifacts import LinkSafeClient

    m = report["meta"]
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri("sqlite:///mlflow.db")
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=f"bench-{m['size']}-{m['phase']}-{m['impl']}") as run:
        mlflow.log_params({k: v for k, v in m.items() if not isinstance(v, list | dict)})
        for r in report["results"]:
            prefix = f"bench/{r['mode']}/{r['ablation']}"
            for key in ("median_step_s", "tokens_per_s", "ratio_to_baseline", "peak_mem_bytes", "mem_ratio",
                        "peak_rss_bytes", "rss_ratio", "achieved_flops", "mfu", "floor_s", "overhead_s",
                        "routing_efficiency"):
                if r[key] is not None:
                    mlflow.log_metric(f"{prefix}/{key}", float(r[key]))
        LinkSafeClient().log_dict(run.info.run_id, report, "bench.json")  # never through a link (train/artifacts.py)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.rss_probe:
        import torch

        from lrattn_lightning.model.registry import load_registry
        from lrattn_lightning.tools.bench.runner import run_rss_probe

        device = _device(args)
        apply_inductor_options(args.inductor)
        return run_rss_probe(args, device, getattr(torch, args.dtype), load_registry(args.registry))
    report = run_bench(args)
    print(format_table(report))
    path = Path(args.json or f"runs/bench/{args.size}-{args.phase}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(report, indent=1), "benchmark report")
    print(f"wrote {path}")
    check_report(report)  # after writing: the numbers stay inspectable
    if args.mlflow:
        log_mlflow(report, args.mlflow_experiment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
