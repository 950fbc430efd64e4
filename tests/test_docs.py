"""The documentation names only code that exists, and the architecture page names all of it.

README.md and docs/*.md: every `lrattn_lightning/...` path and package-relative module path (`model/decoder.py`,
`train/callbacks/`) exists; every dotted name `lrattn_lightning.x.y` is a module, or a name a module defines at its
top level. docs/architecture.md: every `*.py` it names is a file of the repository, and every module of the package
is named there. The package's own docstrings and comments follow the same path rule. Each check is a function run
on the real files and, by a `..._would_catch_...` test, on text that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "lrattn_lightning"
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
LAYERS = "core|model|data|train|eval|tools|cli"
# lrattn_lightning/a/b.py, lrattn_lightning/a/ (any file or folder); a/b.py or a/b/ from a layer's folder (a path
# inside another one, tests/model/x.py, is not: nothing before it but a space, quote or bracket)
PACKAGE_PATH = re.compile(r"(?<![\w/.-])lrattn_lightning/[\w/.-]*[\w/]")
LAYER_PATH = re.compile(rf"(?<![\w/.-])(?:{LAYERS})/(?:[\w]+/)*(?:\w+\.py\b|(?=[`\s),:;.]))")
DOTTED = re.compile(r"(?<![\w./])lrattn_lightning(?:\.[A-Za-z_]\w*)+")
PY_NAME = re.compile(r"(?<![\w/.-])(?:\w+/)*\w+\.py\b")


def _defined(path: Path) -> set[str]:
    """Names a module defines at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def dotted_exists(name: str, root: Path = REPO_ROOT) -> bool:
    """`lrattn_lightning.a.b` is a module under `root`, or `lrattn_lightning.a.B` a name module a defines."""
    parts = name.split(".")
    if _module_file(root, parts):
        return True
    module = _module_file(root, parts[:-1])
    return module is not None and parts[-1] in _defined(module)


def missing_names(text: str, root: Path = REPO_ROOT) -> list[str]:
    """The package paths and dotted names in `text` that name nothing under `root` (its package lrattn_lightning)."""
    package = root / "lrattn_lightning"
    out = [m.group(0) for m in PACKAGE_PATH.finditer(text) if not (root / m.group(0).rstrip("/.")).exists()]
    out += [m.group(0) for m in LAYER_PATH.finditer(text) if not (package / m.group(0)).exists()]
    out += [m.group(0) for m in DOTTED.finditer(text) if not dotted_exists(m.group(0), root)]
    return out


def test_the_docs_name_only_code_that_exists():
    stale = {str(p.relative_to(REPO_ROOT)): found for p in DOCS if (found := missing_names(p.read_text()))}
    assert stale == {}


def test_the_package_names_only_its_own_paths():
    """Docstrings and comments that point at a module by its path (`train/callbacks/`, `lrattn_lightning/...`)."""
    stale = {str(p.relative_to(REPO_ROOT)): found for p in sorted(PACKAGE.rglob("*.py"))
             if (found := missing_names(p.read_text()))}
    assert stale == {}


def unnamed_modules(text: str, package: Path = PACKAGE) -> list[str]:
    """Modules of `package` whose file name `text` never mentions (package __init__ and __main__ aside)."""
    named = {Path(m.group(0)).name for m in PY_NAME.finditer(text)}
    return sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                  if p.name not in ("__init__.py", "__main__.py") and p.name not in named)


def unknown_files(text: str, root: Path = REPO_ROOT) -> list[str]:
    """`*.py` names in `text` that no file of the package, tests/ or benchmarks/ under `root` has."""
    files = {p.name for folder in ("lrattn_lightning", "tests", "benchmarks") for p in (root / folder).rglob("*.py")}
    return [m.group(0) for m in PY_NAME.finditer(text) if Path(m.group(0)).name not in files]


def test_the_architecture_page_names_every_module_and_only_real_ones():
    text = ARCHITECTURE.read_text()
    assert unnamed_modules(text) == [], "docs/architecture.md's module list misses these"
    assert unknown_files(text) == [], "docs/architecture.md names files that do not exist"


def test_the_checks_would_catch_a_stale_name(tmp_path):
    """A stand-in repository: a module, a name it defines, a folder; stale paths, dotted names and modules are
    named, live ones (and metric names such as train/loss, paths inside tests/) are not."""
    package = tmp_path / "lrattn_lightning"
    (package / "model" / "routing").mkdir(parents=True)
    (package / "__init__.py").write_text('"""p"""\n')
    (package / "model" / "__init__.py").write_text('"""m"""\n')
    (package / "model" / "decoder.py").write_text('"""d"""\nimport torch as t\nclass Decoder: ...\nX: int = 1\n')
    (package / "model" / "routing" / "router.py").write_text('"""r"""\n')
    text = ("`lrattn_lightning/model/decoder.py`, lrattn_lightning/model/routing/ and model/routing/router.py; "
            "`lrattn_lightning.model.decoder.Decoder` and lrattn_lightning.model.decoder.X; train/loss, "
            "tests/model/test_decoder.py; gone: lrattn_lightning/model/old.py, `model/routing/gone.py`, "
            "model/gone/ and lrattn_lightning.model.decoder.Gone, lrattn_lightning.eval.run.EvalCallback.")
    assert missing_names(text, tmp_path) == [
        "lrattn_lightning/model/old.py", "model/routing/gone.py", "model/gone/", "lrattn_lightning.model.decoder.Gone",
        "lrattn_lightning.eval.run.EvalCallback"]
    assert unnamed_modules("decoder.py holds the model", package) == ["model/routing/router.py"]
    assert unknown_files("decoder.py, router.py and group_ops.py", tmp_path) == ["group_ops.py"]
