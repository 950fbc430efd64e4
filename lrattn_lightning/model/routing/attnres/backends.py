"""How AttnRes is computed: the one table of its backends (a runtime choice, never part of the architecture).

Every backend computes the same routing with the same parameters (tests compare forward, backward and KV-cache
decoding with `reference` for every entry):

    name       router class                  under torch.compile   needs
    fast       fast.FastAttnRes              compiled               any machine (the default): buffered autograd
                                                                    Functions, logits at write time
    reference  reference.ReferenceAttnRes    reference              any machine: readable, stacks the sources
    compiled   compiled.CompiledAttnRes      compiled               any machine: plain tensor ops Dynamo traces
    triton     triton.router.TritonAttnRes   triton                 CUDA, or Triton's CPU interpreter
                                                                    (TRITON_INTERPRET=1): fused kernels as torch
                                                                    custom ops, kept whole by torch.compile

Every backend serves every option, block_summary rms and MHAR's depth_head_norm full / key_gain included
(the triton kernels normalise keys per depth head: a whole-key norm is applied before them, its keys handed
over as carried keys with the kernels' norm off; triton/router.py).

`fast` is not traceable by torch.compile (its compiled substitute is `compiled`) and does not fold per-token
queries into write-time logits: for `query: gated_dynamic` the kind takes `compiled`, run eagerly. KV-cache
decoding runs the named backend too (on CPU `reference` / `compiled` decode faster than `fast`: ~0.10 s against
~0.13 s for 64 tokens at `small`, s-lr-block-n8-r64). A router class is imported when first asked for (the
triton module registers torch custom ops on import).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.names import with_closest


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # below lrattn_lightning.model.routing.attnres
    router: str  # its router class
    under_compile: str  # the backend a torch.compile'd decoder takes for this one
    portable: bool  # runs on any machine (else: what `needs` says)
    needs: str = "any machine"


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("fast", "fast", "FastAttnRes", under_compile="compiled", portable=True),
    Backend("reference", "reference", "ReferenceAttnRes", under_compile="reference", portable=True),
    Backend("compiled", "compiled", "CompiledAttnRes", under_compile="compiled", portable=True),
    Backend("triton", "triton.router", "TritonAttnRes", under_compile="triton", portable=False,
            needs="a CUDA GPU, or TRITON_INTERPRET=1 for Triton's CPU interpreter"),
)}
DEFAULT_IMPL = "fast"
IMPLS = tuple(BACKENDS)  # every backend
PORTABLE_IMPLS = tuple(name for name, b in BACKENDS.items() if b.portable)  # those that run anywhere


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise InputError(f"impl: unknown AttnRes backend {with_closest(repr(name), list(BACKENDS))}; use one of "
                         f"{', '.join(BACKENDS)}")
    return BACKENDS[name]


def router_class(name: str) -> type:
    b = backend(name)
    return getattr(importlib.import_module(f"lrattn_lightning.model.routing.attnres.{b.module}"), b.router)


def compile_impl(name: str) -> str:
    """The backend a torch.compile'd decoder takes for `name` (`fast` -> `compiled`: same parameters and results)."""
    return backend(name).under_compile
