"""Fixtures shared across the test folders, the environment every test process sets up, and the order test modules
start in. Plain helpers (paths, test sizes, model checks, corpora, MLflow servers) are tests/helpers/'s."""

from __future__ import annotations

import copy
import json
import os
import signal
import tempfile
from pathlib import Path

import lightning  # noqa: F401  (its log handler binds sys.stderr at import: not a test's captured, later closed one)
import pytest
import torch
from helpers.paths import PRECIOUS, REGISTRY_PATH, TESTS_DIR
from helpers.prepare import prepared_corpus
from helpers.tracking import empty_store, seed_store

from lrattn_lightning.model.config import SizeConfig
from lrattn_lightning.model.registry import Registry, load_registry

# A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so would every
# process it starts, which keeps SIGINT ignored as `nohup` would: the Ctrl-C tests need it as a terminal gives it
# (the tests of a signal ignored at launch ignore it themselves).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# A suite started under `nohup` inherits SIGHUP ignored, and every `lrattn` it starts would keep it ignored (as a
# user's nohup'd run must): the hangup tests need the default a terminal gives. A handler that does nothing keeps the
# suite itself (and its xdist workers, told by the variable) alive through a hangup, as nohup meant, and is reset to
# the default in every process the tests exec (a handler, unlike SIG_IGN, does not survive exec).
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN or os.environ.get("LRATTN_TESTS_NOHUP"):
    os.environ["LRATTN_TESTS_NOHUP"] = "1"
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

# lm-eval sets this (setdefault) when it is imported, and huggingface_hub reads it when it is imported: set from
# the start, the environment the tests give their commands does not change once a test has imported lm-eval. No
# command here downloads anything.
os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
# hypothesis keeps its example database and constants cache under ./.hypothesis (the checkout) unless told otherwise:
# the suite writes nothing into the checkout (tests/e2e/test_no_stray_writes.py), so they go under the temp folder
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "lrattn-tests-hypothesis"))

# With pytest's default (prepend) import mode this file's folder, tests/, is on sys.path: a test module imports what
# it shares with others from tests/helpers/ (`from helpers.runs import fit_args`, paths from helpers.paths, never its
# own `__file__`), never from another test module or this file (tests/test_layers.py checks it), and the `lrattn`
# processes the tests start get tests/ too (helpers.cli.cli_env: a --config names run_hooks' callbacks).

torch.set_num_threads(1)  # the test machine is small and shared; tiny models gain nothing from threads
# ... and so for every process the tests start (an installed `lrattn`, lm-eval's CLI, scripts, servers): on two shared
# cores a second intra-op thread only spin-waits (helpers.cli.cli_env and the tests' sweep files set it already)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The order test modules start in. With `--dist loadfile` each module runs whole on one worker, so a long module
# started last would run alone at the end: the long ones go first, by a rule rather than a list, so a new slow module
# needs no edit here. Tiers (a module's tier is its lowest test's; collection order within a tier):
#   0  a triton/ folder: the kernels in Triton's one-process CPU interpreter (the longest module of all)
#   1  tests/e2e/: tests whose point is real processes (signals, resilience, FSDP ranks, servers, studies)
#   2  a test marked `slow` (pyproject: multi-process or server tests), in any folder
#   3  tests/tools/ and tests/train/: sweeps, exports, benchmarks and fits run as `lrattn` commands
#   4  the rest (in-process tests of tiny models, data and the CLI)
# A slow module elsewhere joins the front by marking its slow tests `@pytest.mark.slow` (or `pytestmark`).
def start_tier(item) -> int:
    folders = item.path.relative_to(TESTS_DIR).parts[:-1] if item.path.is_relative_to(TESTS_DIR) else ()
    if "triton" in folders:
        return 0
    if folders[:1] == ("e2e",):
        return 1
    if item.get_closest_marker("slow") is not None:
        return 2
    return 3 if folders[:1] in (("tools",), ("train",)) else 4


def pytest_collection_modifyitems(config, items) -> None:
    tier: dict[Path, int] = {}
    for item in items:
        tier[item.path] = min(tier.get(item.path, 4), start_tier(item))
    items.sort(key=lambda item: tier[item.path])  # stable: collection order within a tier


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A small byte-tokenised corpus for CLI runs (60 documents of the bundled stdlib docs), once per module."""
    return prepared_corpus(tmp_path_factory, 60)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """120 documents of the bundled stdlib docs with 20 cloze items and 10 perplexity documents, once per process."""
    return prepared_corpus(tmp_path_factory, 120, cloze_items=20, perplexity_documents=10)


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory) -> Path:
    """corpus.jsonl (about 4 MB: the stdlib docs twice, each copy marked) and tok.json (a BPE of 2000 ids), for
    `lrattn prepare` with helpers.prepare.JSONL_ARGS in a folder linking them."""
    from lrattn_lightning.data.corpora import iter_documents
    from lrattn_lightning.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("interrupted")
    docs = [d.text for d in iter_documents("stdlib-docs")]
    train_bpe(docs[:150], 2000, root / "tok.json")
    with open(root / "corpus.jsonl", "w") as f:
        for k in range(2):
            for i, text in enumerate(docs):
                f.write(json.dumps({"text": f"copy {k} of {i}\n{text}"}) + "\n")
    return root


@pytest.fixture(scope="session")
def store_template(tmp_path_factory) -> Path:
    """An empty sqlite MLflow store, created by MLflow once per process: what `mlflow_store` and seed_store copy."""
    return empty_store(tmp_path_factory.mktemp("empty-store"))


@pytest.fixture(scope="session")
def seeded_folder(tmp_path_factory, store_template: Path):
    """seeded_folder(NAME): a new folder (tmp_path_factory.mktemp(NAME)) holding a copy of store_template as its
    mlflow.db, for a module's fixture whose commands run from there (as `mlflow_store` is for one test)."""

    def make(name: str) -> Path:
        folder = tmp_path_factory.mktemp(name)
        seed_store(folder, store_template)
        return folder

    return make


@pytest.fixture
def mlflow_store(tmp_path: Path, store_template: Path) -> Path:
    """tmp_path holding an empty MLflow store as its mlflow.db (a copy of store_template), so the commands a test
    runs from there log to an existing store instead of each creating one (1-3 s of MLflow's migrations). Opt-in,
    for tests whose point is not the store's creation (not where a test checks that no mlflow.db was written)."""
    seed_store(tmp_path, store_template)
    return tmp_path


@pytest.fixture(scope="session")
def registry() -> Registry:
    return load_registry(REGISTRY_PATH)


@pytest.fixture(scope="session")
def tiny(registry: Registry) -> SizeConfig:
    return registry.size("tiny")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def raw_registry() -> dict:
    """A small, valid registry as a dict; tests mutate a fresh deep copy."""
    return copy.deepcopy(
        {
            "sizes": {
                "t": {"doc": "test size", "n_layers": 2, "d_model": 32, "n_heads": 2, "d_mlp": 64,
                      "vocab_size": 64, "seq_len": 16},
            },
            "ablations": {
                "baseline": {"doc": "residual", "control": None, "routing": "residual"},
                "full": {"doc": "full AttnRes", "control": "baseline", "routing": "attnres"},
                "slr": {"doc": "S-LR", "control": "full", "extends": "full", "key_source": "sliced",
                        "rank": 8, "embedding_key": "sliced"},
                "slr-block": {"doc": "block S-LR", "extends": "slr", "blocks": 2},
            },
        }
    )


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file a link planted where lrattn writes points at: it must keep PRECIOUS."""
    path = tmp_path / "victim"
    path.write_text(PRECIOUS)
    return path
