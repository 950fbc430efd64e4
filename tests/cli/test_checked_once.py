"""Issue 56, one value one home: `lrattn fit` checks its architecture's budget once. The registry checks each size
as it loads, `Registry.model` the (size, ablation) pair; the module then takes that ModelConfig itself (LightningCLI
hands it the config's dict: lit_module.building_from), where it read the dict back and checked both again. A
checkpoint's model_config is plain values from outside: loading one still checks it, every time.

The count is of the real function on the real command (`lrattn_lightning.cli.main` in this process), wrapped only to
count its calls."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers.paths import REGISTRY_PATH

from lrattn_lightning.model import registry as registry_module
from lrattn_lightning.model.config import ModelConfig

REGISTRY = REGISTRY_PATH
ABLATION = "s-lr-grid-n4-r16"  # AttnRes with routing parameters: the pair's budget counts them


@pytest.fixture
def budget_checks(monkeypatch):
    """Every call of check_budget (registry.py's, the only caller) as (what it checked, where)."""
    calls: list[tuple[str, str]] = []
    real = registry_module.check_budget

    def counted(cfg, where):
        calls.append(("pair" if isinstance(cfg, ModelConfig) else f"size {cfg.name}", where))
        return real(cfg, where)

    monkeypatch.setattr(registry_module, "check_budget", counted)
    return calls


def test_a_fit_checks_its_budget_once_and_a_checkpoint_load_checks_it_again(data, tmp_path, monkeypatch,
                                                                            budget_checks):
    from lrattn_lightning.cli import main
    from lrattn_lightning.train.checkpoint.load import load_checkpoint
    from lrattn_lightning.train.lit_module import LRAttnModule

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = ["fit", "--size", "tiny", "--ablation", ABLATION, "--registry", str(REGISTRY), "--data.data_dir", str(data),
            "--data.batch_size", "2", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--model.warmup_steps", "1", "--checkpoint_every", "2"]
    sizes = registry_module.load_registry(REGISTRY).sizes
    budget_checks.clear()
    assert main(args) == 0
    counts = collections.Counter(what for what, _ in budget_checks)
    # the fit: each registry size once as the registry loads, and the pair once, in Registry.model (before: the
    # module's reading of the config's dict checked size tiny and the pair a second time)
    assert [w for what, w in budget_checks if what == "pair"] == [f"ablations.{ABLATION} at size tiny"], budget_checks
    assert counts == {"pair": 1, **{f"size {name}": 1 for name in sizes}}, counts
    assert all(where == f"sizes.{what.removeprefix('size ')}" for what, where in budget_checks if what != "pair")

    ckpt = next((tmp_path / "runs").rglob("last.ckpt"))
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["model_config"]
    for load in (lambda: LRAttnModule.load_from_checkpoint(ckpt, map_location="cpu").cfg,
                 lambda: load_checkpoint(ckpt).cfg):
        budget_checks.clear()
        cfg = load()  # a checkpoint's model_config comes from outside: read and checked, its size and the pair
        assert [what for what, _ in budget_checks] == ["size tiny", "pair"], budget_checks
        assert cfg.to_dict() == stored
