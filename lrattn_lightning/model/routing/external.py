"""Routers from outside the package (routing: external): a registry entry names a class by import path.

    ablations:
      my-router:
        doc: ...
        control: baseline
        routing: external
        router: my_pkg.routers:MyRouter      # imported when the model is built, from the user's environment
        router_options: {width: 4}           # keyword arguments: MyRouter(cfg, width=4)

The contract (docs/extending.md, "Writing your own router"; kept stable): the class is an `nn.Module` built as
`Class(cfg, **router_options)` (cfg: the resolved ModelConfig) with the required part of the Router of router.py,
`start(emb, *, record=False, cache=None, segments=None) -> state`, `read(state, j)`, `write(state, i, out)` and
`reset_parameters()`; router.py's optional methods (`new_cache`, `read_attention`, `mix_values`,
`recorded_weights`) it may define or leave to their defaults: a class that does not derive Router is built as
`with_router_defaults(Class)`, a subclass of the same name that adds only those defaults (the same parameters and
state-dict keys). Optional for the external kind: `added_flops_per_token() -> int` (forward FLOPs per token it adds
to the core; without it the added FLOPs are recorded as unknown) and `adamw_parameter_names() -> iterable of its own
parameter names` (those go to AdamW, the rest by the usual rule: matrices to Muon; without it every parameter of the
router goes to AdamW). `write`'s `out` is [B, T, D], exactly d wide. A recording state (`start(record=True)`) may
carry `weights`: a list of one tensor [S, B, T] or [S, B, T, m] per heatmap row (the weights of its S sources),
logged as routing/weights.json and drawn by compare (train/diagnostics.py).

Only classes named in the registry the user passes (or by `--trust_router`) are imported (routing/trust.py): a
checkpoint or an exported folder that names another class is refused before anything is imported. A missing module
or class is one line.
The class's parameter count is its real one: the analytic counts build it once on the meta device.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lrattn_lightning.core.errors import InputError, config_error
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import OPTIONAL, REQUIRED, Router
from lrattn_lightning.model.routing.trust import IMPORT_PATH, is_trusted, untrusted_error


def router_class(cfg: ModelConfig) -> type[nn.Module]:
    """Import the class `cfg.options.router` names, if the user named it (trust.py); one line when it cannot be."""
    a, name = cfg.options, cfg.ablation.name
    where = f"ablations.{name}"
    if not is_trusted(str(a.router)):
        raise untrusted_error(str(a.router), name)
    module_name, _, class_name = str(a.router).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ModuleNotFoundError, or the module failing on import
        raise config_error(
            where,
            "router",
            f"cannot import module '{module_name}' ({type(err).__name__}: {err}); "
            "install the package that provides it or put its folder on PYTHONPATH",
        ) from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        found = "not found" if cls is None else f"is a {type(cls).__name__}, not an nn.Module class"
        raise config_error(
            where,
            "router",
            f"'{class_name}' in module '{module_name}' {found}; name an nn.Module "
            "class as 'package.module:Class'",
        )
    return cls


def build_external(cfg: ModelConfig) -> Router:
    cls = with_router_defaults(router_class(cfg))
    options = dict(cfg.options.router_options or {})
    try:
        router = cls(cfg, **options)
    except TypeError as err:
        raise config_error(
            f"ablations.{cfg.ablation.name}",
            "router_options",
            f"{cfg.options.router}(cfg, **{options!r}) failed: {err}",
        ) from None
    missing = [m for m in REQUIRED if not _defines(router, m)]
    if missing:
        raise config_error(
            f"ablations.{cfg.ablation.name}",
            "router",
            f"{cfg.options.router} lacks {', '.join(missing)} of the Router protocol (docs/extending.md, "
            "'Writing your own router')",
        )
    return router


@functools.cache
def with_router_defaults(cls: type[nn.Module]) -> type[Router]:
    """The user's class as a Router: itself if it derives Router, else a subclass of the same name whose bases are
    (cls, Router), so the class's own methods come first and Router gives the optional ones it lacks (or sets to
    None, as an absent one). No attribute, parameter or state-dict key of the class changes."""
    if issubclass(cls, Router):
        return cls
    defaults = {m: getattr(Router, m) for m in OPTIONAL if not callable(getattr(cls, m, None))}
    return type(
        cls.__name__,
        (cls, Router),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, **defaults},
    )


def _defines(router: Router, name: str) -> bool:
    """Whether the router has a method `name` of its own, not Router's placeholder that raises."""
    method = getattr(router, name, None)
    return callable(method) and getattr(method, "__func__", None) is not getattr(Router, name)


_FACTS: dict[str, tuple[int, int | None]] = {}


def facts(cfg: ModelConfig) -> tuple[int, int | None]:
    """(parameter count, added forward FLOPs per token or None: unknown) of the router, built on meta."""
    key = repr(cfg)
    if key not in _FACTS:
        with torch.device("meta"):
            router = build_external(cfg)
        flops = (
            router.added_flops_per_token()
            if callable(getattr(router, "added_flops_per_token", None))
            else None
        )
        if flops is not None and (isinstance(flops, bool) or not isinstance(flops, int) or flops < 0):
            raise InputError(
                f"{cfg.options.router}.added_flops_per_token() must return an integer >= 0, got {flops!r}"
            )
        _FACTS[key] = (sum(p.numel() for p in router.parameters()), flops)
    return _FACTS[key]


def adamw_names(router: nn.Module) -> set[str] | None:
    """The router's own parameter names that AdamW takes (None: the router does not say)."""
    method: Any = getattr(router, "adamw_parameter_names", None)
    if not callable(method):
        return None
    names = set(method())
    known = {n for n, _ in router.named_parameters()}
    if names - known:
        raise InputError(
            f"adamw_parameter_names() of {type(router).__name__} names {sorted(names - known)[:3]}, "
            f"which are not its parameters ({sorted(known)[:5]})"
        )
    return names


@dataclass(frozen=True)
class ExternalOptions(KindOptions):
    # both checked by `rules` (an import path; identifier keys), not by their annotations
    router: Any = None  # "package.module:Class", imported when the model is built (if trusted: trust.py)
    router_options: Any = None  # keyword arguments of that class, a mapping (or null)

    def rules(self, where: str) -> None:
        """router: an import path; router_options: a mapping of identifier keys (or null)."""
        if not isinstance(self.router, str) or not IMPORT_PATH.fullmatch(self.router):
            raise self.error(
                where,
                "router",
                f"routing external needs the class as 'package.module:Class', got {self.router!r}",
            )
        options = self.router_options
        if options is not None and (
            not isinstance(options, dict) or not all(isinstance(k, str) and k.isidentifier() for k in options)
        ):
            raise self.error(
                where,
                "router_options",
                f"must be a mapping of keyword arguments (identifier keys) or null, got {options!r}",
            )


class ExternalKind(UnkeyedKind):
    """A user's router class: its counts and AdamW names are what the class says of itself (facts, adamw_names); the
    class is its own one implementation, and the contract has it output exactly d wide (unkeyed)."""

    name = "external"
    Options = ExternalOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """The class is checked when it is built (build_external), not here: nothing to import at load."""

    def build(self, cfg: ModelConfig, impl: str) -> Router:
        return build_external(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        return facts(cfg)[0]

    def added_flops(self, cfg: ModelConfig) -> int | None:
        return facts(cfg)[1]

    def adamw_names(self, router: nn.Module) -> set[str] | None:
        return adamw_names(router)

    def code_paths(self, options: ExternalOptions) -> list[str]:
        return [options.router]


KIND = ExternalKind()
