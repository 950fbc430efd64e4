"""Routers from outside the package (routing: external): a user's class named by import path in their registry.

The router lives in a package written to a temporary folder, as a user's would; nothing of ours changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers.tracking import seed_store
from mlflow.tracking import MlflowClient

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model.accounting import added_flops, core_flops, count_params
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import parse_registry
from lrattn_lightning.train.optim import split_parameters

PACKAGE = "user_routers_for_lrattn_tests"
ROUTER_SOURCE = '''
"""A user's depth router: read j = sum_i w[j, i] o_i over the outputs so far (DenseFormer-like)."""
import torch
from torch import nn


class State:
    def __init__(self, emb):
        self.outputs = [emb]


class MixRouter(nn.Module):
    def __init__(self, cfg, scale=1.0):
        super().__init__()
        m = cfg.size.n_sublayers
        self.d, self.scale = cfg.size.d_model, scale
        self.w = nn.Parameter(torch.empty(m + 1, m + 1))  # a 2-D table: Muon would take it by default
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():  # lower-triangular ones: the plain residual stream
            self.w.copy_(torch.tril(torch.ones_like(self.w)) * self.scale)

    def start(self, emb, *, record=False, cache=None, segments=None):
        return State(emb)

    def write(self, state, i, out):
        state.outputs.append(out[..., : self.d])

    def read(self, state, j):
        return sum(self.w[j, i] * o for i, o in enumerate(state.outputs))

    def added_flops_per_token(self):
        m = self.w.shape[0] - 1
        return sum(2 * (j + 1) * self.d for j in range(1, m + 1))

    def adamw_parameter_names(self):
        return ["w"]


class Silent(MixRouter):
    """States neither its FLOPs nor its optimiser split."""
    added_flops_per_token = None
    adamw_parameter_names = None


class MuonTable(MixRouter):
    def adamw_parameter_names(self):
        return []


class EmbeddingKV(MixRouter):
    """The protocol's optional extensions: the attention's keys and values read the embedding, its values halved."""
    def read_attention(self, state, j):
        return self.read(state, j), state.outputs[0], state.outputs[0]

    def mix_values(self, state, layer, v):
        return 0.5 * v


class NoRead(MixRouter):
    """Lacks a required method."""
    read = None
