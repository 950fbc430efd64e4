"""torch.profiler for the bench: a quiet profiler context and per-op tables (ablation minus baseline).

Kineto writes `USDT: ... profiler_start` / `profiler_stop` (and `STAGE:` lines) to the process's
stderr from C++, whatever KINETO_LOG_LEVEL says; `quiet_profile` catches file descriptor 2 while the
profiler starts and stops and passes every other line through.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator

_NOISE = re.compile(r"^(USDT|STAGE):\S* .*(profiler_(start|stop)|Completed Stage)")


@contextlib.contextmanager
def _stderr_filtered() -> Iterator[None]:
    """Catch fd 2 (C++ writers included) in a temporary file; on exit, re-emit what is not profiler noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not _NOISE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def quiet_profile(**kwargs):
    """torch.profiler.profile(**kwargs) without Kineto's start/stop lines on stderr."""
    from torch.profiler import profile

    prof = profile(**kwargs)
    with _stderr_filtered():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _stderr_filtered():
            prof.__exit__(None, None, None)


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """The highest running total of CPU tensor bytes allocated minus freed while `fn` runs (the profiler's
    allocation events in time order): the CPU analogue of torch.cuda.max_memory_allocated above what was
    live before `fn`."""
    from torch.profiler import ProfilerActivity

    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


_KERNEL_INDEX = re.compile(r"^graph_\d+_|_\d+$")
_GRAPH_CALL = re.compile(r"^## Call CompiledFxGraph \w+ ##$")


def op_key(name: str) -> str:
    """An op's name, with Inductor kernels' graph and index numbers and compiled graphs' hashes stripped
    (so two models' compiled graphs compare; a graph call's self time is its Python wrapper's)."""
    if name.startswith("graph_"):
        return _KERNEL_INDEX.sub("", name)
    return "## Call CompiledFxGraph (wrapper) ##" if _GRAPH_CALL.match(name) else name


def op_times(step: Callable[[], None], steps: int = 3) -> dict[str, tuple[float, float]]:
    """Per-op self CPU time (seconds per step) and calls per step over `steps` profiled steps.

    Compiled CPU kernels appear under their Inductor names when the model was compiled with
    torch._inductor.config.cpp.enable_kernel_profile set (the bench sets it with --profile)."""
    from torch.profiler import ProfilerActivity

    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    table: dict[str, tuple[float, float]] = {}
    for e in prof.key_averages():
        t, c = table.get(op_key(e.key), (0.0, 0.0))
        table[op_key(e.key)] = (t + e.self_cpu_time_total / 1e6 / steps, c + e.count / steps)
    return table


def op_diff(ablation: dict[str, tuple[float, float]], baseline: dict[str, tuple[float, float]],
            top: int = 15) -> list[dict]:
    """The ops whose self time grew most from the baseline to the ablation (per step)."""
    rows = []
    for key in set(ablation) | set(baseline):
        (t, c), (tb, cb) = ablation.get(key, (0.0, 0.0)), baseline.get(key, (0.0, 0.0))
        rows.append({"op": key, "delta_ms": 1e3 * (t - tb), "ms": 1e3 * t, "base_ms": 1e3 * tb,
                     "calls": c, "base_calls": cb})
    rows.sort(key=lambda r: -r["delta_ms"])
    return rows[:top]
