"""`lrattn fit --init_from CKPT`: a new run starts from another run's weights wherever names and shapes match."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.runs import slr_fit_args
from helpers.tracking import seed_store
from mlflow.tracking import MlflowClient

from lrattn_lightning.cli import main


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}


@pytest.fixture(scope="module")
def baseline(tiny_data, tmp_path_factory, store_template):  # noqa: F811
    """A baseline fit of 2 steps, its folder and checkpoint."""
    root = tmp_path_factory.mktemp("upcycle")
    seed_store(root, store_template)
    with pytest.MonkeyPatch.context() as mp:  # (module scope: monkeypatch itself is per test)
        mp.chdir(root)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        assert main(slr_fit_args(tiny_data, "--run_name", "base", ablation="baseline", steps=2)) == 0
    return root, next((root / "runs").rglob("base/checkpoints/last.ckpt"))


def test_an_attnres_run_starts_from_a_baselines_core(baseline, tiny_data, monkeypatch, capsys):  # noqa: F811
    """The core and embeddings come from the baseline (checked with learning rates 0, so the fit keeps them
    exactly), the routing parameters are new; what was loaded and what is new is printed and in MLflow."""
    root, ckpt = baseline
    monkeypatch.chdir(root)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    capsys.readouterr()
    args = slr_fit_args(tiny_data, "--run_name", "up", "--init_from", str(ckpt), "--model.lr", "0", "--model.muon_lr", "0",
                        ablation="attnres-block-n4", steps=2)
    assert main(args) == 0
    out = capsys.readouterr().out
    source = _weights(ckpt)
    assert f"[lrattn fit] --init_from {ckpt} (step 2, tiny/baseline): loaded {len(source)} tensors" in out, out
    assert "[lrattn fit] new (this run's initialisation): router.queries" in out, out
    up = _weights(next((root / "runs").rglob("up/checkpoints/last.ckpt")))
    assert set(up) - set(source) == {"router.queries"}
    for name, tensor in source.items():
        torch.testing.assert_close(up[name], tensor, rtol=0, atol=0)
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (run,) = [r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
              if r.info.run_name == "up"]
    params = run.data.params
    assert params["init_from"] == str(ckpt.resolve()) and params["init_from_step"] == "2"
    assert params["init_from_source"] == "tiny/baseline" and params["init_from_new_tensors"] == "1"
    base_run = [r for r in client.search_runs([run.info.experiment_id]) if r.info.run_name == "base"][0]
    assert params["init_from_run"] == base_run.info.run_id
    # a fresh optimiser and schedule: no optimiser state or step comes along
    raw = torch.load(next((root / "runs").rglob("up/checkpoints/last.ckpt")), weights_only=True)
    assert raw["global_step"] == 2


@pytest.mark.parametrize("ablation, says", [
    ("p-lr-full-r16", "tensor 'layers.0.attn.proj.weight' is [32, 32] in tiny/baseline and [48, 32] in tiny/p-lr-full-r16"),
])
def test_a_shape_conflict_is_one_line_before_any_work(baseline, tiny_data, tmp_path, monkeypatch, capsys, ablation,  # noqa: F811
                                                      says):
    _, ckpt = baseline
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(slr_fit_args(tiny_data, "--init_from", str(ckpt), ablation=ablation, steps=2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lrattn: error: --init_from ") and says in err[-1], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_missing_source_is_one_line(tiny_data, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(slr_fit_args(tiny_data, "--init_from", "nowhere.ckpt", steps=2)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "lrattn: error: --init_from: checkpoint nowhere.ckpt: no such file"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ablation", ["denseformer", "delta-attnres-null", "delta-attnres-block", "mhc-n4",
                                      "frac-connections-m2", "muddformer-ppn", "value-residual-learned", "laurel",
                                      "attnres-block-size4-rms", "mhar-h4"])
@pytest.mark.usefixtures("mlflow_store")
def test_the_compared_methods_train_and_upcycle_from_a_baseline(baseline, tiny_data, tmp_path, monkeypatch,  # noqa: F811
                                                               capsys, ablation):
    """Each compared method fits through the CLI from a baseline's weights; MLflow records its kind, options and
    real parameter count; its checkpoint evaluates."""
    from lrattn_lightning.model.accounting import count_params
    from lrattn_lightning.model.registry import load_registry

    _, ckpt = baseline
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(slr_fit_args(tiny_data, "--init_from", str(ckpt), ablation=ablation, steps=2)) == 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    cfg = load_registry().model("tiny", ablation)
    assert run.data.params["routing"] == cfg.ablation.routing
    assert int(run.data.params["params"]) == count_params(cfg)
    for option, value in cfg.ablation.options.as_dict().items():
        assert run.data.params[option] == ("null" if value is None else str(value))  # (as flat_run_params logs it)
    assert "val/loss" in run.data.metrics and run.data.metrics["val/loss"] == run.data.metrics["val/loss"]
    capsys.readouterr()
    last = next(tmp_path.rglob("last.ckpt"))
    assert main(["generate", "--checkpoint", str(last), "--prompt", "def ", "--max_new_tokens", "4"]) == 0
