"""The package is layered: a module imports only from its own layer or the ones below it, lazily or not.

errors (shared one-line errors and flags) <- model (no Lightning, no MLflow) <- data <- train <- eval <- tools <- cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lrattn_lightning"
LAYERS = ["errors", "model", "data", "train", "eval", "tools", "cli"]
# third-party frameworks the model layer must not need (its users import it without a training stack)
MODEL_FORBIDDEN = ("lightning", "mlflow", "litdata", "lm_eval", "torchmetrics")


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "lrattn_lightning" or len(parts) == 1:
        return LAYERS.index("cli")
    head = parts[1]
    if head in ("cli", "lightning_cli"):
        return LAYERS.index("cli")
    return LAYERS.index(head)


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, path))
    return out


def imports_of(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path.name}: a relative import (the package imports absolutely)"
            found.append(node.module)
            if node.module == "lrattn_lightning":
                found += [f"lrattn_lightning.{a.name}" for a in node.names]
    return found


@pytest.mark.parametrize("name,path", modules(), ids=[m for m, _ in modules()])
def test_a_module_imports_only_its_layer_or_below(name, path):
    mine = layer_of(name)
    for target in imports_of(path):
        if target.startswith("lrattn_lightning"):
            assert layer_of(target) <= mine, f"{name} ({LAYERS[mine]}) imports {target} ({LAYERS[layer_of(target)]})"
        elif LAYERS[mine] in ("errors", "model"):
            assert target.split(".")[0] not in MODEL_FORBIDDEN, f"{name} imports {target}"


def test_every_module_says_what_it_holds():
    missing = [n for n, p in modules() if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without an opening docstring: {missing}"


def test_every_subcommand_resolves_to_a_function():
    from lrattn_lightning.cli import COMMANDS, _function

    for name, (spec, _) in COMMANDS.items():
        assert callable(_function(spec)), name


def test_errors_about_input_derive_from_input_error():
    """`lrattn` prints InputError as one line and lets anything else trace: the package raises no bare ValueError."""
    bare = [f"{n}:{node.lineno}" for n, p in modules() for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", None) == "ValueError"]
    assert not bare, f"raise InputError (lrattn_lightning.errors) instead of ValueError at {bare}"


# a comparison of `routing` with a kind's name (or a list of them)
SWITCH = r"routing\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[]"


def _kind_modules() -> set[Path]:
    """A routing kind's own files: model/routing/NAME.py with its `KIND = ` line, and what it keeps beside it
    (attnres_kind.py), and the kinds module itself."""
    folder = PACKAGE / "model" / "routing"
    own = {p for p in folder.glob("*.py") if "\nKIND = " in p.read_text()}
    return own | {folder / "attnres_kind.py", folder / "kinds.py"}


def test_only_a_routing_kinds_own_files_name_routing_kinds():
    """Everything about a routing kind lives in its module (model/routing/kinds.py): no other module switches on
    `routing` or compares it with a kind's name."""
    import re

    switch = re.compile(SWITCH)
    offenders = []
    for name, path in modules():
        if path in _kind_modules():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if switch.search(line):
                offenders.append(f"{name}:{number}: {line.strip()}")
    assert not offenders, offenders
    from lrattn_lightning.model.routing.kinds import known_kinds

    assert set(known_kinds()) >= {"residual", "attnres", "gated", "external"}


def test_the_switch_check_would_catch_one():
    import re

    switch = re.compile(SWITCH)
    assert switch.search('if cfg.ablation.routing == "gated":') and switch.search("a.routing in ('x', 'y')")
    assert not switch.search("kind = kind_of(self.routing, where)")
