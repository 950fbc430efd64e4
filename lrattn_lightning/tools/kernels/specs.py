"""Which Triton kernel specialisations the `triton` backend launches, and the check that each compiles for
the GPUs researchers use within the register budget (compile_check.py compiles; this module records).

`recorded_launches()` sends every kernel launch (model/routing/attnres/triton/ops.py, through launch.py) to a recorder that
keeps what Triton specialises a kernel on and runs nothing: kernel, argument types (a tensor's dtype and
whether its address is 16-byte aligned; an int as a representative of its class: 1, a multiple of 16, other,
and the same past 2^31), constexprs and compile options (num_warps, maxnreg). The outputs stay
uninitialised: the router's control flow, shapes, dtypes and strides do not depend on values, so the
launches are those of a real run.

`launches(sizes)` drives every AttnRes registry entry's router at a size's widths (the vocabulary, the MLP
and the token attention are not needed: no kernel sees them; a stand-in sublayer writes each output in the
dtype and layout the decoder's output projection gives: [B, T, D + extra], new and contiguous, from one column
of the read scaled by a vector): training (forward and backward), validation with the routing weights
recorded (forward), and decoding one token (forward), each in float32 and under bfloat16 autocast. The sequence is cut to `tokens` (16: a multiple of 16 like
B * T in training, and at least every BLOCK_N at these widths, so the launch geometry is the real one).

Autocast on CPU casts what CUDA autocast casts for these ops with torch <= 2.11 (the GPU machine's; rms_norm
runs in the input dtype); torch >= 2.12 runs rms_norm in float32 under CUDA autocast, so there P-LR's emitted
keys reach the kernels in float32. benchmarks/gpu-check records on the GPU under CUDA autocast.

    python -m lrattn_lightning.tools.kernels.specs --out docs/benchmarks/triton-compile \\
        --python 3.9=.venv/bin/python --python 3.6=.venv/triton-3.6/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lrattn_lightning.core.files import write_file
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.decoder import build_router
from lrattn_lightning.model.registry import Registry, load_registry
from lrattn_lightning.model.routing.attnres.triton import launch as triton_launch
from lrattn_lightning.model.routing.kinds import kind_of

COMPILER = Path(__file__).with_name("compile_check.py")
SIZES = ("paper-0.5b", "d4096-7b")
PASSES = ("train", "validate", "decode")  # forward + backward, forward recording alpha, forward of one token
DTYPES = ("float32", "bf16-autocast")
OPTIONS = ("num_warps", "num_stages", "maxnreg")  # launch keywords that are compile options, not constexprs


def _int_class(x: int) -> int:
    """A representative of what Triton specialises an int on: == 1, divisible by 16, 64-bit."""
    big = 1 << 32 if abs(x) >= 1 << 31 else 0
    return 1 if x == 1 else big + (16 if x % 16 == 0 else 17)


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ["tensor", str(x.dtype).removeprefix("torch."), x.data_ptr() % 16 == 0]
    if isinstance(x, bool):
        return ["bool", x]
    if isinstance(x, int):
        return ["int", _int_class(x)]
    if isinstance(x, float):
        return ["float", 0.5]
    raise TypeError(f"unrecorded kernel argument of type {type(x).__name__}")


def _constexpr(x):
    """A constexpr as JSON: a triton dtype by name (fp32, bf16, ...), else its value."""
    return x if isinstance(x, bool | int | float) else str(x)


class _Recorder:
    """Stands for the kernels module: `kernel[grid](*args, **constexprs)` appends a record, runs nothing."""

    def __init__(self, records: list[dict]):
        from lrattn_lightning.model.routing.attnres.triton import kernels as triton_kernels  # (needs triton)

        self.kernels, self.records = triton_kernels, records

    def __getattr__(self, name):
        kernel = getattr(self.kernels, name)
        if not hasattr(kernel, "fn"):
            return kernel  # (DTYPES)
        records = self.records

        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
                    records.append({"kernel": name, "args": [_describe(a) for a in args], "options": options,
                                    "constexprs": {k: _constexpr(v) for k, v in kwargs.items()}})
                return launch

        return Launch()


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[dict]]:
    """Inside the block the triton backend builds on any device and its launches are recorded (module
    docstring); yields the list they are appended to."""
    records: list[dict] = []
    recorder = _Recorder(records)
    triton_launch.set_launch_target(recorder)
    try:
        yield records
    finally:
        triton_launch.set_launch_target(None)


def _drive(cfg: ModelConfig, tokens: int, autocast: bool, backward: bool, record: bool, device) -> None:
    """The decoder's calls to its router (decoder.py), with a stand-in sublayer: one forward (+ backward)."""
    D = cfg.size.d_model
    router = build_router(cfg, "triton").to(device)
    scale = torch.ones(D + cfg.extra_out, device=device, requires_grad=backward)
    emb = torch.zeros(1, tokens, D, device=device, requires_grad=backward)

    def stand_in(x: torch.Tensor) -> torch.Tensor:
        # the cheapest sublayer that gives the router what a real one does (a new contiguous output, in the
        # dtype autocast's linear gives, that depends on the read and carries a gradient back to it): the
        # launches depend on nothing else, and the kernels run nothing whose values matter
        with torch.autocast(device.type, enabled=False):
            y = x[..., :1].float() * scale
        return y.to(torch.bfloat16) if autocast else y

    with torch.set_grad_enabled(backward), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        state = router.start(emb, record=record)
        for j in range(cfg.size.n_sublayers):
            router.write(state, j + 1, stand_in(router.read(state, j)))
        h = router.read(state, cfg.size.n_sublayers)
    if backward:
        h.float().sum().backward()


