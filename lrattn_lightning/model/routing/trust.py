"""Which router classes this process may import: a checkpoint or an exported folder names code, it never chooses it.

`routing: external` names a class by import path ("package.module:Class"). A registry file the user passes (or the
default registry a command reads, ./registry.yaml) and `--trust_router MODULE:CLASS` on the command line are the
user's word; a checkpoint's stored model_config, an exported config.json or an MLflow run are data from elsewhere.
Loading one rebuilds its model, so its router path is imported only when the user's word names the same class
(external.router_class asks `is_trusted` before importing anything).
"""

from __future__ import annotations

import re

from lrattn_lightning.core.errors import InputError

IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # package.module:Class

_TRUSTED: set[str] = set()


def trust(path: str, where: str = "--trust_router") -> str:
    """Allow the class `path` to be imported in this process (from a registry or the command line)."""
    if not isinstance(path, str) or not IMPORT_PATH.fullmatch(path):
        raise InputError(f"{where}: name the router class as 'package.module:Class', got {path!r}")
    _TRUSTED.add(path)
    return path


def is_trusted(path: str) -> bool:
    return path in _TRUSTED


def untrusted_error(path: str, entry: str) -> InputError:
    return InputError(f"router class '{path}' (ablation '{entry}') is named by a checkpoint or exported folder, not by "
                      "a registry you passed, so nothing was imported; pass --registry FILE whose external entry names "
                      f"'{path}', or --trust_router {path} if you trust that code (an exported folder: "
                      f"from_pretrained(..., trust_router='{path}'))")
