"""The `triton` backend's kernels compile for the GPUs researchers use, within the register budget, checked
without a GPU (docs/benchmarks.md, "The triton kernels compiled").

tools/kernels/specs.py records every kernel launch of every AttnRes registry entry (entries with the same
architecture once) at paper-0.5b and d4096-7b widths: float32 and bf16 autocast; training (forward and
backward), validation recording the routing weights, decoding one token. tools/kernels/compile_check.py
compiles each distinct specialisation with Triton's compiler and ptxas for sm_80, sm_90 and sm_100, under this
environment's triton and under triton 3.6 (the GPU machine's; `./tasks setup` makes .venv/triton-3.6, a venv
holding only triton), pairwise (PLAN: each specialisation for every architecture and under both versions, three
compiles), all at once, and reads registers, spills and shared memory from each cubin. Compiled kernels go to
Triton's own cache (~/.triton/cache, keyed on source, triton version and options).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from helpers.paths import REPO_ROOT  # noqa: E402

from lrattn_lightning.model.registry import load_registry  # noqa: E402
from lrattn_lightning.model.routing.attnres.triton import launch as triton_launch  # noqa: E402
from lrattn_lightning.tools.kernels import compile_check as triton_compile
from lrattn_lightning.tools.kernels import specs as triton_specs

ROOT = REPO_ROOT
TRITON36 = ROOT / ".venv" / "triton-3.6" / "bin" / "python"
ARCHS = (80, 90, 100)
KERNELS = {"read_fwd", "read_bwd", "group_fwd", "group_bwd", "merge_fwd", "merge_bwd"}
REGISTRY = load_registry()


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return triton_specs.launches(triton_specs.SIZES)


# Pairwise over (specialisation, architecture, version): the specialisations go in turn to two halves; the first
# half compiles under 3.6 for sm_80 and sm_100 and under dev for sm_90, the second the other way round. So every
# specialisation compiles for every architecture and under both versions, and every (version, architecture) pair
# sees half of them: 3 compiles a specialisation instead of 6 (`python -m lrattn_lightning.tools.kernels.specs`
# compiles the full product for docs/benchmarks.md).
PLAN = ({"3.6": (80, 100), "dev": (90,)}, {"3.6": (90,), "dev": (80, 100)})


@pytest.fixture(scope="module")
def keys(records) -> list[str]:
    """Each record's specialisation (compile_check.spec_key, under this environment's triton)."""
    return [triton_compile.spec_key(r) for r in records]


@pytest.fixture(scope="module")
def halves(keys) -> list[list[int]]:
    """The record indices of each half, whole specialisations in turn."""
    half_of = {key: i % 2 for i, key in enumerate(dict.fromkeys(keys))}
    return [[i for i, key in enumerate(keys) if half_of[key] == h] for h in (0, 1)]


@pytest.fixture(scope="module")
def reports(records, halves) -> dict[tuple[str, int], dict]:
    """(version label, half) -> compile_check.py's report of that half's records."""
    assert TRITON36.exists(), f"{TRITON36} is missing: run ./tasks setup (it makes the triton 3.6 environment)"
    only_triton = subprocess.run([str(TRITON36), "-c", "import torch"], capture_output=True)
    assert only_triton.returncode != 0, "the triton 3.6 environment should hold only triton"
    pythons = {"dev": sys.executable, "3.6": str(TRITON36)}
    # all four at once, one process each (two cores): 3.9 compiles ~2x slower than 3.6 (~0.6 against ~0.35 CPU
    # seconds a specialisation), so 3.6's processes finish first and 3.9's keep the cores
    runs = {(label, h): (pythons[label], [records[i] for i in halves[h]], archs)
            for h, plan in enumerate(PLAN) for label, archs in plan.items()}
    return triton_specs.compile_runs(runs, jobs=1)


def test_every_entry_launches_every_kernel_at_both_widths(records):
    entries = {e for r in records for e in r["entries"]}
    assert entries == set(triton_specs.distinct_entries(REGISTRY))
    uses = {tuple(u) for r in records for u in r["uses"]}
    assert uses == {(d, dtype, what) for d in (1024, 4096) for dtype in triton_specs.DTYPES
                    for what in triton_specs.PASSES}
    assert {r["kernel"] for r in records if any(u[0] == 1024 for u in r["uses"])} == KERNELS
    # at d = 4096 with one depth head no group of two sites fits a tile; with four heads it does
    assert {r["kernel"] for r in records if any(u[0] == 4096 for u in r["uses"])} == KERNELS


@pytest.mark.parametrize("which", ["dev", "3.6"])
def test_every_specialisation_compiles_within_the_budget(records, halves, reports, which):
    """No compile error, <= 128 registers per thread, no spills, shared memory within each architecture's limit,
    every kernel at both widths, under each version at the architectures PLAN gives each half (all three
    supported by both versions)."""
    for h, plan in enumerate(PLAN):
        report = reports[(which, h)]
        assert report["triton"].startswith("3.6.") if which == "3.6" else not report["triton"].startswith("3.6.")
        assert all(a["unsupported"] is None for a in report["archs"].values()), report["archs"]
        assert sorted(i for s in report["specs"] for i in s["records"]) == list(range(len(halves[h])))
        assert all(set(s["results"]) == {str(a) for a in plan[which]} for s in report["specs"])
        assert triton_compile.failures(report) == []
        worst = max(r["regs"] for s in report["specs"] for r in s["results"].values())
        assert 32 < worst <= triton_compile.REG_BUDGET
    assert {s["kernel"] for h in (0, 1) for s in reports[(which, h)]["specs"]} == KERNELS


def test_the_plan_is_pairwise(records, keys, halves, reports):
    """Every specialisation compiled for every architecture and under both versions, three compiles each."""
    assert sorted(halves[0] + halves[1]) == list(range(len(records))) and halves[0] and halves[1]
    done: dict[str, set] = {}
    for (label, h), report in reports.items():
        for s in report["specs"]:
            done.setdefault(keys[halves[h][s["record"]]], set()).update((label, arch) for arch in s["results"])
    assert len(done) == len(set(keys))
    for pairs in done.values():
        assert {arch for _, arch in pairs} == {str(a) for a in ARCHS} and {label for label, _ in pairs} == {"dev", "3.6"}
        assert len(pairs) == len(ARCHS)


def test_the_check_flags_what_breaks_the_budget(records):
    """The forward read at D = 4096 with 4 warps instead of 16 (32 elements per thread), compiled for sm_90: ~200
    registers per thread without maxnreg, spills with it; the budget's other limits, on results as read."""
    fwd = next(r for r in records if r["kernel"] == "read_fwd" and r["constexprs"]["BLOCK_E"] == 4096
               and r["constexprs"]["KEY_MODE"] == 0 and r["constexprs"]["VDT"] == "bf16")
    assert fwd["options"] == {"num_warps": 16, "num_stages": 1, "maxnreg": 128}
    narrow = {**fwd, "options": {"num_warps": 4, "num_stages": 1}}
    assert any("registers per thread > 128" in v for v in triton_compile.compile_one(narrow, 90)["violations"])
    capped = {**fwd, "options": {"num_warps": 4, "num_stages": 1, "maxnreg": 128}}
    assert any(v.startswith("spills") for v in triton_compile.compile_one(capped, 90)["violations"])
    ok = {"regs": 128, "stack": 0, "local": 0, "shared": 227 * 1024}
    assert triton_compile.violations(ok, 90) == []
    assert triton_compile.violations({**ok, "shared": 164 * 1024}, 80) == [
        f"{164 * 1024} B shared > {163 * 1024} B per program"]
    assert triton_compile.violations({"error": "CompilationError: x"}, 90) == ["compile error: CompilationError: x"]
    assert triton_compile.REG_BUDGET == triton_launch.REG_BUDGET


