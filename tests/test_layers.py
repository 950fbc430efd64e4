"""The package is layered and has no import cycle: a module imports only from its own layer or the ones below it,
lazily or not, and no chain of imports (lazy ones included) leads back to where it started.

core (one-line errors, flags, names, files) <- model (no Lightning, no MLflow) <- data <- train <- eval <- tools <- cli.

Each check is a function of a list of modules, run on the package by one test and, by another, on modules written to
a temporary folder that break it (`..._would_catch_...`): a check that could never fail is caught there. The tests
mirror the package (tests/model/routing/ holds the routing kinds' tests; tests/e2e/ those whose point is real
processes), their module names unique across folders.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT, TESTS_DIR

PACKAGE = REPO_ROOT / "lrattn_lightning"
LAYERS = ["core", "model", "data", "train", "eval", "tools", "cli"]
# third-party frameworks the model layer must not need (its users import it without a training stack)
MODEL_FORBIDDEN = ("lightning", "mlflow", "litdata", "lm_eval", "torchmetrics")


def layer_of(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "lrattn_lightning" or len(parts) == 1:
        return LAYERS.index("cli")
    return LAYERS.index(parts[1])


@functools.cache
def modules(package: Path = PACKAGE) -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of `package` (the package itself, or a stand-in written by a test)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out.append((name, path))
    return out


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A stand-in package `lrattn_lightning` under `root`: {"core/a.py": source, ...} (sources dedented)."""
    package = root / "lrattn_lightning"
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(textwrap.dedent(text))
    return package


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


def imports_of(path: Path, known: set[str] | None = None) -> list[str]:
    """Every module `path` imports, at the top or inside a function; `from package import module` is that module
    (one of `known`: the package's modules unless given)."""
    known = {name for name, _ in modules()} if known is None else known
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


def layer_violations(name: str, path: Path, known: set[str] | None = None) -> list[str]:
    """Imports of module `name` from a higher layer, and the frameworks core and model must not need."""
    mine, out = layer_of(name), []
    for target in imports_of(path, known):
        if target.startswith("lrattn_lightning"):
            if layer_of(target) > mine:
                out.append(f"{name} ({LAYERS[mine]}) imports {target} ({LAYERS[layer_of(target)]})")
        elif LAYERS[mine] in ("core", "model") and target.split(".")[0] in MODEL_FORBIDDEN:
            out.append(f"{name} imports {target}")
    return out


@pytest.mark.parametrize("name,path", modules(), ids=[m for m, _ in modules()])
def test_a_module_imports_only_its_layer_or_below(name, path):
    assert layer_violations(name, path) == []


def undocumented(mods: list[tuple[str, Path]]) -> list[str]:
    """Modules with code but no opening docstring."""
    return [n for n, p in mods if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]


def test_every_module_says_what_it_holds():
    missing = undocumented(modules())
    assert not missing, f"modules without an opening docstring: {missing}"


def test_every_subcommand_resolves_to_a_function():
    from lrattn_lightning.cli import COMMANDS, _function

    for name, (spec, _) in COMMANDS.items():
        assert callable(_function(spec)), name


