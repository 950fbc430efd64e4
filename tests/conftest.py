"""Shared fixtures and small independent helpers for the core tests (tiny configs, CPU)."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import lightning  # noqa: F401  (its log handler binds sys.stderr at import: not a test's captured, later closed one)
import numpy as np
import pytest
import torch

from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig, fit_to_size
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

# Where things are, for every test module wherever its folder (tests/ mirrors lrattn_lightning/: tests/model/routing/
# holds the routing kinds' tests, tests/e2e/ the tests whose point is real processes): a test module takes paths from
# here, never from its own `__file__`.
TESTS_DIR = Path(__file__).resolve().parent  # this file, helpers/ and run_hooks.py
REPO_ROOT = TESTS_DIR.parent
GOLDEN_DIR = TESTS_DIR / "golden"
REGISTRY_PATH = REPO_ROOT / "registry.yaml"
# With pytest's default (prepend) import mode this file's folder, tests/, is on sys.path: a test module imports what
# it shares with others from tests/helpers/ (`from helpers.runs import fit_args`), never from another test module
# (tests/test_layers.py checks it), and the `lrattn` processes the tests start get tests/ too (helpers.cli.cli_env:
# a --config names run_hooks' callbacks).

# RMSNorm epsilon of float32 tensors: torch's default finfo(float32).eps, as in the paper's code
EPS = torch.finfo(torch.float32).eps

torch.set_num_threads(1)  # the test machine is small and shared; tiny models gain nothing from threads
# ... and so for every process the tests start (an installed `lrattn`, lm-eval's CLI, scripts, servers): on two shared
# cores a second intra-op thread only spin-waits (helpers.cli.cli_env and the tests' sweep files set it already)
os.environ.setdefault("OMP_NUM_THREADS", "1")

_REGISTRY = load_registry(REGISTRY_PATH)
ALL_ABLATIONS = list(_REGISTRY.ablations)
ATTNRES_ABLATIONS = [n for n, a in _REGISTRY.ablations.items() if a.routing == "attnres"]

# A size with real, uneven blocks: M = 2L = 6 sublayers; e.g. N=4 ends after 2, 3, 5, 6.
DEEPER = SizeConfig(
    name="tiny-l3", doc="tests: three layers", n_layers=3, d_model=32, n_heads=4, d_mlp=48,
    vocab_size=97, seq_len=16,
)
# gradchecks: a float64 gradcheck costs two forward passes per checked number, so the routers' parameters are
# checked whole on a narrow model
GRAD = SizeConfig(name="grad", doc="tests: gradcheck", n_layers=3, d_model=8, n_heads=2, d_mlp=16, vocab_size=31,
                  seq_len=8)


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


def prepared_corpus(tmp_path_factory, documents: int, cloze_items: int = 0, perplexity_documents: int = 0) -> Path:
    """`documents` of the bundled stdlib docs, byte-tokenised into a new folder (10 % held out)."""
    from lrattn_lightning.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib-byte"
    prepare(source="stdlib-docs", out_dir=out, tokenizer="byte", max_documents=documents, val_fraction=0.1,
            cloze_items=cloze_items, perplexity_documents=perplexity_documents)
    return out


def split_ids(out: Path, side: str) -> np.ndarray:
    """The token ids of one split of a `prepare` output, read from the chunk files themselves (litdata's layout:
    a header of chunk_size + 2 uint32, then the uint16 ids)."""
    index = json.loads((out / side / "index.json").read_text())
    parts = [np.fromfile(out / side / c["filename"], dtype=np.uint16)[(c["chunk_size"] + 2) * 2 :]
             for c in index["chunks"]]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def split_documents(out: Path, side: str) -> list[str]:
    """The documents of one split of a byte-tokenised `prepare` output, in order (a document is its UTF-8 bytes,
    then EOS = 256)."""
    stream = split_ids(out, side)
    assert stream.size == 0 or stream[-1] == 256, "a split ends with a document's EOS"
    documents = np.split(stream, np.flatnonzero(stream == 256) + 1)[:-1]
    return [bytes(ids[:-1].astype(np.uint8)).decode("utf-8") for ids in documents]


def read_back(out: Path) -> collections.Counter:
    """The documents in the shards of both splits of a byte-tokenised `prepare` output."""
    return collections.Counter(split_documents(out, "train") + split_documents(out, "val"))


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
def registry() -> Registry:
    return _REGISTRY


@pytest.fixture(scope="session")
def tiny(registry: Registry) -> SizeConfig:
    return registry.size("tiny")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def tiny_config(registry: Registry, name: str, size: str | SizeConfig = "tiny") -> ModelConfig:
    """The registry entry `name` clipped (rank, blocks) so that it builds at `size`."""
    s = registry.size(size) if isinstance(size, str) else size
    return ModelConfig(s, fit_to_size(registry.ablation(name), s))


def variant(ablation: AblationConfig, **changes) -> AblationConfig:
    """A validated copy of an ablation with some fields changed."""
    return ablation.replace(**changes)


def randomize_routing(model: torch.nn.Module, std: float = 0.5) -> None:
    """Give the zero-initialised pseudo-queries (and static keys, the dynamic coefficient tables of
    Hyper-Connections and MUDDFormer, LAuReL's B) random values so routing is not uniform and no routing parameter
    sits where its gradient vanishes."""
    router = model.router
    with torch.no_grad():
        for name, p in router.named_parameters():
            if (name in ("queries", "query_gates", "dynamic_alpha", "dynamic_beta", "up")
                    or name.startswith(("embedding_key_static", "w2."))):  # (w2.i: MUDDFormer's zero-started W2)
                p.normal_(std=std)


def tokens(vocab: int, batch: int = 2, length: int = 8, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


@dataclasses.dataclass
class Trace:
    emb: torch.Tensor  # o_0 [B, T, D]
    inputs: list[torch.Tensor]  # RMSNorm(h_j) fed to sublayer j + 1, j = 0..2L-1
    outputs: list[torch.Tensor]  # o_1 .. o_2L as the sublayers return them ([B, T, D] or [B, T, D + r])
    final: torch.Tensor  # RMSNorm(h_2L) fed to the head
    logits: torch.Tensor
    routing: list[torch.Tensor] | None  # alpha per site j = 1..2L (attnres only)


def capture(model: torch.nn.Module, idx: torch.Tensor) -> Trace:
    """Run the decoder, recording through module hooks only what flows between its named parts."""
    emb, inputs, outputs, final = [], [], [], []
    handles = [model.embed.register_forward_hook(lambda m, a, out: emb.append(out.detach()))]

    def record(module, args, out):
        inputs.append(args[0].detach())
        outputs.append(out.detach())

    for layer in model.layers:
        handles += [layer.attn.register_forward_hook(record), layer.mlp.register_forward_hook(record)]
    handles.append(model.head.register_forward_pre_hook(lambda m, args: final.append(args[0].detach())))
    try:
        out = model(idx, return_routing=True)
    finally:
        for h in handles:
            h.remove()
    return Trace(emb[0], inputs, outputs, final[0], out.logits.detach(), out.routing)


def assert_causal_and_decodes_with_the_kv_cache(model: torch.nn.Module, length: int = 12, at: int = 7) -> None:
    """Changing token `at` moves no logit before it, and greedy decoding with the KV cache gives the tokens of
    full recomputation (a router's own decoding state, or none, is right)."""
    from lrattn_lightning.model.generate import generate

    vocab = model.cfg.size.vocab_size
    idx = tokens(vocab, batch=2, length=length)
    with torch.no_grad():
        full = model(idx)
        changed = idx.clone()
        changed[:, at] = (changed[:, at] + 1) % vocab
        torch.testing.assert_close(model(changed)[:, :at], full[:, :at], rtol=0, atol=0)
    prompt = idx[:, :4]
    assert torch.equal(generate(model, prompt, 10, use_cache=True), generate(model, prompt, 10, use_cache=False))


def assert_router_gradcheck(model: torch.nn.Module, idx: torch.Tensor) -> None:
    """float64 gradcheck of every router parameter through the whole decoder (a loss that weighs all logits)."""
    names = [n for n, _ in model.router.named_parameters()]

    def loss(*params):
        state = {f"router.{n}": p for n, p in zip(names, params, strict=True)}
        logits = torch.func.functional_call(model, state, (idx,))
        return logits.square().mean() + logits[..., :3].sum()

    inputs = tuple(p.detach().clone().requires_grad_() for p in model.router.parameters())
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6)


def assert_bf16_autocast_close(model: torch.nn.Module, idx: torch.Tensor) -> None:
    """Under CPU bf16 autocast the logits stay within 10 % of the float32 ones' largest magnitude."""
    with torch.no_grad():
        exact = model(idx)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(idx).float()
    assert (low - exact).abs().max() < 0.1 * exact.abs().max()


def ref_rms_norm(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dimension, written out; eps defaults to finfo(x.dtype).eps."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_head_rms_norm(x: torch.Tensor, heads: int, eps: float | None = None) -> torch.Tensor:
    shape = x.shape
    return ref_rms_norm(x.reshape(*shape[:-1], heads, shape[-1] // heads), eps).reshape(shape)


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


# the tracking server without MLflow 3's background job runners (huey consumers for GenAI jobs: four more
# processes, each importing MLflow, that tracking never uses) and with one web worker: what the tests need of it
SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real `mlflow server` on a free loopback port (its own process group), up and healthy: (process, uri).
    Stopped (TERM, then KILL) on exit, also when the test has killed it already."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination",
         str(tmp_path / "art")],
        cwd=tmp_path, env=SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline, "mlflow server did not come up"
                assert server.poll() is None, "mlflow server exited"
                time.sleep(0.5)
        yield server, uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=20)


def prepare_in(args: list[str], cwd: Path, capsys) -> tuple[int, list[str]]:
    """`lrattn prepare ARGS` in this process from folder `cwd`: (exit code, stderr's non-empty lines)."""
    from lrattn_lightning.cli import main as lrattn_main

    old = Path.cwd()
    os.chdir(cwd)
    try:
        code = lrattn_main(["prepare", *args])
    finally:
        os.chdir(old)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


PRECIOUS = "precious\n"  # what a planted link's victim holds, before and after


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file a link planted where lrattn writes points at: it must keep PRECIOUS."""
    path = tmp_path / "victim"
    path.write_text(PRECIOUS)
    return path


def sqlite_experiment(folder: Path, name: str):
    """A new sqlite MLflow store in `folder` and an experiment `name` whose artifacts lie beside it (not ./mlruns):
    (tracking URI, client, experiment id)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client, client.create_experiment(name, artifact_location=(folder / "artifacts").as_uri())