def test_programs_per_sm():
    # 64 registers x 256 threads = 16 Ki registers a program: 4 by registers (8 by threads)
    assert triton_compile.programs_per_sm(64, 0, 8, 90) == 4
    assert triton_compile.programs_per_sm(32, 0, 8, 90) == 8  # threads bound it: 2048 / 256
    assert triton_compile.programs_per_sm(72, 0, 8, 90) == 3  # 72 x 32 = 2304 a warp: 28 warps, 3 programs
    assert triton_compile.programs_per_sm(64, 0, 32, 90) == 1  # 1024 threads: the register file holds one
    assert triton_compile.programs_per_sm(32, 100 * 1024, 4, 80) == 1  # shared memory bounds it


def test_two_phase_groups_are_split_to_fit_the_tile():
    """paper-0.5b, 8 blocks: the 5 and 6 read sites between block ends as sub-groups of at most 4 (2 + 3, 3 + 3);
    at d = 4096 with one depth head no two sites fit: no groups."""
    with triton_specs.recorded_launches():  # (builds the backend on CPU; nothing launched)
        from lrattn_lightning.model.decoder import build_router

        small = build_router(REGISTRY.model("paper-0.5b", "s-lr-block-n8-r64"), "triton")
        big = build_router(REGISTRY.model("d4096-7b", "s-lr-block-n8-r64"), "triton")
    sizes = [len(s) for s in small.group_sites.values()]
    assert triton_launch.group_limit(1024, 1, 64) == 4 and max(sizes) <= 4
    assert sizes[:2] == [2, 3] and sizes[2:4] == [3, 3]
    assert sorted(j for s in small.group_sites.values() for j in s) == sorted(small.site_group)
    assert triton_launch.group_limit(4096, 1, 64) == 1 and big.group_sites == {}


def test_recorded_int_classes():
    """Ints are kept as what Triton specialises on: 1, a multiple of 16, other; 64-bit past 2^31."""
    assert [triton_specs._int_class(x) for x in (1, 0, 32, 17, 3 << 31)] == [1, 16, 16, 17, (1 << 32) + 16]
    assert json.loads(json.dumps(triton_specs._describe(2.5))) == ["float", 0.5]
