"""The package is layered and has no import cycle: a module imports only from its own layer or the ones below it,
lazily or not, and no chain of imports (lazy ones included) leads back to where it started.

core (one-line errors, flags, names, files) <- model (no Lightning, no MLflow) <- data <- train <- eval <- tools <- cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lrattn_lightning"
LAYERS = ["core", "model", "data", "train", "eval", "tools", "cli"]
# third-party frameworks the model layer must not need (its users import it without a training stack)
MODEL_FORBIDDEN = ("lightning", "mlflow", "litdata", "lm_eval", "torchmetrics")


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "lrattn_lightning" or len(parts) == 1:
        return LAYERS.index("cli")
    return LAYERS.index(parts[1])


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, path))
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (imports for annotations only: never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(path: Path) -> list[str]:
    """Every module `path` imports, at the top or inside a function; `from package import module` is that module."""
    known = {name for name, _ in modules()}
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path.name}: a relative import (the package imports absolutely)"
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            if len(subs) < len(node.names):  # names defined in the module itself
                found.append(node.module)
            found += subs
    return found


@pytest.mark.parametrize("name,path", modules(), ids=[m for m, _ in modules()])
def test_a_module_imports_only_its_layer_or_below(name, path):
    mine = layer_of(name)
    for target in imports_of(path):
        if target.startswith("lrattn_lightning"):
            assert layer_of(target) <= mine, f"{name} ({LAYERS[mine]}) imports {target} ({LAYERS[layer_of(target)]})"
        elif LAYERS[mine] in ("core", "model"):
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
    assert not bare, f"raise InputError (lrattn_lightning.core.errors) instead of ValueError at {bare}"


# a comparison of `routing` with a kind's name (or a list of them)
SWITCH = r"routing\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[]"


def _kind_modules() -> set[Path]:
    """A routing kind's own files: a module of model/routing/ defining `KIND = `, the files of its folder (attnres/),
    and the table of kinds."""
    folder = PACKAGE / "model" / "routing"
    own = {p for p in folder.glob("*.py") if "\nKIND = " in p.read_text()}
    return own | set((folder / "attnres").rglob("*.py")) | {folder / "kinds.py"}


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


def test_no_import_cycle_lazy_imports_included():
    """The drawn house: modules as nodes, their imports (top-level and inside functions) as edges; no cycle."""
    known = {name for name, _ in modules()}
    graph = {name: sorted({t for t in imports_of(path) if t in known and t != name}) for name, path in modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_the_cycle_check_would_catch_one(tmp_path):
    """Two modules importing each other (one of them inside a function) are a cycle to the check's graph walk."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('"""a"""\nfrom lrattn_lightning.core import names\n')
    b.write_text('"""b"""\ndef f():\n    from lrattn_lightning.core.errors import InputError\n')
    assert "lrattn_lightning.core.names" in imports_of(a) and "lrattn_lightning.core.errors" in imports_of(b)


def test_files_and_classes_stay_small():
    """A module past ~400 lines or a class past ~200 is a signal to split (STYLE); the few that are past it are
    named here with their reason, so a new one is a decision, not drift."""
    allowed = {  # module -> why it is longer
        "lrattn_lightning.cli.lightning": "LightningCLI's hooks in the order Lightning calls them",
        "lrattn_lightning.model.routing.attnres.triton.kernels": "Triton kernels, forward and backward side by side",
        "lrattn_lightning.model.routing.attnres.triton.ops": "torch custom ops with fakes and autograd per kernel",
        "lrattn_lightning.eval.run": "the Fabric launcher and its MLflow logging",
    }
    long_modules = {n for n, p in modules() if len(p.read_text().splitlines()) > 420} - set(allowed)
    assert not long_modules, f"modules over ~400 lines: {sorted(long_modules)}"
    long_classes = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 220 and name not in allowed:
                long_classes.append(f"{name}.{node.name}")
    assert not long_classes, f"classes over ~200 lines: {long_classes}"