'''


def entry(router: str = f"{PACKAGE}.routers:MixRouter", **fields) -> dict:
    return {"doc": "a user's router", "control": "baseline", "routing": "external", "router": router, **fields}


def registry_dict(**ablations) -> dict:
    return {"sizes": {"tiny": {"doc": "test", "n_layers": 2, "d_model": 32, "n_heads": 2, "d_mlp": 64,
                               "vocab_size": 512, "seq_len": 32}},
            "ablations": {"baseline": {"doc": "the plain residual stream", "control": None}, **ablations}}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The user's package in its own folder, on sys.path for this module's in-process tests."""
    root = tmp_path_factory.mktemp("user")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "routers.py").write_text(textwrap.dedent(ROUTER_SOURCE))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.startswith(PACKAGE)]:
        del sys.modules[name]


def test_the_router_is_built_from_its_import_path_with_its_options(package):
    reg = parse_registry(registry_dict(mix=entry(), half=entry(router_options={"scale": 0.5}),
                                       silent=entry(f"{PACKAGE}.routers:Silent")))
    cfg = reg.model("tiny", "mix")
    model = build_decoder(cfg)
    assert type(model.router).__name__ == "MixRouter" and model.router.scale == 1.0
    assert build_decoder(reg.model("tiny", "half")).router.scale == 0.5
    # accounting: the module's real parameters, the FLOPs it states, unknown when it states none
    real = sum(p.numel() for p in model.parameters())
    assert count_params(cfg) == real == count_params(reg.model("tiny", "baseline")) + 5 * 5
    assert added_flops(cfg) == sum(2 * (j + 1) * 32 for j in range(1, 5)) and core_flops(cfg.size) > 0
    assert added_flops(reg.model("tiny", "silent")) is None
    # identity table: exactly the baseline's logits with the same core weights (non-trivial inputs)
    base = build_decoder(reg.model("tiny", "baseline"))
    model.load_state_dict({**base.state_dict(), "router.w": model.router.w.detach()})
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), base(idx), rtol=1e-6, atol=1e-6)
        model.router.w.mul_(torch.linspace(0.5, 1.5, 25).view(5, 5))  # a learned table changes the logits
        assert (model(idx) - base(idx)).abs().max() > 1e-3


def test_an_own_router_may_use_the_protocols_extensions(package):
    """read_attention and mix_values (router.py) reach an external router's attention as they reach MUDDFormer's."""
    from helpers.references import ref_rms_norm

    from lrattn_lightning.model.attention import AttentionPass
    from lrattn_lightning.model.rope import rope_angles

    reg = parse_registry(registry_dict(kv=entry(f"{PACKAGE}.routers:EmbeddingKV"), mix=entry()))
    model, plain = build_decoder(reg.model("tiny", "kv")).double(), build_decoder(reg.model("tiny", "mix")).double()
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    cos, sin = rope_angles(torch.arange(16), 16, model.cfg.size.rope_theta)
    with torch.no_grad():
        emb, w = model.embed(idx), model.router.w
        outputs = [emb]
        for layer in model.layers:
            read = lambda: sum(w[len(outputs) - 1, i] * o for i, o in enumerate(outputs))  # noqa: E731
            halved = AttentionPass(cos, sin, mix_values=lambda layer, v: 0.5 * v)
            outputs.append(layer.attn(ref_rms_norm(read()), ref_rms_norm(emb), ref_rms_norm(emb), halved, 0))
            outputs.append(layer.mlp(ref_rms_norm(read())))
        written = model.head(ref_rms_norm(sum(w[len(outputs) - 1, i] * o for i, o in enumerate(outputs))))
        torch.testing.assert_close(model(idx), written, rtol=1e-10, atol=1e-10)
        assert (model(idx) - plain(idx)).abs().max() > 1e-3  # the extensions are used, not ignored


def test_a_router_of_the_required_part_only_gets_the_optional_defaults(package):
    """A plain nn.Module class is built as itself plus Router's defaults (router.py): the same name, parameters and
    state-dict keys; new_cache None, one stream read thrice, values unchanged, no recorded weights."""
    from lrattn_lightning.model.routing.external import with_router_defaults
    from lrattn_lightning.model.routing.residual import ResidualRouter
    from lrattn_lightning.model.routing.router import Router

    model = build_decoder(parse_registry(registry_dict(mix=entry())).model("tiny", "mix"))
    router, user_class = model.router, sys.modules[f"{PACKAGE}.routers"].MixRouter
    assert isinstance(router, user_class) and isinstance(router, Router) and type(router).__name__ == "MixRouter"
    assert list(router.state_dict()) == ["w"] and with_router_defaults(user_class) is type(router)
    assert with_router_defaults(ResidualRouter) is ResidualRouter  # a Router already
    emb = torch.randn(2, 3, 32)
    state = router.start(emb, record=True)
    v = torch.randn(2, 3, 2, 16)
    assert router.new_cache() is None and router.mix_values(state, 0, v) is v
    h_q, h_k, h_v = router.read_attention(state, 0)
    assert h_k is h_q and h_v is h_q and torch.equal(h_q, router.read(state, 0))
    assert router.recorded_weights(state) is None  # its State keeps none


def test_the_router_decides_what_adamw_takes(package):
    reg = parse_registry(registry_dict(mix=entry(), silent=entry(f"{PACKAGE}.routers:Silent"),
                                       muon=entry(f"{PACKAGE}.routers:MuonTable")))

    def in_muon(name: str) -> bool:
        model = build_decoder(reg.model("tiny", name))
        return any(p is model.router.w for p in split_parameters(model)[0])

    assert not in_muon("mix")  # named by adamw_parameter_names()
    assert not in_muon("silent")  # says nothing: every router parameter to AdamW
    assert in_muon("muon")  # names none: the usual rule, a matrix goes to Muon


@pytest.mark.parametrize("fields, says", [
    ({"router": "no_such_pkg_xyz.mod:R"}, "field 'router': cannot import module 'no_such_pkg_xyz.mod'"),
    ({"router": f"{PACKAGE}.routers:Nope"}, "'Nope' in module"),
    ({"router": f"{PACKAGE}.routers:State"}, "is a type, not an nn.Module class"),
    ({"router": f"{PACKAGE}.routers:NoRead"}, "routers:NoRead lacks read of the Router protocol"),
    ({"router": "not a path"}, "needs the class as 'package.module:Class'"),
    ({"router_options": {"width": 4}}, "field 'router_options': user_routers_for_lrattn_tests.routers:MixRouter(cfg"),
    ({"router_options": [1]}, "must be a mapping of keyword arguments"),
])
def test_bad_routers_are_one_line(package, fields, says):
    with pytest.raises(InputError) as err:
        reg = parse_registry(registry_dict(bad=entry(**fields)))
        build_decoder(reg.model("tiny", "bad"))
    assert says in str(err.value) and "\n" not in str(err.value) and "ablations.bad" in str(err.value)


def test_router_fields_belong_to_routing_external_only():
    with pytest.raises(InputError, match="field 'router': only routing external names a router class"):
        parse_registry(registry_dict(x={"doc": "d", "control": None, "routing": "attnres",
                                        "router": f"{PACKAGE}.routers:MixRouter"}))
    with pytest.raises(InputError, match="field 'key_source': only AttnRes routing"):
        parse_registry(registry_dict(x=entry(key_source="sliced", rank=8)))


def _env(*paths: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH")}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    return env


def test_fit_validate_eval_generate_export_with_a_users_router(package, tiny_data, tmp_path, monkeypatch,  # noqa: F811
                                                               capsys, store_template):  # noqa: F811
    """`lrattn fit` in a user's folder imports their router from PYTHONPATH; MLflow records its real parameter
    count and stated FLOPs, the checkpoint its import path; validate, eval, generate and export use it."""
    from lrattn_lightning.cli import main

    work = tmp_path / "work"
    work.mkdir()
    seed_store(work, store_template)
    (work / "registry.yaml").write_text(yaml.safe_dump(registry_dict(mix=entry(router_options={"scale": 1.0}))))
    lrattn = [sys.executable, "-m", "lrattn_lightning.cli"]  # real processes: the router comes from PYTHONPATH
    fit = [*lrattn, "fit", "--config", "experiments/cpu-demo.yaml", "--registry", "registry.yaml", "--size", "tiny",
           "--ablation", "mix", "--data.data_dir", str(tiny_data), "--data.batch_size", "4", "--trainer.max_steps", "3",
           "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2", "--model.warmup_steps", "1",
           "--trainer.enable_progress_bar", "false"]
    done = subprocess.run(fit, cwd=work, env=_env(package), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = next(work.rglob("last.ckpt"))
    hp = torch.load(ckpt, weights_only=True)["hyper_parameters"]
    assert hp["model_config"]["ablation"]["router"] == f"{PACKAGE}.routers:MixRouter"
    assert hp["model_config"]["ablation"]["router_options"] == {"scale": 1.0}
    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    reg = parse_registry(registry_dict(mix=entry()))
    cfg = reg.model("tiny", "mix")
    assert run.data.params["routing"] == "external" and run.data.params["router"] == f"{PACKAGE}.routers:MixRouter"
    assert int(run.data.params["params"]) == count_params(cfg) == count_params(reg.model("tiny", "baseline")) + 25
    assert float(run.data.params["added_flops_pct"]) == pytest.approx(100 * added_flops(cfg) / core_flops(cfg.size), rel=1e-5)
    assert "val/loss" in run.data.metrics

    # the rest in this process (the user's package is on sys.path here); the store by flag, not by setting
    # MLFLOW_TRACKING_URI here (lrattn reads the user's variable once, at import: it would steer later tests)
    monkeypatch.chdir(work)
    assert main(["validate", "--ckpt_path", str(ckpt), "--trainer.limit_val_batches", "2",
                 "--trainer.enable_progress_bar", "false", "--tracking_uri", uri]) == 0
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "local", "--limit", "4", "--batch-size", "8",
                 "--accelerator", "cpu"]) == 0  # logs to the checkpoint's training run, in its store
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def ", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(work / "hf")]) == 0
    experiment = client.get_experiment(run.info.experiment_id).name
    capsys.readouterr()
    assert main(["compare", "--experiment", experiment, "--tracking_uri", uri, "--out", str(work / "report"),
                 "--no_summary_run"]) == 0
    table = capsys.readouterr().out
    assert "| **mix** |" in table and f"| {count_params(cfg):,} |" in table, table
    monkeypatch.chdir(tmp_path)
    assert json.loads((work / "hf" / "config.json").read_text())["model_config"]["ablation"]["router"].endswith(":MixRouter")
    run = client.get_run(run.info.run_id)
    assert "validate/val/loss" in run.data.metrics
    assert any(a.path.startswith("eval/") for a in client.list_artifacts(run.info.run_id, "eval"))

    # elsewhere (no registry naming the class) the checkpoint's router is imported only on the user's word
    router = f"{PACKAGE}.routers:MixRouter"
    done = subprocess.run([*lrattn, "generate", "--checkpoint", str(ckpt), "--prompt", "x"], cwd=tmp_path,
                          env=_env(package), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"--trust_router {router}" in done.stderr, done.stderr[-2000:]
    done = subprocess.run([*lrattn, "generate", "--checkpoint", str(ckpt), "--prompt", "x", "--max_new_tokens", "3",
                           "--trust_router", router], cwd=tmp_path, env=_env(package), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("x"), done.stderr[-2000:]
    # where the user's package is missing, loading the checkpoint is one line
    done = subprocess.run([*lrattn, "generate", "--checkpoint", str(ckpt), "--prompt", "x", "--registry",
                           str(work / "registry.yaml")], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stderr[-2000:]
    assert f"cannot import module '{PACKAGE}.routers'" in lines[0] and "PYTHONPATH" in lines[0]


def test_compare_reads_an_unknown_cost_as_off_the_front():
    from lrattn_lightning.tools.compare.table import _flops_pct, pareto_front

    assert _flops_pct("unknown") != _flops_pct("unknown")  # NaN
    assert _flops_pct("1.5") == 1.5 and _flops_pct(None) == 0.0
    assert pareto_front([(0.0, 3.0), (1.0, 2.0)]) == [0, 1]