def distinct_entries(reg: Registry) -> dict[str, list[str]]:
    """Entry with a `triton` backend (a kind that takes an impl: AttnRes) -> the entries with the same
    architecture (name, doc, control and tags aside)."""
    groups: dict[str, list[str]] = {}
    for name, a in reg.ablations.items():
        if kind_of(a.routing).takes_impl:
            key = repr(dataclasses.replace(a, name="", doc="", control=None, tags=()))
            groups.setdefault(key, []).append(name)
    return {names[0]: names for names in groups.values()}


def launches(sizes=SIZES, entries: list[str] | None = None, tokens: int = 16, device="cpu",
             reg: Registry | None = None) -> list[dict]:
    """The distinct launches of every AttnRes entry (or `entries`) at each size, all passes and dtypes: each
    record's `uses` lists (d_model, dtype, pass) and `entries` the entries that launched it."""
    reg = reg or load_registry()
    device = torch.device(device)
    groups = distinct_entries(reg)
    names = list(groups) if entries is None else entries
    seen: dict[str, dict] = {}
    # one intra-op thread: the tensors are 16 tokens wide, and on a busy machine torch's worker threads
    # spin-wait (measured: 240 s to record on two shared cores, 39 s with one thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for size in sizes:
            _record_size(reg, size, names, tokens, device, seen)
    finally:
        torch.set_num_threads(threads)
    return list(seen.values())


def _record_size(reg: Registry, size: str, names: list[str], tokens: int, device, seen: dict[str, dict]) -> None:
    """Every AttnRes entry of `names` at `size`, each dtype and pass: its distinct launches into `seen`."""
    for entry in names:
        cfg = reg.model(size, entry)
        for dtype in DTYPES:
            for what in PASSES:
                use = {"d_model": cfg.size.d_model, "dtype": dtype, "pass": what}
                with recorded_launches() as recs:
                    torch.manual_seed(0)
                    _drive(cfg, 1 if what == "decode" else tokens, dtype != "float32", what == "train",
                           what == "validate", device)
                for r in recs:
                    key = json.dumps(r, sort_keys=True)
                    rec = seen.setdefault(key, {**r, "uses": [], "entries": []})
                    if [*use.values()] not in rec["uses"]:
                        rec["uses"].append([*use.values()])
                    if entry not in rec["entries"]:
                        rec["entries"].append(entry)


def compile_check(records: list[dict], pythons: dict[str, str], archs=(80, 90, 100), jobs: int = 1,
                  cache: str | None = None) -> dict[str, dict]:
    """Compile every record for `archs` under each interpreter of `pythons` (label -> path; each needs only
    triton), all at once, `jobs` processes each: label -> compile_check.py's report. Compiled kernels go to
    Triton's cache (`cache`, default Triton's own ~/.triton/cache: keyed on source, version and options)."""
    return compile_runs({label: (python, records, archs) for label, python in pythons.items()}, jobs, cache)


def compile_runs(runs: dict[str, tuple[str, list[dict], tuple[int, ...]]], jobs: int = 1,
                 cache: str | None = None) -> dict[str, dict]:
    """compile_check.py once per run, all at once (label -> (python, records, archs)): label -> its report."""
    with tempfile.TemporaryDirectory(prefix="triton-compile-") as tmp:
        procs = {}
        for i, (label, (python, records, archs)) in enumerate(runs.items()):
            src, out = Path(tmp) / f"records-{i}.json", Path(tmp) / f"report-{i}.json"
            src.write_text(json.dumps(records))
            cmd = [python, str(COMPILER), str(src), str(out), "--archs", ",".join(map(str, archs)),
                   "--jobs", str(jobs), *(["--cache", cache] if cache else [])]
            procs[label] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out)
        reports = {}
        for label, (proc, out) in procs.items():
            _, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"compile_check.py under {runs[label][0]} failed: {stderr[-3000:]}")
            reports[label] = json.loads(out.read_text())
    return reports


