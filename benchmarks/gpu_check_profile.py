"""benchmarks/gpu-check's profile: where one train step's time goes, for the arms named by --profile.

For an arm already set up and warmed up (its step built with a PhaseClock as `mark`):
  phases    one step timed at its phase boundaries, unprofiled: data (a pinned host batch copied into the
            step's device batch, as a loader's transfer), forward (the loss with it where compiled: the
            compiled region holds both), loss (eager: from the decoder's output to the loss), backward,
            optimizer (the module's on_before_optimizer_step, step, zero_grad); host milliseconds
            (perf_counter) and, on CUDA, the stream's milliseconds between events recorded at the same points
  profile   the next step under torch.profiler: the top kernels by device time (on a CPU dry run: the top
            ops by self CPU time), kernels launched, the device's busy time against the step's, and the
            host-device synchronisations: the runtime's synchronise and blocking-copy calls (CUDA), and the ops
            that read a tensor's value on the host (`.item()`, `bool()` of a tensor, `nonzero`:
            aten::_local_scalar_dense, aten::nonzero, aten::is_nonzero), of any tensor: a CPU tensor's read (AdamW's
            step counters, not capturable) costs nothing, a device tensor's stalls the host, and is a sync above.
Imported by the script from its own folder; torch is imported lazily.
"""

from __future__ import annotations

import time

# CUDA runtime and driver calls that launch work, and those that block the host until the device catches up
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaLaunchCooperativeKernel")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cudaStreamWaitEvent")
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::item")
TOP = 15


class PhaseClock:
    """mark(phase): the previous phase ends and `phase` begins ("end" ends the last). Host clock always, CUDA
    events on a CUDA device; `arm()` starts recording, `phases()` returns the recorded phases' milliseconds."""

    def __init__(self, device) -> None:
        self.device, self.marks, self.on = device, [], False

    def arm(self) -> None:
        self.marks, self.on = [], True

    def __call__(self, phase: str) -> None:
        if not self.on:
            return
        import torch

        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, time.perf_counter(), event))

    def phases(self) -> dict[str, dict]:
        import torch

        self.on = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        names = [m[0] for m in self.marks]
        out: dict[str, dict] = {}
        for (name, t0, e0), (_, t1, e1) in zip(self.marks, self.marks[1:], strict=False):
            if name == "end":  # the step's own end, then the caller's
                continue
            if name == "forward" and "loss" not in names:
                name = "forward+loss"  # compiled: one region (or a step without the decoder's hook)
            row = out.setdefault(name, {"host_ms": 0.0, "device_ms": None})
            row["host_ms"] += 1e3 * (t1 - t0)
            if e0 is not None:
                row["device_ms"] = (row["device_ms"] or 0.0) + e0.elapsed_time(e1)
        return out


def loss_mark(model, clock: PhaseClock):
    """A forward hook on the decoder that marks "loss" when its forward returns (eager only: under Dynamo a
    hook that records an event would break the graph). Returns the hook's handle."""
    return model.register_forward_hook(lambda module, inputs, output: clock("loss"))


def _device_time(e) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


def _is_device(e) -> bool:
    return "CUDA" in str(getattr(e, "device_type", "")).upper()


def profile_arm(arm, device, clock: PhaseClock, host_batch) -> dict:
    """One phase-timed step, then one profiled step, of `arm` (see the module's docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        clock("data")
        arm.batch.copy_(host_batch, non_blocking=True)
        arm.step()
        clock("end")

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    clock.arm()
    t0 = time.perf_counter()
    step()
    sync()
    wall = time.perf_counter() - t0
    phases = clock.phases()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        profiled_wall = time.perf_counter() - t0
    return {"arm": arm.name, "mode": arm.mode, "step_ms": 1e3 * wall, "profiled_step_ms": 1e3 * profiled_wall,
            "phases": phases, **summarise(prof.key_averages(), device, profiled_wall)}


def summarise(averages, device, wall_s: float) -> dict:
    """The profile's key averages as the report's numbers: top kernels (CPU: ops), launches, synchronisations."""
    counts = {e.key: int(e.count) for e in averages}
    cuda = device.type == "cuda"
    if cuda:
        kernels = [e for e in averages if _is_device(e) and _device_time(e) > 0]
        timed = sorted(kernels, key=_device_time, reverse=True)
        busy_us = sum(_device_time(e) for e in kernels)
        top = [{"name": e.key[:160], "ms": _device_time(e) / 1e3, "calls": int(e.count),
                "share": _device_time(e) / busy_us if busy_us else 0.0} for e in timed[:TOP]]
        launched = sum(counts.get(k, 0) for k in LAUNCHES)
    else:
        ops = [e for e in averages if e.self_cpu_time_total > 0]
        timed = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)
        busy_us = sum(e.self_cpu_time_total for e in ops)
        top = [{"name": e.key[:160], "ms": e.self_cpu_time_total / 1e3, "calls": int(e.count),
                "share": e.self_cpu_time_total / busy_us if busy_us else 0.0} for e in timed[:TOP]]
        launched = None
    return {
        "top": top, "top_by": "device time" if cuda else "self CPU time (no device)",
        "kernels_launched": launched, "kernel_kinds": len(timed) if cuda else None,
        "device_busy_ms": busy_us / 1e3 if cuda else None,
        "device_busy_share": busy_us / 1e6 / wall_s if cuda and wall_s > 0 else None,
        "syncs": {k: counts[k] for k in SYNCS if counts.get(k)},
        "host_reads": {k: counts[k] for k in HOST_READS if counts.get(k)},
    }


def markdown(profiles: list[dict]) -> list[str]:
    """The report's profile section: one phase table over the arms, then each arm's top kernels."""
    if not profiles:
        return []
    names = ["data", "forward", "loss", "forward+loss", "backward", "optimizer"]
    names = [n for n in names if any(n in p["phases"] for p in profiles)]
    lines = ["", "## Where a step's time goes (torch.profiler, one step each)", "",
             "Phases in ms, host clock / device stream (CUDA events); launches, host-device synchronisations and "
             "host reads of device values (`.item()`, `bool()`, `nonzero`) in the profiled step.", "",
             "| mode | arm | step ms | " + " | ".join(names) + " | kernels launched | device busy | syncs | host reads |",
             "|---|---|---:|" + "---:|" * len(names) + "---:|---:|---|---|"]
    for p in profiles:
        cells = []
        for n in names:
            ph = p["phases"].get(n)
            cells.append("" if ph is None else f"{ph['host_ms']:.1f}" + (
                f" / {ph['device_ms']:.1f}" if ph["device_ms"] is not None else ""))
        busy = f"{100 * p['device_busy_share']:.0f} %" if p["device_busy_share"] is not None else "-"
        syncs = ", ".join(f"{k} {v}" for k, v in p["syncs"].items()) or "none"
        reads = ", ".join(f"{k} {v}" for k, v in p["host_reads"].items()) or "none"
        launched = p["kernels_launched"] if p["kernels_launched"] is not None else "-"
        lines.append(f"| {p['mode']} | {p['arm']} | {p['step_ms']:.1f} | " + " | ".join(cells)
                     + f" | {launched} | {busy} | {syncs} | {reads} |")
    for p in profiles:
        lines += ["", f"Top {len(p['top'])} by {p['top_by']}: {p['mode']} {p['arm']}", "",
                  "| ms | calls | share | kernel |", "|---:|---:|---:|---|"]
        lines += [f"| {t['ms']:.2f} | {t['calls']} | {100 * t['share']:.1f} % | `{t['name'][:110]}` |" for t in p["top"]]
    return lines