def bare_value_errors(mods: list[tuple[str, Path]]) -> list[str]:
    """`module:line` of every `raise ValueError(...)`."""
    return [f"{n}:{node.lineno}" for n, p in mods for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", None) == "ValueError"]


def test_errors_about_input_derive_from_input_error():
    """`lrattn` prints InputError as one line and lets anything else trace: the package raises no bare ValueError."""
    bare = bare_value_errors(modules())
    assert not bare, f"raise InputError (lrattn_lightning.core.errors) instead of ValueError at {bare}"


# a comparison of `routing` with a kind's name (or a list of them)
SWITCH = r"routing\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[]"


def _kind_modules(package: Path = PACKAGE) -> set[Path]:
    """A routing kind's own files: a module of model/routing/ defining `KIND = `, the files of its folder (attnres/),
    and the table of kinds."""
    folder = package / "model" / "routing"
    own = {p for p in folder.glob("*.py") if "\nKIND = " in p.read_text()}
    return own | set((folder / "attnres").rglob("*.py")) | {folder / "kinds.py"}


def routing_switches(mods: list[tuple[str, Path]], exempt: set[Path]) -> list[str]:
    """`module:line: text` of every line outside `exempt` that switches on `routing`."""
    switch = re.compile(SWITCH)
    return [f"{name}:{number}: {line.strip()}" for name, path in mods if path not in exempt
            for number, line in enumerate(path.read_text().splitlines(), 1) if switch.search(line)]


def test_only_a_routing_kinds_own_files_name_routing_kinds():
    """What defines a routing kind lives in its module (model/routing/kind.py): no other module switches on `routing`
    or compares it with a kind's name (an outer layer's table by kind name: tests/model/routing/test_kinds.py)."""
    offenders = routing_switches(modules(), _kind_modules())
    assert not offenders, offenders
    from lrattn_lightning.model.routing.kinds import known_kinds

    assert set(known_kinds()) >= {"residual", "attnres", "gated", "external"}


def test_the_switch_check_would_catch_one(tmp_path):
    """The pattern, and the scan over a stand-in package: a switch outside a kind's files is named, one inside is not."""
    switch = re.compile(SWITCH)
    assert switch.search('if cfg.ablation.routing == "gated":') and switch.search("a.routing in ('x', 'y')")
    assert not switch.search("kind = kind_of(self.routing, where)")
    package = write_package(tmp_path, {
        "train/step.py": '"""s"""\ndef f(cfg):\n    if cfg.routing != "attnres":\n        return 1\n',
        "model/routing/mine.py": '"""m"""\nKIND = "mine"\nSAME = "x".routing == "mine"\n',
        "model/routing/kinds.py": '"""k"""\nALL = [k for k in ("a",) if k.routing in ("a", "b")]\n'})
    assert routing_switches(modules(package), _kind_modules(package)) == [
        'lrattn_lightning.train.step:3: if cfg.routing != "attnres":']


def import_cycles(mods: list[tuple[str, Path]]) -> list[list[str]]:
    """Modules as nodes, their imports (top-level and inside functions) as edges: every cycle a depth-first walk
    meets, as the path that closes it (its first module repeated at the end)."""
    known = {name for name, _ in mods}
    graph = {name: sorted({t for t in imports_of(path, known) if t in known and t != name}) for name, path in mods}
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
    return cycles


def test_no_import_cycle_lazy_imports_included():
    """The drawn house: modules as nodes, their imports (top-level and inside functions) as edges; no cycle."""
    cycles = import_cycles(modules())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_the_cycle_check_would_catch_one(tmp_path):
    """A stand-in package: a imports b at the top, b imports a inside a function (the lazy import that dodges the
    cycle at run time), c -> d -> e -> c through `from package import module`; the walk names both cycles. The same
    modules without the lazy import, or with it under `if TYPE_CHECKING:`, have none."""
    files = {
        "core/__init__.py": '"""p"""\n',
        "core/a.py": '"""a"""\nfrom lrattn_lightning.core import b\n',
        "core/b.py": '"""b"""\ndef f():\n    from lrattn_lightning.core.a import g\n',
        "model/c.py": '"""c"""\nimport lrattn_lightning.model.d\n',
        "model/d.py": '"""d"""\nfrom lrattn_lightning.model import e\n',
        "model/e.py": '"""e"""\ndef f():\n    import lrattn_lightning.model.c\n',
        "model/f.py": '"""f, imported by nothing; imports c"""\nfrom lrattn_lightning.model.c import x\n',
    }
    cycles = import_cycles(modules(write_package(tmp_path / "cyclic", files)))
    assert sorted(" -> ".join(c).replace("lrattn_lightning.", "") for c in cycles) == [
        "core.a -> core.b -> core.a", "model.c -> model.d -> model.e -> model.c"]
    files["core/b.py"] = '"""b"""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lrattn_lightning.core.a import g\n'
    files["model/e.py"] = '"""e"""\ndef f():\n    import lrattn_lightning.core.a\n'
    assert import_cycles(modules(write_package(tmp_path / "acyclic", files))) == []


def test_the_import_reader_would_catch_what_it_claims(tmp_path):
    """Imports at the top and inside functions, `from package import module` as the module, names from a module as
    the module, not what `if TYPE_CHECKING:` guards; a relative import is refused."""
    package = write_package(tmp_path, {
        "core/__init__.py": '"""p"""\n',
        "core/errors.py": '"""e"""\n',
        "core/x.py": '''\
            """x"""
            import os
            from typing import TYPE_CHECKING
            from lrattn_lightning.core import errors
            if TYPE_CHECKING:
                from lrattn_lightning.train import lit_module
            def f():
                from lrattn_lightning.core.errors import InputError
            ''',
        "core/y.py": '"""y"""\nfrom . import errors\n'})
    known = {name for name, _ in modules(package)}
    assert sorted(imports_of(package / "core" / "x.py", known)) == [
        "lrattn_lightning.core.errors", "lrattn_lightning.core.errors", "os", "typing"]
    with pytest.raises(AssertionError, match="y.py: a relative import"):
        imports_of(package / "core" / "y.py", known)


def test_the_layer_docstring_and_error_checks_would_catch_one(tmp_path):
    """A model module importing training (lazily) and Lightning, a core module importing the CLI, a module without a
    docstring and a bare `raise ValueError(...)` are each named; a module importing downwards is not."""
    package = write_package(tmp_path, {
        "model/bad.py": '"""b"""\nimport lightning\ndef f():\n    from lrattn_lightning.train import lit_module\n',
        "core/worse.py": '"""w"""\nimport lrattn_lightning.cli\n',
        "train/fine.py": '"""f"""\nfrom lrattn_lightning.model import bad\nimport lightning\n',
        "data/quiet.py": "X = 1\n",
        "data/raises.py": '"""r"""\ndef f(x):\n    if x:\n        raise ValueError("x")\n    raise TypeError("y")\n'})
    mods = modules(package)
    known = {name for name, _ in mods}
    found = {name.removeprefix("lrattn_lightning."): sorted(layer_violations(name, path, known)) for name, path in mods}
    assert found == {
        "model.bad": ["lrattn_lightning.model.bad (model) imports lrattn_lightning.train (train)",
                      "lrattn_lightning.model.bad imports lightning"],
        "core.worse": ["lrattn_lightning.core.worse (core) imports lrattn_lightning.cli (cli)"],
        "train.fine": [], "data.quiet": [], "data.raises": []}
    assert undocumented(mods) == ["lrattn_lightning.data.quiet"]
    assert bare_value_errors(mods) == ["lrattn_lightning.data.raises:4"]


# the modules that use the kernels (model/routing/attnres/triton/): the kernels never import them (STYLE: Liger's
# ops/ vs transformers/); the launch specs and compile check that drive every registry entry are tools/kernels/
KERNELS = PACKAGE / "model" / "routing" / "attnres" / "triton"
KERNEL_USERS = ("lrattn_lightning.model.registry", "lrattn_lightning.model.routing.kinds",
                "lrattn_lightning.model.decoder", "lrattn_lightning.tools", "lrattn_lightning.train",
                "lrattn_lightning.cli")


def _with_parents(module: str) -> list[str]:
    """Importing a.b.c runs a, a.b and a.b.c."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def users_reached(start: list[Path]) -> dict[str, list[str]]:
    """Kernel users that each module of `start` imports, directly or through the modules it imports (lazy
    imports and the packages Python runs on the way included): module -> the users' names."""
    known = dict(modules())
    out = {}
    for path in start:
        seen, todo, found = set(), list(imports_of(path)), []
        while todo:
            for name in _with_parents(todo.pop()):
                if name in seen:
                    continue
                seen.add(name)
                if any(name == u or name.startswith(u + ".") for u in KERNEL_USERS):
                    found.append(name)
                elif name in known:
                    todo += imports_of(known[name])
        out[path.stem] = sorted(found)
    return out


def test_kernels_never_import_their_users():
    """Nothing under model/routing/attnres/triton imports the registry, the table of routing kinds, the decoder
    (and its build_router), training, tools or the CLI, directly or through another module."""
    files = sorted(KERNELS.rglob("*.py"))
    assert {"kernels", "ops", "router", "launch"} <= {p.stem for p in files}
    reached = users_reached(files)
    assert {name: users for name, users in reached.items() if users} == {}


def test_the_kernel_users_check_would_catch_one(tmp_path):
    """A kernel module importing a user, directly, lazily or through a module that does, is named."""
    direct, lazy, through = tmp_path / "direct.py", tmp_path / "lazy.py", tmp_path / "through.py"
    direct.write_text('"""d"""\nfrom lrattn_lightning.model.routing import kinds\n')
    lazy.write_text('"""l"""\ndef f():\n    from lrattn_lightning.model.decoder import build_router\n')
    # generation imports the decoder: a kernel importing generation reaches it
    through.write_text('"""t"""\nimport lrattn_lightning.model.generate\n')
    reached = users_reached([direct, lazy, through])
    assert reached["direct"] == ["lrattn_lightning.model.routing.kinds"]
    assert reached["lazy"] == ["lrattn_lightning.model.decoder"]
    assert "lrattn_lightning.model.decoder" in reached["through"]


# A module is one job, whatever its length within reason (docs/architecture.md, "One job a module"): what a test can
# check is that the job is stated, first, and that no file or class runs away; where to split is the reader's call
MODULE_CEILING, CLASS_CEILING = 800, 400  # lines: past these a file or class has stopped being one job
JOB_SENTENCE = 480  # characters: the docstring's first sentence states the job (four lines at most)


def runaways(mods: list[tuple[str, Path]]) -> tuple[list[str], list[str]]:
    """(modules over MODULE_CEILING lines, `module.Class` over CLASS_CEILING lines)."""
    long_modules = sorted(n for n, p in mods if len(p.read_text().splitlines()) > MODULE_CEILING)
    long_classes = [f"{name}.{node.name}" for name, path in mods for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > CLASS_CEILING]
    return long_modules, long_classes


def unstated_jobs(mods: list[tuple[str, Path]]) -> list[str]:
    """Modules whose opening docstring does not start with their job: its first line blank, or its first sentence
    longer than JOB_SENTENCE characters (modules without code or docstring are undocumented()'s)."""
    out = []
    for name, path in mods:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) if path.read_text().strip() else None
        if not doc:
            continue
        summary = " ".join(doc.split("\n\n")[0].split())
        first = re.match(r"(.+?[.!?])(\s|$)", summary)
        if doc[0].isspace() or len(first.group(1) if first else summary) > JOB_SENTENCE:
            out.append(name)
    return out


