"""How AttnRes is computed: the one table of its backends (a runtime choice, never part of the architecture).

Every backend computes the same routing with the same parameters (tests compare forward, backward and KV-cache
decoding with `reference` for every entry):

    name       router class                  under torch.compile   needs
    fast       fast.FastAttnRes              compiled               any machine (auto's choice): buffered autograd
                                                                    Functions, logits at write time
    reference  reference.ReferenceAttnRes    reference              any machine: readable, stacks the sources
    compiled   compiled.CompiledAttnRes      compiled               any machine: plain tensor ops Dynamo traces
    triton     triton.router.TritonAttnRes   triton                 CUDA, or Triton's CPU interpreter
                                                                    (TRITON_INTERPRET=1): fused kernels as torch
                                                                    custom ops, kept whole by torch.compile

Every backend serves every option, block_summary rms and MHAR's depth_head_norm full / key_gain included
(the triton kernels normalise keys per depth head: a whole-key norm is applied before them, its keys handed
over as carried keys with the kernels' norm off; triton/router.py).

Callers ask the table, never a backend's name: `availability(impl, device)` (None: it runs there; else the
one-line reason, from the backend's own check), `resolve_impl(impl, compiled, per_token_queries)` (the backend
that runs, under torch.compile its substitute; an unknown name is one line naming the closest; the kind calls it
once, KIND.resolve_impl), `needs_parity_check(impl)` (its own kernels: a benchmark checks them against `reference`
before it times them).

`auto` (the default) is `fast`, or `compiled` for `query: gated_dynamic`: `fast` is not traceable by torch.compile
(its compiled substitute is `compiled`) and does not fold per-token queries into write-time logits, so asking for
`fast` there by name is one line naming `compiled` (the backend that runs is the one asked for). KV-cache
decoding runs the named backend too (on CPU `reference` / `compiled` decode faster than `fast`: ~0.10 s against
~0.13 s for 64 tokens at `small`, s-lr-block-n8-r64). A router class is imported when first asked for (the
triton module registers torch custom ops on import).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.names import with_closest

PACKAGE = "lrattn_lightning.model.routing.attnres"


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # below PACKAGE
    router: str  # its router class
    under_compile: str  # the backend a torch.compile'd decoder takes for this one
    needs: str = "any machine"
    # what says whether it runs on a device ("module:function" below PACKAGE, called with a device type or
    # None for this machine -> None, or why not); None: it runs anywhere
    check: str | None = None
    # it launches kernels of its own (Triton), not PyTorch's: a benchmark checks their forward and backward
    # against `reference` before it times them (benchmarks/gpu-check; the tests check every backend)
    own_kernels: bool = False
    # it serves per-token queries (`query: gated_dynamic`); `fast` folds the queries into write-time logits
    per_token_queries: bool = True

    @property
    def portable(self) -> bool:
        return self.check is None


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("fast", "fast", "FastAttnRes", under_compile="compiled", per_token_queries=False),
    Backend("reference", "reference", "ReferenceAttnRes", under_compile="reference"),
    Backend("compiled", "compiled", "CompiledAttnRes", under_compile="compiled"),
    Backend("triton", "triton.router", "TritonAttnRes", under_compile="triton",
            needs="a CUDA GPU, or TRITON_INTERPRET=1 for Triton's CPU interpreter",
            check="triton.launch:availability_error", own_kernels=True),
)}
AUTO = "auto"  # the kind's choice: `fast`, or `compiled` where the queries are per token (resolve_impl)
DEFAULT_IMPL = AUTO
IMPLS = tuple(BACKENDS)  # every backend
PORTABLE_IMPLS = tuple(name for name, b in BACKENDS.items() if b.portable)  # those that run anywhere


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise InputError(f"impl: unknown AttnRes backend {with_closest(repr(name), list(BACKENDS))}; use one of "
                         f"{', '.join((AUTO, *BACKENDS))}")
    return BACKENDS[name]


def check_impl(impl: str) -> str:
    """`impl` when it names a backend or `auto`; else one line (InputError) naming the closest."""
    if impl != AUTO:
        backend(impl)
    return impl


def router_class(name: str) -> type:
    b = backend(name)
    return getattr(importlib.import_module(f"{PACKAGE}.{b.module}"), b.router)


def availability(impl: str, device=None) -> str | None:
    """None when backend `impl` can run on `device` (a torch.device or its type: "cuda", "cpu"; None: on this
    machine, whichever device), else the one-line reason naming the fix. Its check module is imported only
    here (the triton one needs no triton to answer). `auto` chooses among backends that run anywhere."""
    if impl == AUTO:
        return None
    b = backend(impl)
    if b.check is None:
        return None
    module, function = b.check.split(":")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), function)(getattr(device, "type", device))


def needs_parity_check(impl: str) -> bool:
    """Whether backend `impl` is a hand-written kernel path (its own kernels, not PyTorch's ops), whose forward
    and backward a benchmark checks against `reference` before it times them."""
    return impl != AUTO and backend(impl).own_kernels


def resolve_impl(impl: str, compiled: bool = False, per_token_queries: bool = False) -> str:
    """The backend that runs for `impl`: `auto` is `fast`, or `compiled` for per-token queries; a named one is
    itself, or under torch.compile its substitute (`fast` -> `compiled`: same parameters and results). An unknown
    name, or `fast` named for per-token queries, is one line (InputError) naming the fix."""
    if impl == AUTO:
        impl = "compiled" if per_token_queries else "fast"
    b = backend(impl)
    if per_token_queries and not b.per_token_queries:
        raise InputError(f"impl {b.name!r} does not serve query 'gated_dynamic' (per-token queries); use --model.impl "
                         f"'compiled' (or auto, which takes it), 'reference' or 'triton'")
    return b.under_compile if compiled else b.name


def compile_impl(name: str) -> str:
    """The backend a torch.compile'd decoder takes for `name` (resolve_impl(name, compiled=True))."""
    return resolve_impl(name, compiled=True)
