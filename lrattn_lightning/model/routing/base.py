"""The router protocol the decoder drives, and `build_router`: the config's routing kind picks the class.

A forward pass is `state = router.start(o_0)`, then for each sublayer i = 1..2L `h = router.read(state, i-1)`,
the sublayer computes o_i from RMSNorm(h), `router.write(state, i, o_i)`; finally `router.read(state, 2L)`.
Each router has its own state type (what one pass has written) and, for KV-cache decoding, may keep its own
cache object across passes (`new_cache`; the decoder's KVCache holds it without looking inside).

    routing: residual   ResidualRouter    residual.py
    routing: gated      GatedRouter       gated.py
    routing: external   the user's class  external.py          `router: package.module:Class` in the registry
    routing: attnres    by backend (`impl`): how AttnRes is computed, never what; same parameters and results
        reference   ReferenceAttnRes   attnres.py           readable: stacks the sources at every read
        fast        FastAttnRes        attnres_fast.py      buffered autograd Functions, logits at write time
                                                            (the default; eager training and inference)
        compiled    CompiledAttnRes    attnres_compiled.py  plain tensor ops that torch.compile traces
        triton      TritonAttnRes      attnres_triton.py    one fused Triton kernel per read (torch custom ops,
                                                            kept whole by torch.compile); CUDA, or the CPU
                                                            interpreter under TRITON_INTERPRET=1

`fast` is not traceable by torch.compile (it raises there; `compile_impl` names the backend to use), and
it does not fold per-token queries into write-time logits: for `query: gated_dynamic` it is served by the
`compiled` class, run eagerly. Residual and gated routing have one implementation each and ignore `impl`.
No backend is picked by a runtime rule: KV-cache decoding (one token a pass, bound by per-op overhead) runs
the named backend too, and on CPU `reference` / `compiled` decode faster than `fast` (~0.10 s against
~0.13 s for 64 tokens at `small`, s-lr-block-n8-r64).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

from lrattn_lightning.errors import InputError
from lrattn_lightning.model.config import ALL_IMPLS, IMPLS, ModelConfig
from lrattn_lightning.model.routing.attnres import ReferenceAttnRes
from lrattn_lightning.model.routing.attnres_compiled import CompiledAttnRes
from lrattn_lightning.model.routing.attnres_fast import FastAttnRes

DEFAULT_IMPL = "fast"
__all__ = ["ALL_IMPLS", "ATTNRES_BACKENDS", "DEFAULT_IMPL", "IMPLS", "Router", "build_router", "compile_impl"]
ATTNRES_BACKENDS: dict[str, type[nn.Module]] = {
    "reference": ReferenceAttnRes, "fast": FastAttnRes, "compiled": CompiledAttnRes,
}  # + "triton", imported when first asked for (its module registers torch custom ops)


class Router(Protocol):
    """What the decoder calls (every router is also an nn.Module holding its parameters)."""

    def reset_parameters(self) -> None: ...

    def new_cache(self) -> Any:
        """A cache for incremental decoding kept across passes, or None when the router needs none."""

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: Any = None,
              segments: Tensor | None = None) -> Any:
        """Begin a pass at the embedding o_0 [B, T, D]; record: keep the routing weights (state.weights);
        segments: document masking's segment id per position [B, T] (None without it). Routing that is per
        token (residual, AttnRes) ignores it; the gated residual's running means restart at each document."""

    def write(self, state: Any, i: int, out_BTE: Tensor) -> None:
        """Sublayer i's raw output ([B, T, D], or [B, T, D + extra rows] for P-LR / dynamic query)."""

    def read(self, state: Any, j: int) -> Tensor:
        """The hidden state at read site j (0..2L) -> [B, T, D]."""


def compile_impl(impl: str) -> str:
    """The backend a torch.compile'd decoder takes for `impl`: `fast` becomes `compiled` (same parameters,
    same results; its buffered Functions cannot be traced), the others trace as they are."""
    return "compiled" if impl == "fast" else impl


def build_router(cfg: ModelConfig, impl: str = DEFAULT_IMPL) -> nn.Module:
    """The router of `cfg`'s routing kind (kinds.py); for AttnRes computed by backend `impl` (module docstring)."""
    if impl not in ALL_IMPLS:
        raise InputError(f"impl must be one of {list(ALL_IMPLS)}, got {impl!r}")
    return cfg.kind.build(cfg, impl)