def test_a_module_is_one_stated_job_of_a_sane_length():
    """Every module's docstring opens with its job, and no module or class is past the ceilings."""
    assert unstated_jobs(modules()) == [], "open the docstring with the module's job, in one sentence"
    long_modules, long_classes = runaways(modules())
    assert not long_modules, f"modules over {MODULE_CEILING} lines (more than one job?): {long_modules}"
    assert not long_classes, f"classes over {CLASS_CEILING} lines: {long_classes}"


def test_the_job_and_ceiling_checks_would_catch_one(tmp_path):
    """A module one line over, a class one line over (in a short module), a docstring opening with a blank line
    and one whose first sentence runs on are named; at the ceilings, or a sentence of the limit, not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(CLASS_CEILING))  # class line + CLASS_CEILING: end - start = limit
    package = write_package(tmp_path, {
        "core/long.py": '"""l"""\n' + "X = 1\n" * MODULE_CEILING,
        "core/edge.py": '"""e"""\n' + "X = 1\n" * (MODULE_CEILING - 1),
        "core/wide.py": '"""w"""\nclass Wide:\n' + body + "    y = 0\n",
        "core/fits.py": '"""f"""\nclass Fits:\n' + body,
        "data/blank.py": '"""\nThe job, a line late."""\n',
        "data/rambles.py": '"""' + "word " * (JOB_SENTENCE // 5) + 'on.\n\nDetail."""\n',
        "data/states.py": '"""' + "word " * (JOB_SENTENCE // 5 - 1) + 'on. And more detail after it."""\n'})
    mods = modules(package)
    assert runaways(mods) == (["lrattn_lightning.core.long"], ["lrattn_lightning.core.wide.Wide"])
    assert unstated_jobs(mods) == ["lrattn_lightning.data.blank", "lrattn_lightning.data.rambles"]


def test_the_tests_mirror_the_package():
    """Every folder of tests names a folder of the package (tests/e2e/: real processes; tests/golden/: data), and a
    test module's name is unique across folders (pytest's default import mode imports it by that name, from a folder
    without __init__.py; tests/helpers/ is the one package, of what test modules share)."""
    names: dict[str, list[str]] = {}
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(TESTS_DIR)))
        folder = path.parent.relative_to(TESTS_DIR)
        if folder.parts and folder.parts[0] not in ("e2e", "golden"):
            assert (PACKAGE / folder).is_dir(), f"tests/{folder} mirrors no folder of lrattn_lightning/"
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
    packages = [p for p in TESTS_DIR.rglob("__init__.py") if p.parent != TESTS_DIR / "helpers"]
    assert not packages, "a folder of test modules holds no __init__.py (rootdir-relative imports)"


def imports_of_test_modules(root: Path) -> list[str]:
    """`file: module` for each import of a test module (a `test_*` name), lazy ones included, in the Python files
    under `root`: what test modules share is tests/helpers/'s (or a conftest fixture's), not another test module's."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:  # (a relative import names no test module)
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    assert imports_of_test_modules(TESTS_DIR) == [], "move what both use to tests/helpers/ (or a conftest fixture)"


def test_the_test_import_check_would_catch_one(tmp_path):
    """`from test_x import ...`, `import test_y` and a lazy one inside a function are named; helpers and a name
    merely containing test_ are not."""
    (tmp_path / "e2e").mkdir()
    (tmp_path / "e2e" / "test_a.py").write_text("from test_x import helper\nimport test_y as y\n")
    (tmp_path / "test_b.py").write_text("def f():\n    from test_z.deep import g\n    return g\n")
    (tmp_path / "test_c.py").write_text("from helpers.runs import fit_args\nimport my_test_tools\nfrom . import x\n")
    assert imports_of_test_modules(tmp_path) == ["e2e/test_a.py: test_x", "e2e/test_a.py: test_y",
                                                 "test_b.py: test_z.deep"]
