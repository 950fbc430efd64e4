"""A kind is what defines it: every kind of KINDS states every member of kind.py (an abstract class, checked when
KINDS is built), and adding a kind touches the places docs/extending.md lists, no others: each by-kind table it names
holds only kinds of KINDS (those it marks *every kind* hold each one), and no other module-level table nor any
comparison outside the kinds' own files names a kind."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT, ROUTING_TESTS

from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.model.routing import kind as kind_module
from lrattn_lightning.model.routing.kind import NoOptions, RoutingKind, missing_members
from lrattn_lightning.model.routing.kinds import KINDS, registered
from lrattn_lightning.model.routing.residual import KIND as RESIDUAL

PACKAGE = REPO_ROOT / "lrattn_lightning"
ROUTING = PACKAGE / "model" / "routing"
EXTENDING = REPO_ROOT / "docs" / "extending.md"
MEMBERS = ("validate_model", "resolve_impl", "build", "extra_out", "key_dim", "block_ends", "routing_params",
           "added_flops", "adamw_names", "code_paths")


def places() -> list[tuple[str, tuple[str, ...], bool]]:
    """(module path, its tables, whether every kind must be there) for each by-kind table extending.md's list names."""
    text = EXTENDING.read_text()
    section = text[text.index("## Adding a built-in routing kind"):]
    section = section[: section.index("\n## ", 4)]
    out = []
    for row in (line for line in section.splitlines() if line.startswith("| ")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) != 3:
            continue
        found = re.fullmatch(r"`(lrattn_lightning/[\w/]+\.py)`((?: `[A-Z_]+`)+)", cells[1])
        if found:
            out.append((found[1], tuple(re.findall(r"`([A-Z_]+)`", found[2])), cells[2].startswith("every kind")))
    return out


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def own_files() -> set[Path]:
    """A kind's own files: the modules of model/routing/ defining `KIND = `, the attnres/ folder, kinds.py and the
    protocol kind.py."""
    own = {p for p in ROUTING.glob("*.py") if "\nKIND = " in p.read_text()}
    return own | set((ROUTING / "attnres").rglob("*.py")) | {ROUTING / "kinds.py", ROUTING / "kind.py"}


def kind_names_outside(names: set[str], allowed: set[tuple[str, str]], package: Path = PACKAGE) -> list[str]:
    """`module:line: what` of every module-level table keyed by a kind's name that is not `allowed` (module, table),
    and of every comparison with a kind's name, outside the kinds' own files (of `package`, or a stand-in)."""
    out = []
    own = own_files()
    for path in sorted(package.rglob("*.py")):
        if path in own:
            continue
        tree = ast.parse(path.read_text())
        name = module_name(str(path.relative_to(package.parent)))
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            if isinstance(value, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in names for k in value.keys):
                table = getattr(targets[0], "id", "?") if targets else "?"
                if (name, table) not in allowed:
                    out.append(f"{name}:{node.lineno}: table {table} is keyed by kind names")
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                    out.append(f"{name}:{node.lineno}: compares with a kind's name")
    return out


def test_every_kind_states_every_member():
    assert RoutingKind.__abstractmethods__ == frozenset(MEMBERS)  # this test's list is kind.py's
    for name, kind in KINDS.items():
        assert missing_members(kind) == [] and kind.name == name
        for member in MEMBERS:  # stated by the kind's own class (or a kind it derives), never by the protocol
            owner = next(c for c in type(kind).__mro__ if member in vars(c))
            assert owner is not RoutingKind and issubclass(owner, RoutingKind), (name, member)


def test_a_kind_that_leaves_a_member_out_is_refused_at_registration():
    stated = {member: getattr(type(RESIDUAL), member) for member in MEMBERS}  # (its own or UnkeyedKind's)
    attributes = {"name": "toy", "Options": NoOptions, "takes_impl": False}
    flopless = type("Flopless", (RoutingKind,), attributes | {m: f for m, f in stated.items() if m != "added_flops"})
    with pytest.raises(TypeError, match="added_flops"):
        flopless()
    whole = type("Whole", (RoutingKind,), attributes | stated)
    assert registered(whole())["toy"].added_flops(None) == 0
    unnamed = type("Unnamed", (RoutingKind,), {"Options": NoOptions, "takes_impl": False} | stated)
    with pytest.raises(TypeError, match="leaves name unstated"):
        registered(unnamed())
    assert kind_module.ATTRIBUTES == ("name", "Options", "takes_impl")


def test_the_listed_tables_name_only_kinds_and_the_every_kind_ones_name_each():
    listed = places()
    tables = {(module_name(path), table) for path, names, _ in listed for table in names}
    assert ("lrattn_lightning.train.routing_axes", "RECORDED") in tables and len(tables) >= 6
    for path, names, every in listed:
        module = importlib.import_module(module_name(path))
        for table in names:
            keys = set(getattr(module, table))
            assert keys <= set(KINDS), f"{path} {table} names {keys - set(KINDS)}, not kinds"
            if every:
                assert keys == set(KINDS), f"{path} {table} misses {set(KINDS) - keys}"


def test_nothing_else_names_a_kind():
    allowed = {(module_name(path), table) for path, names, _ in places() for table in names}
    assert kind_names_outside(set(KINDS), allowed) == []


def test_the_places_check_would_catch_a_stray_table_and_a_comparison(tmp_path):
    stray = tmp_path / "lrattn_lightning" / "tools" / "speed.py"
    stray.parent.mkdir(parents=True)
    stray.write_text('"""s"""\nSPEED = {"gated": 2}\nUNITS = {"forward": 3}\n\n\ndef f(cfg):\n'
                     '    return cfg.kind.name == "laurel"\n')
    found = kind_names_outside(set(KINDS), {("lrattn_lightning.tools.other", "SPEED")}, tmp_path / "lrattn_lightning")
    assert found == ["lrattn_lightning.tools.speed:2: table SPEED is keyed by kind names",
                     "lrattn_lightning.tools.speed:7: compares with a kind's name"]
    assert kind_names_outside(set(KINDS), {("lrattn_lightning.tools.speed", "SPEED")},
                              tmp_path / "lrattn_lightning") == found[1:]


def test_every_kind_has_its_module_its_entries_and_its_tests():
    registry = load_registry()
    used = {a.routing for a in registry.ablations.values()}
    tests = ROUTING_TESTS
    for name, kind in KINDS.items():
        module = Path(importlib.import_module(type(kind).__module__).__file__)
        assert module.parent in (ROUTING, ROUTING / name), name
        assert name in used or name == "external", f"routing {name}: no registry entry"  # (external: the user's)
        assert (tests / f"test_{name}.py").exists() or (tests / name).is_dir() or list(tests.glob(f"test_{name}_*.py")), name