def summary(records: list[dict], report: dict) -> list[dict]:
    """One row per (kernel, d_model, dtype) and architecture of a compile_check.py report: how many
    specialisations, the most registers and shared memory, spilled bytes, the fewest programs per SM."""
    rows: dict[tuple, dict] = {}
    for spec in report["specs"]:
        uses = {(u[0], u[1]) for i in spec["records"] for u in records[i]["uses"]}
        for (d, dtype) in uses:
            for arch, r in spec["results"].items():
                row = rows.setdefault((spec["kernel"], d, dtype, int(arch)), {
                    "kernel": spec["kernel"], "d_model": d, "dtype": dtype, "arch": int(arch), "specs": 0, "regs": 0,
                    "shared": 0, "spills": 0, "programs_per_sm": 99, "errors": 0, "warps": set()})
                row["specs"] += 1
                if r.get("error"):
                    row["errors"] += 1
                    continue
                row["regs"] = max(row["regs"], r["regs"])
                row["shared"] = max(row["shared"], r["shared"])
                row["spills"] += r["stack"] + r["local"]
                row["programs_per_sm"] = min(row["programs_per_sm"], r["programs_per_sm"])
                row["warps"].add(records[spec["record"]]["options"]["num_warps"])
    order = {k: i for i, k in enumerate(("read_fwd", "read_bwd", "group_fwd", "group_bwd", "merge_fwd", "merge_bwd"))}
    out = sorted(rows.values(), key=lambda r: (r["d_model"], r["dtype"], order.get(r["kernel"], 9), r["arch"]))
    return [{**r, "warps": sorted(r["warps"])} for r in out]


def markdown(records: list[dict], reports: dict[str, dict], meta: dict | None = None) -> str:
    """The compile table: per triton version, kernel, width and dtype, each architecture's worst case."""
    lines = []
    for report in reports.values():
        archs = [a for a, v in report["archs"].items() if v["unsupported"] is None]
        lines += [f"### triton {report['triton']}: {len(report['specs'])} specialisations, "
                  f"{report['seconds']:.0f} s to compile", "",
                  "Per cell: most registers per thread / most shared memory (KiB) / spilled bytes / fewest programs "
                  "per SM.", "",
                  "| kernel | d | dtype | specs | warps | " + " | ".join(
                      f"sm_{a} ({report['archs'][a]['gpu']})" for a in archs) + " |",
                  "|---|---:|---|---:|---|" + "---|" * len(archs)]
        rows = summary(records, report)
        keyed = {(r["kernel"], r["d_model"], r["dtype"], r["arch"]): r for r in rows}
        for r in rows:
            if r["arch"] != int(archs[0]):
                continue
            cells = []
            for a in archs:
                x = keyed[(r["kernel"], r["d_model"], r["dtype"], int(a))]
                cells.append(f"{x['errors']} errors" if x["errors"] else
                             f"{x['regs']} / {x['shared'] / 1024:.1f} / {x['spills']} / {x['programs_per_sm']}")
            lines.append(f"| {r['kernel']} | {r['d_model']} | {r['dtype']} | {r['specs']} | "
                         f"{','.join(map(str, r['warps']))} | " + " | ".join(cells) + " |")
        lines.append("")
    if meta:
        lines.append(f"Recorded {meta['records']} launches in {meta['record_s']:.0f} s; compiled in "
                     f"{meta['compile_s']:.0f} s ({meta.get('machine', '')}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="triton_specs", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--python", action="append", default=[], help="LABEL=PATH of a python with triton (repeatable; "
                   "default: this one)")
    p.add_argument("--archs", default="80,90,100")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", required=True, help="output stem: writes STEM.json and STEM.md")
    args = p.parse_args(argv)
    import triton

    pythons = dict(x.split("=", 1) for x in args.python) or {triton.__version__: sys.executable}
    t0 = time.perf_counter()
    records = launches(args.sizes.split(","))
    t1 = time.perf_counter()
    reports = compile_check(records, pythons, tuple(int(a) for a in args.archs.split(",")), args.jobs)
    t2 = time.perf_counter()
    import os

    meta = {"sizes": args.sizes, "record_s": t1 - t0, "compile_s": t2 - t1, "records": len(records),
            "machine": f"{os.cpu_count()} CPUs, {args.jobs} processes per triton version"}
    write_file(Path(args.out).with_suffix(".json"), json.dumps({"meta": meta, "records": records, "reports": reports},
                                                               indent=1), "report file")
    write_file(Path(args.out).with_suffix(".md"), markdown(records, reports, meta), "report file")
    print(f"{len(records)} launches recorded in {t1 - t0:.0f} s, compiled in {t2 - t1:.0f} s; wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
