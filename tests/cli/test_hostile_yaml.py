"""Hostile inputs (issue 38): YAML that would expand or nest without end, and sizes no machine holds.

Every YAML lrattn reads goes through core/files.py's one loader (a billion-laughs document, 10,000 levels of
nesting, a recursive alias: refused from the node graph, before anything is built), and a model read from a file
is held to model/accounting.py's budget before it is built. Bad input is one line `lrattn: error: ...`, exit 2,
from a real `lrattn` process run in a folder outside the checkout, with nothing written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers.cli import in_process
from helpers.paths import REPO_ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from lrattn_lightning.core import files
from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import MAX_ALIAS_NODES, MAX_YAML_DEPTH, check_yaml_limits, load_yaml_strict
from lrattn_lightning.model.accounting import MAX_LAYERS, MAX_PARAMS, count_params
from lrattn_lightning.model.registry import load_registry

REPO = REPO_ROOT
REGISTRY = str(REPO / "registry.yaml")
TINY = "{doc: t, n_layers: 2, d_model: 32, n_heads: 2, d_mlp: 64, vocab_size: 512, seq_len: 32}"
DEEP = 10_000


def laughs(levels: int = 9, width: int = 10) -> list[str]:
    """The anchors of a 'billion laughs': l0 is `width` strings, each next one `width` aliases of the one before
    (width ** levels strings in all, from under 1 kB)."""
    return [f"&l0 [{', '.join(['lol'] * width)}]"] + [
        f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]


def laughs_list() -> str:
    return "[" + ", ".join(laughs()) + "]"


def laughs_mapping() -> str:
    return "{" + ", ".join(f"l{i}: {text}" for i, text in enumerate(laughs())) + "}"


def deep_flow() -> str:
    return "[" * DEEP + "]" * DEEP


def registry_with(entry: str) -> str:
    """A registry whose one ablation is `entry` (YAML lines at the entry's indentation, 4 spaces)."""
    return f"sizes:\n  tiny: {TINY}\nablations:\n  bomb:\n    doc: d\n    control: null\n{entry}\n"


# name: (file text, words in the one line)
HOSTILE = {
    "laughs in tags": (registry_with(f"    routing: residual\n    tags: {laughs_list()}"), ["billion laughs"]),
    "laughs in router_options": (registry_with(f"    routing: external\n    router: my_pkg.routers:MyRouter\n"
                                               f"    router_options: {laughs_mapping()}"), ["billion laughs"]),
    "10,000 deep, flow": (registry_with(f"    routing: residual\n    tags: {deep_flow()}"), ["nested deeper than 100"]),
    "10,000 deep, block": (registry_with("    routing: residual\n    tags:\n      " + "- " * DEEP + "lol"),
                           ["nested deeper than 100"]),
    "deep through aliases": (registry_with("    routing: residual\n    tags: [&a " + "[" * 60 + "x" + "]" * 60 + ", "
                                           + "[" * 50 + "*a" + "]" * 50 + "]"), ["deeper than 100 levels"]),
    "recursive alias": (registry_with("    routing: residual\n    tags: &t [lol, *t]"), ["recursive"]),
    "5000-digit integer": (f"sizes:\n  tiny:\n    doc: t\n    n_layers: {'1' * 5000}\n", ["5,000 digits"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_loader_refuses_a_hostile_document_in_one_line_at_once(case, tmp_path):
    text, needles = HOSTILE[case]
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    for load in (lambda: load_yaml_strict(text, path), lambda: load_registry(path),
                 lambda: check_yaml_limits(text, path)):
        start = time.perf_counter()
        with pytest.raises(InputError) as err:
            load()
        assert time.perf_counter() - start < 5  # milliseconds in fact; minutes (and GBs) before the limits
        message = str(err.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
        for needle in needles:
            assert needle in message, message


def test_the_limits_are_where_the_constants_say(tmp_path):
    nested = "[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH
    assert load_yaml_strict(nested, "ok.yaml") == yaml.safe_load(nested)
    with pytest.raises(InputError, match=f"nested deeper than {MAX_YAML_DEPTH} levels"):
        load_yaml_strict(f"[{nested}]", "deeper.yaml")
    # aliases standing for MAX_ALIAS_NODES nodes load; one anchor use more does not
    anchor = "[" + ", ".join(["x"] * 99) + "]"  # 100 nodes
    uses = MAX_ALIAS_NODES // 100
    text = f"a: &a {anchor}\nb: [{', '.join(['*a'] * uses)}]\n"
    assert load_yaml_strict(text, "ok.yaml") == yaml.safe_load(text)
    with pytest.raises(InputError, match="billion laughs"):
        load_yaml_strict(f"a: &a {anchor}\nb: [{', '.join(['*a'] * (uses + 1))}]\n", "more.yaml")


def test_anchors_merges_and_the_repos_own_files_load_as_before():
    text = ("base: &base {n_layers: 2, d_model: 32, tags: [a, b]}\n"
            "small:\n  <<: *base\n  d_model: 64\n"
            "both:\n  <<: [*base, {seq_len: 8}]\n"
            "again: [*base, *base]\nlr: 1e-3\nwhen: 2024-01-01\n")
    assert load_yaml_strict(text, "anchors.yaml") == yaml.safe_load(text)
    assert load_yaml_strict(text, "anchors.yaml")["small"] == {"n_layers": 2, "d_model": 64, "tags": ["a", "b"]}
    files = [REPO / "registry.yaml", *sorted((REPO / "experiments").rglob("*.yaml")),
             *sorted((REPO / "lrattn_lightning/eval/task_configs").glob("*.yaml"))]
    assert len(files) > 10
    for path in files:
        text = path.read_text()
        assert load_yaml_strict(text, path) == yaml.safe_load(text), path


# ---- the C path (libyaml): it only ever accepts; what it refuses the Python loader words -------------------
needs_libyaml = pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML built without libyaml")

# what the strict loader refuses besides the limits: a key given twice, a tag that would run code, bad YAML
REFUSED = {
    "duplicate key": "a: 1\nb: 2\na: 3\n",
    "duplicate key in a flow mapping": "x: {k: 1, k: 2}\n",
    "python tag": "!!python/object/apply:os.system ['echo hi']\n",
    "python name tag": "x: !!python/name:os.system\n",
    "unknown tag": "x: !shell 'rm -rf ~'\n",
    "undefined alias": "a: *nowhere\n",
    "tab indentation": "a:\n\t- 1\n",
    "unclosed flow": "a: [1, 2\n",
    "two documents": "a: 1\n---\nb: 2\n",
    "control character": "a: \x01\n",
}


def outcome(load, text: str) -> tuple[str, str]:
    """('ok', repr of the data) or ('refused', the error's type and text): two loaders compared whole."""
    try:
        return "ok", repr(load(text, "doc.yaml"))
    except Exception as err:  # noqa: BLE001 (any refusal, compared by type and words)
        return "refused", f"{type(err).__name__}: {err}"


@needs_libyaml
@pytest.mark.parametrize("case", list(HOSTILE) + list(REFUSED))
def test_the_c_path_refuses_what_the_strict_loader_refuses_with_its_words(case):
    """libyaml never accepts a hostile document (nor a duplicate key, a code tag, invalid YAML), and the one line
    said is the Python loader's, word for word."""
    text = HOSTILE[case][0] if case in HOSTILE else REFUSED[case]
    with pytest.raises(Exception):  # noqa: B017 (any: it only has to refuse)
        files._load_fast(text)
    said = outcome(load_yaml_strict, text)
    assert said[0] == "refused" and said == outcome(files._load_python, text), said


@needs_libyaml
def test_the_c_path_takes_documents_up_to_the_limits_itself(monkeypatch):
    """At the limits (nesting MAX_YAML_DEPTH deep, aliases standing for MAX_ALIAS_NODES nodes) libyaml reads the
    document without the Python loader; one level or one alias more, it refuses."""
    nested = "[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH
    anchor = "[" + ", ".join(["x"] * 99) + "]"
    aliases = f"a: &a {anchor}\nb: [{', '.join(['*a'] * (MAX_ALIAS_NODES // 100))}]\n"
    merges = "base: &b {x: 1, y: [1, 2]}\nc:\n  <<: *b\n  y: 3\n"
    monkeypatch.setattr(files, "_load_python", lambda *a: pytest.fail("the Python loader was used"))
    for text in (nested, aliases, merges, REPO.joinpath("registry.yaml").read_text()):
        assert load_yaml_strict(text, "ok.yaml") == yaml.safe_load(text)
        files.check_yaml_limits(text, "ok.yaml")
    for text in (f"[{nested}]", aliases.replace("*a]", "*a, *a]")):
        with pytest.raises(Exception):  # noqa: B017
            files._load_fast(text)


@needs_libyaml
def test_nesting_far_past_the_c_composers_stack_is_refused_by_the_scan():
    """libyaml's composer recurses in C without a bound: a million levels would overflow its stack (a crash, not
    an error). The scan of its events refuses the document first."""
    for text in ("[" * 1_000_000 + "]" * 1_000_000, "- " * 200_000 + "x\n", "{a: " * 200_000 + "1" + "}" * 200_000):
        start = time.perf_counter()
        with pytest.raises(InputError, match=f"nested deeper than {MAX_YAML_DEPTH} levels"):
            load_yaml_strict(text, "deep.yaml")
        assert time.perf_counter() - start < 10


def yaml_values(leaves=None):
    """Nested YAML-able data (mappings with scalar keys, lists, the scalars YAML resolves)."""
    scalars = leaves or (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
                         | st.sampled_from(["1e-3", "0x1F", "0o17", "yes", "~", "2024-01-01", "<<", "1_000", ".inf",
                                            "12:30:00", "-.5", "+1", "=", "a: b", "- x", "&a", "*a", "!!str"]))
    keys = st.text(max_size=8) | st.integers() | st.booleans()
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=4),
                        max_leaves=20)


@needs_libyaml
@settings(max_examples=300, deadline=None)
@given(data=yaml_values(), flow=st.sampled_from([None, True, False]), unicode=st.booleans(),
       width=st.sampled_from([20, 80, 10_000]), style=st.sampled_from([None, "'", '"', "|"]))
def test_both_loaders_agree_on_generated_documents(data, flow, unicode, width, style):
    """Documents PyYAML writes (every style): both loaders give equal data, or both refuse in the same words."""
    text = yaml.safe_dump(data, default_flow_style=flow, allow_unicode=unicode, width=width, default_style=style)
    assert outcome(load_yaml_strict, text) == outcome(files._load_python, text)


YAMLISH = st.lists(st.sampled_from(["a", "b", "1", "0x1", "-", ": ", ":", ",", "[", "]", "{", "}", "&a ", "*a", "<<",
                                    "!!str ", "!!python/name:os.system ", "!x ", "'", '"', "|", ">", "#", "\n", "  ",
                                    "\t", "? ", "---\n", "...\n", "%YAML 1.1\n", "\u00e9", "\ufeff", "~", "null",
                                    "1e3", "2001-12-14", "\\", "\x85"]), max_size=40).map("".join)


@needs_libyaml
@settings(max_examples=1500, deadline=None)
@given(text=YAMLISH)
def test_both_loaders_agree_on_yaml_shaped_noise(text):
    """Token soup (anchors, aliases, merges, tags, flow and block, documents, odd characters): the same data or
    the same refusal, word for word, with or without libyaml."""
    assert outcome(load_yaml_strict, text) == outcome(files._load_python, text)
    assert outcome(lambda t, w: files.check_yaml_limits(t, w), text) == \
        outcome(lambda t, w: python_check_yaml_limits(t, w), text)


def python_check_yaml_limits(text: str, where: str) -> None:
    """check_yaml_limits without the C path (PyYAML's Python loader only)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files.yaml, "__with_libyaml__", False)
        files.check_yaml_limits(text, where)


# ---- through the real command -----------------------------------------------------------------------------
def lrattn(cwd: Path, *args: str):
    """`lrattn ARGS` in this process from `cwd` (helpers/cli.py); a hang (what these inputs did before the limits)
    fails the test at its timeout (the tests that call this: 120 s)."""
    return in_process(list(args), cwd)


def assert_one_line(done, *needles: str, prefix: str = "lrattn: error: ") -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(prefix), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _fit(*extra: str) -> list[str]:
    return ["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--trainer.max_steps", "2",
            "--trainer.accelerator", "cpu", *extra]


# name: (file name, file text, the command, words in the one line)
HOSTILE_FILES = {
    "registry: laughs in tags": ("reg.yaml", HOSTILE["laughs in tags"][0], ["list", "--registry", "reg.yaml"],
                                 ["reg.yaml:", "billion laughs"]),
    "registry: laughs in router_options": ("reg.yaml", HOSTILE["laughs in router_options"][0],
                                           ["list", "--registry", "reg.yaml"], ["reg.yaml:", "billion laughs"]),
    "registry: 10,000 deep, flow": ("reg.yaml", HOSTILE["10,000 deep, flow"][0],
                                    ["fit", "--size", "tiny", "--ablation", "bomb", "--registry", "reg.yaml"],
                                    ["reg.yaml:", "nested deeper than 100 levels"]),
    "registry: 10,000 deep, block": ("reg.yaml", HOSTILE["10,000 deep, block"][0], ["list", "--registry", "reg.yaml"],
                                     ["reg.yaml:", "nested deeper than 100 levels"]),
    "fit --config: laughs in a value": ("recipe.yaml", f"trainer:\n  max_steps: 2\nrun_tags: {laughs_mapping()}\n",
                                        _fit("--config", "recipe.yaml"), ["recipe.yaml:", "billion laughs"]),
    "fit --config: 10,000 deep": ("recipe.yaml", f"trainer:\n  callbacks: {deep_flow()}\n",
                                  _fit("--config", "recipe.yaml"), ["recipe.yaml:", "nested deeper than 100 levels"]),
    "fit: a 10,000-deep value on the command line": ("unused.yaml", "", _fit("--trainer.callbacks", deep_flow()),
                                                     ["--trainer.callbacks", "nested deeper than 100 levels"]),
    "sweep file: laughs": ("sweep.yaml", f"doc: d\nrecipe: recipe.yaml\nsizes: [tiny]\nablations: [baseline]\n"
                                         f"seeds: {laughs_list()}\n", ["sweep", "sweep.yaml", "--dry-run"],
                           ["sweep.yaml:", "billion laughs"]),
    "sweep file: a 10,000-deep value in a run's args": (
        "sweep.yaml", f"doc: d\nrecipe: recipe.yaml\nsizes: [tiny]\nablations: [baseline]\nseeds: [0]\n"
                      f"args: {{trainer.callbacks: '{deep_flow()}'}}\n", ["sweep", "sweep.yaml", "--dry-run"],
        ["run tiny-baseline-seed0", "trainer.callbacks", "nested deeper than 100 levels"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_lrattn_refuses_a_hostile_file_in_one_line_exit_2(case, tmp_path):
    name, text, args, needles = HOSTILE_FILES[case]
    (tmp_path / name).write_text(text)
    if not (tmp_path / "recipe.yaml").exists():  # the sweep's recipe
        (tmp_path / "recipe.yaml").write_text("trainer:\n  max_steps: 2\n")
    before = set(tmp_path.iterdir())
    assert_one_line(lrattn(tmp_path, *args), *needles)
    assert set(tmp_path.iterdir()) == before  # no runs/, no mlflow.db


@pytest.mark.timeout(120)
def test_a_fit_config_with_anchors_and_merges_parses_as_before(tmp_path):
    (tmp_path / "recipe.yaml").write_text("trainer:\n  <<: &steps {max_steps: 7, log_every_n_steps: 3}\n"
                                          "  val_check_interval: 2\ndata:\n  batch_size: &b 3\n"
                                          "model:\n  warmup_steps: *b\n  lr: 1e-3\n")
    done = lrattn(tmp_path, *_fit("--config", "recipe.yaml", "--print_config"))
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["trainer"]["max_steps"] == 7 and printed["trainer"]["log_every_n_steps"] == 3
    assert printed["data"]["batch_size"] == 3 and printed["model"]["warmup_steps"] == 3
    assert printed["model"]["lr"] == 0.001  # jsonargparse's own reading of 1e-3 (YAML 1.1 says a string)


# ---- the budget of a model read from a file --------------------------------------------------------------------
ABSURD = {"d_model": 10**7, "n_layers": 10**4}


@pytest.mark.timeout(120)
def test_a_registry_size_past_the_budget_is_refused_at_load(tmp_path):
    small = load_registry(REGISTRY)
    assert max(count_params(small.model(s, "baseline")) for s in small.sizes) < MAX_PARAMS  # the shipped sizes fit
    path = tmp_path / "reg.yaml"
    path.write_text(f"sizes:\n  huge: {{doc: h, n_layers: {10**4}, d_model: {10**7}, n_heads: 2, d_mlp: 64, "
                    "vocab_size: 512, seq_len: 32}\n")
    with pytest.raises(InputError) as err:
        load_registry(path)
    assert str(err.value).startswith("sizes.huge: 4e+18 parameters (n_layers 10,000, d_model 10,000,000")
    assert "exceed the budget of 1e+11" in str(err.value)
    assert_one_line(lrattn(tmp_path, "list", "--registry", "reg.yaml"), "sizes.huge", "d_model 10,000,000")
    path.write_text(f"sizes:\n  deep: {{doc: h, n_layers: {MAX_LAYERS + 1}, d_model: 4, n_heads: 2, d_mlp: 4, "
                    "vocab_size: 4, seq_len: 32}\n")
    with pytest.raises(InputError, match=f"n_layers 4,097 exceeds the budget of {MAX_LAYERS:,} layers"):
        load_registry(path)


def _exported(tmp_path: Path) -> Path:
    from helpers.models import make_checkpoint

    from lrattn_lightning.tools.export import export_hf

    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    return export_hf(tmp_path / "last.ckpt", tmp_path / "hf")


def test_an_exported_config_past_the_budget_is_refused_before_building(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _exported(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_config"]["size"].update(ABSURD)
    (folder / "config.json").write_text(json.dumps(config))
    auto = transformers.AutoModelForCausalLM
    loaded = transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    for load in (lambda: auto.from_pretrained(str(folder), trust_remote_code=True),
                 lambda: auto.from_config(loaded, trust_remote_code=True)):
        start = time.perf_counter()
        with pytest.raises(InputError) as err:  # 4e18 parameters: built, it would be an out-of-memory kill
            load()
        assert time.perf_counter() - start < 30
        message = str(err.value)
        assert message.startswith("config.json: model_config.size: 4e+18 parameters (n_layers 10,000, d_model "
                                  "10,000,000") and "\n" not in message, message


@pytest.mark.timeout(120)
def test_a_checkpoint_past_the_budget_is_refused_before_building(tmp_path):
    from helpers.models import make_checkpoint

    make_checkpoint(tmp_path / "last.ckpt", "baseline")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    ckpt["hyper_parameters"]["model_config"]["size"].update(ABSURD)
    torch.save(ckpt, tmp_path / "huge.ckpt")
    line = assert_one_line(lrattn(tmp_path, "export", "--checkpoint", "huge.ckpt", "--out", "hf"),
                           "huge.ckpt", "4e+18 parameters", "d_model 10,000,000", prefix="lrattn export: error: ")
    assert "exceed the budget" in line and not (tmp_path / "hf").exists()
