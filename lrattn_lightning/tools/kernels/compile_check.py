"""Compile recorded kernel launches (specs.py) for GPU targets on a machine without a GPU, and read what
each compiled kernel needs: the compile check of the `triton` backend (tests/tools/test_triton_compile.py).

Needs only triton (no torch, nothing of this package: the kernel files are loaded by path, kernels()): run
as a script by any python with triton, e.g. a separate environment holding the GPU machine's triton 3.6
(`./tasks setup` makes .venv/triton-3.6):

    python compile_check.py RECORDS.json OUT.json --archs 80,90,100 --jobs 2

For each record, the installed triton's own specialisation of the arguments (native_specialize_impl, what a
launch computes: types, 16-byte alignment, ints equal to 1; the kernels' do_not_specialize honoured), then
`triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))`: Triton's
passes and ptxas, no GPU. Each distinct specialisation is compiled once per architecture. From the cubin,
`cuobjdump -res-usage` (bundled with triton): registers per thread, stack and local memory (spills), static
shared memory; dynamic shared memory from the kernel's metadata. An architecture the installed triton cannot
target (a probe kernel fails) is reported as unsupported, not failed.

The budget (docs/benchmarks.md): compiles; <= 128 registers per thread; no stack or local memory; shared memory
within the architecture's per-block limit. Programs per SM: the occupancy those resources allow (registers
allocated per warp in units of 256, 1 KiB of shared memory reserved per program, at most 2048 threads and 32
programs per SM): a proxy for speed until a GPU measures time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REG_BUDGET = 128  # (triton/launch.py's REG_BUDGET: every launch passes it as maxnreg, so more would be spilled)
# per SM: 64 Ki registers, 2048 threads, 32 programs on all three; shared memory per SM and per program (opt-in)
ARCHS = {80: {"gpu": "A100", "smem_sm": 164 * 1024, "smem_block": 163 * 1024},
         90: {"gpu": "H100/H200", "smem_sm": 228 * 1024, "smem_block": 227 * 1024},
         100: {"gpu": "B200", "smem_sm": 228 * 1024, "smem_block": 227 * 1024}}
REGS_SM, THREADS_SM, PROGRAMS_SM, RESERVED_SMEM = 65536, 2048, 32, 1024
# the kernels (model/routing/attnres/triton/kernels.py: every kernel, importing only triton)
KERNELS_MODULE = "lrattn_lightning.model.routing.attnres.triton.kernels"
KERNELS_FILE = Path(__file__).resolve().parents[2] / "model" / "routing" / "attnres" / "triton" / "kernels.py"
_kernels = None


def kernels():
    """The kernels module (triton/kernels.py: every kernel by name), loaded by path under its own name in
    sys.modules so that no package __init__ runs (no torch); already imported (the package is in use here), it is
    taken as is."""
    global _kernels
    if _kernels is None:
        if KERNELS_MODULE not in sys.modules:
            spec = importlib.util.spec_from_file_location(KERNELS_MODULE, KERNELS_FILE)
            module = importlib.util.module_from_spec(spec)
            sys.modules[KERNELS_MODULE] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[KERNELS_MODULE]
                raise
        _kernels = sys.modules[KERNELS_MODULE]
    return _kernels


class _Tensor:
    """What specialisation reads of a tensor argument: its dtype and address."""

    def __init__(self, dtype, aligned: bool):
        self.dtype, self._ptr = dtype, 0 if aligned else 8

    def data_ptr(self) -> int:
        return self._ptr


def _dtype(name: str):
    import triton.language as tl

    by_name = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16, "float64": tl.float64,
               "int64": tl.int64, "int32": tl.int32,
               "fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16, "fp64": tl.float64}
    return by_name[name]


def specialise(record: dict, backend) -> tuple:
    """(kernel, signature, constexprs, attrs, options) as the installed triton's launch would build them."""
    from triton.runtime.jit import native_specialize_impl

    fn = getattr(kernels(), record["kernel"])
    args = iter(record["args"])
    signature, constexprs, attrs = {}, {}, {}
    for i, kp in enumerate(fn.params):
        if kp.is_constexpr:
            v = record["constexprs"][kp.name]
            signature[kp.name], constexprs[(i,)] = "constexpr", _dtype(v) if isinstance(v, str) else v
            continue
        kind, *rest = next(args)
        arg = _Tensor(_dtype(rest[0]), rest[1]) if kind == "tensor" else rest[0]
        ty, attr = native_specialize_impl(backend, arg, kp.is_const, not kp.do_not_specialize,
                                          not kp.do_not_specialize_on_alignment)
        signature[kp.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    return fn, signature, constexprs, attrs, dict(record["options"])


def spec_key(record: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    _, sig, cx, attrs, opts = specialise(record, make_backend(GPUTarget("cuda", 90, 32)))
    return json.dumps([record["kernel"], sig, {str(k): str(v) for k, v in cx.items()},
                       {str(k): v for k, v in attrs.items()}, opts], sort_keys=True)


def _cuobjdump() -> str:
    import triton

    with_knobs = getattr(getattr(getattr(triton, "knobs", None), "nvidia", None), "cuobjdump", None)
    if with_knobs is not None and getattr(with_knobs, "path", None):
        return with_knobs.path
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL of the cubin's one kernel, from cuobjdump -res-usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL")}


def programs_per_sm(regs: int, shared: int, num_warps: int, arch: int) -> int:
    """How many programs of this kernel one SM holds at once (module docstring)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (REGS_SM // per_warp) // num_warps if per_warp else PROGRAMS_SM
    by_smem = ARCHS[arch]["smem_sm"] // (shared + RESERVED_SMEM)
    return min(PROGRAMS_SM, THREADS_SM // (32 * num_warps), by_regs, by_smem)


def violations(r: dict, arch: int) -> list[str]:
    """What breaks the budget (module docstring); [] when within it."""
    if r.get("error"):
        return [f"compile error: {r['error']}"]
    out = []
    if r["regs"] > REG_BUDGET:
        out.append(f"{r['regs']} registers per thread > {REG_BUDGET}")
    if r["stack"] or r["local"]:
        out.append(f"spills: {r['stack']} B stack, {r['local']} B local per thread")
    if r["shared"] > ARCHS[arch]["smem_block"]:
        out.append(f"{r['shared']} B shared > {ARCHS[arch]['smem_block']} B per program")
    return out


def compile_one(record: dict, arch: int) -> dict:
    """Compile one record for sm_`arch`; its resources, programs per SM and budget violations."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", arch, 32)
    t0 = time.perf_counter()
    try:
        fn, sig, cx, attrs, opts = specialise(record, make_backend(target))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (triton 3.9's notice about the FP-fusion default)
            compiled = triton.compile(ASTSource(fn, sig, cx, attrs), target=target, options=opts)
        res = resources(compiled.asm["cubin"])
    except Exception as e:  # a compile error is a result: reported, and a failure of the check
        r = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"}
    else:
        shared = res["shared"] + compiled.metadata.shared
        r = {"regs": res["reg"], "stack": res["stack"], "local": res["local"], "shared": shared,
             "programs_per_sm": programs_per_sm(res["reg"], shared, opts["num_warps"], arch)}
    r["seconds"] = round(time.perf_counter() - t0, 3)
    r["violations"] = violations(r, arch)
    return r


def arch_support(arch: int) -> str | None:
    """Why the installed triton cannot target sm_`arch` (None: it can): a two-line kernel compiled for it."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def probe(x):
        tl.store(x, 1.0)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            triton.compile(ASTSource(probe, {"x": "*fp32"}, {}, {}), target=GPUTarget("cuda", arch, 32))
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
    return None


def _job(args: tuple) -> tuple:
    key, record, arch = args
    return key, arch, compile_one(record, arch)


def check(records: list[dict], archs=(80, 90, 100), jobs: int = 1) -> dict:
    """Compile each distinct specialisation of `records` once per supported arch (`jobs` processes)."""
    import triton

    t0 = time.perf_counter()
    support = {arch: arch_support(arch) for arch in archs}
    specs: dict[str, dict] = {}
    for i, record in enumerate(records):
        key = spec_key(record)
        specs.setdefault(key, {"kernel": record["kernel"], "record": i, "records": [], "results": {}})
        specs[key]["records"].append(i)
    work = [(key, records[s["record"]], arch) for key, s in specs.items() for arch in archs if support[arch] is None]
    if jobs > 1:
        import multiprocessing

        # spawn, not fork: the caller may hold CUDA and torch threads (benchmarks/gpu-check)
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_job, work))
    else:
        done = [_job(w) for w in work]
    for key, arch, r in done:
        specs[key]["results"][str(arch)] = r
    return {"triton": triton.__version__, "archs": {str(a): {"unsupported": why, **ARCHS[a]} for a, why in support.items()},
            "specs": list(specs.values()), "seconds": round(time.perf_counter() - t0, 1)}


def failures(report: dict) -> list[str]:
    """Every budget violation of a report (triton version, arch, kernel, record index, what)."""
    return [f"triton {report['triton']} sm_{arch} {s['kernel']} (record {s['record']}): {v}"
            for s in report["specs"] for arch, r in s["results"].items() for v in r["violations"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="triton_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("records", help="JSON list of recorded launches (specs.py)")
    p.add_argument("out", help="JSON report to write")
    p.add_argument("--archs", default="80,90,100")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--cache", default=None, help="Triton's cache folder (default: Triton's own, ~/.triton/cache)")
    args = p.parse_args(argv)
    if args.cache:
        os.environ["TRITON_CACHE_DIR"] = args.cache  # (read when a kernel compiles)
    report = check(json.loads(Path(args.records).read_text()), [int(a) for a in args.archs.split(",")], args.jobs)
    # a new file renamed into place, never opened through a link (core/files.py's rule; this script imports none of it)
    tmp = f"{args.out}.{os.getpid()}.tmp"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), "w") as file:
        file.write(json.dumps(report))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
