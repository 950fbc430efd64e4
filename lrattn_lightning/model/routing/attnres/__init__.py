"""AttnRes (`routing: attnres`): the routing kind and its backends, one folder.

    options.py         AttnResOptions (what an entry chooses, checked), the key width r and logit scale s
    kind.py            KIND: its size checks, accounting, build by backend
    backends.py        the one table of backends: name, router class, compiled substitute, what it needs;
                       availability(impl, device), resolve_impl(impl, compiled, per_token_queries) (the kind's
                       one resolution, KIND.resolve_impl), needs_parity_check(impl): what callers ask of it
    reference.py       the readable backend (nanoGPT-style): sources, block summaries, depth_read
    keys.py            key sources (value, projected, sliced, value_projected[_shared]) with their parameters
    summary.py         RMS Block AttnRes's summaries (block_summary rms): the normalised outputs' sum
    fast.py, fast_functions.py   the buffered backend and its hand-written autograd Functions
    compiled.py        plain tensor ops for torch.compile
    triton/            fused Triton kernels (kernels.py: triton only), their torch custom ops, the router;
                       imports none of its users (their launches are checked in tools/kernels/)
"""

from lrattn_lightning.model.routing.attnres.backends import (
           AUTO,
           BACKENDS,
           DEFAULT_IMPL,
           IMPLS,
           PORTABLE_IMPLS,
           availability,
           compile_impl,
           needs_parity_check,
           resolve_impl,
)
from lrattn_lightning.model.routing.attnres.kind import KIND
from lrattn_lightning.model.routing.attnres.options import AttnResOptions, key_dim, logit_scale

__all__ = ["AUTO", "BACKENDS", "DEFAULT_IMPL", "IMPLS", "KIND", "PORTABLE_IMPLS", "AttnResOptions", "availability",
           "compile_impl", "key_dim", "logit_scale", "needs_parity_check", "resolve_impl"]
