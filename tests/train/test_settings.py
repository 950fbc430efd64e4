"""(size, ablation) resolved once: `lrattn fit|validate` read the registry once and hand LRAttnModule the ModelConfig
with its provenance; given them the module reads no registry and runs no git. The settings are typed groups
(train/settings.py) under the flat names of before: every flag parses, every hyper-parameter key is written, and a
checkpoint whose hyper_parameters are as the code before the groups wrote them validates and resumes.
"""

from __future__ import annotations

import inspect
import subprocess

import pytest
import torch

from lrattn_lightning.cli import main
from lrattn_lightning.core.errors import InputError
from lrattn_lightning.model import registry as registry_module
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.train import controls, settings
from lrattn_lightning.train.lit_module import LRAttnModule
from lrattn_lightning.train.settings import OptimiserSettings, Provenance, RuntimeSettings

# LRAttnModule's flags and hyper-parameter keys before the settings became groups (the 0.1.0 checkpoints' keys)
FLAT_SETTINGS = {
    "optimizer": "adamw", "lr": 0.002, "weight_decay": 0.01, "betas": [0.8, 0.9], "muon_lr": 0.003,
    "muon_weight_decay": 0.2, "muon_variant": "torch", "muon_dtype": "float32", "muon_momentum": 0.9,
    "muon_momentum_min": 0.8, "muon_momentum_warmup_steps": 3, "muon_momentum_cooldown_steps": 2, "warmup_steps": 1,
    "decay_fraction": 0.3, "final_lr_fraction": 0.2, "allow_schedule_change": True, "schedule_steps": 7,
    "z_loss": 0.001, "compile": True, "impl": "reference", "document_masking": True, "attention": "flex",
    "routing_diagnostics": False, "gate_freeze_steps": 4, "gate_release_loss": 2.5, "gate_grad_normalize": True,
    "doc_separator": 3, "loss_impl": "chunked",
}
NAMED = ("size", "ablation", "registry", "model_config", "registry_sha256", "git_commit")


@pytest.fixture
def no_git(monkeypatch):
    """Any subprocess (git) is a failure that current_git_commit does not swallow."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"ran {args[0] if args else kwargs.get('args')}")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_a_module_given_its_model_config_reads_no_registry_and_runs_no_git(registry, tmp_path, no_git):
    cfg = registry.model("tiny", "gated-residual")
    absent = tmp_path / "absent.yaml"  # read, it would raise FileNotFoundError
    module = LRAttnModule(model_config=cfg.to_dict(), registry=str(absent), registry_sha256="abc", git_commit="c0ffee",
                          gate_freeze_steps=2, lr=1e-3)
    assert module.cfg == cfg and module.resolved_from is None
    assert (module.hparams.git_commit, module.hparams.registry_sha256, module.hparams.size) == ("c0ffee", "abc", "tiny")
    assert module.optimiser.lr == module.hparams.lr == 1e-3 and module.routing_control.freeze_steps == 2
    built = LRAttnModule.from_config(cfg, OptimiserSettings(optimizer="adamw", lr=2e-3), RuntimeSettings(impl="reference"),
                                     {"gate_release_loss": 3.0}, Provenance.of(cfg, "abc", "c0ffee"))
    assert built.cfg == cfg and built.hparams.impl == "reference" and built.hparams.optimizer == "adamw"
    assert built.routing_control.release_loss == 3.0 and built.hparams.git_commit == "c0ffee"
    assert built.hparams.model_config == cfg.to_dict()
    with pytest.raises(AssertionError, match="git"):  # by names, from_names resolves them (and asks git)
        LRAttnModule.from_names(size="tiny", ablation="baseline")


def test_a_resolved_config_is_taken_as_is_and_names_resolve_in_from_names(registry, no_git):
    """from_config keeps the validated ModelConfig itself (no round trip through a dict); the constructor resolves
    no names (one line naming from_names); checkpoints still hold the config as plain values."""
    cfg = registry.model("tiny", "s-lr-grid-n4-r16")
    module = LRAttnModule.from_config(cfg)
    assert module.cfg is cfg and module.hparams.model_config == cfg.to_dict() and module.hparams.size == "tiny"
    with pytest.raises(InputError, match=r"LRAttnModule.from_names\('tiny', 'baseline'\)"):
        LRAttnModule(size="tiny", ablation="baseline")


def test_the_settings_keep_their_flat_names(registry):
    """Every flag of before is a setting of one group with its old default; hparams hold every key of before."""
    module = LRAttnModule.from_config(registry.model("tiny", "baseline"))
    assert set(module.hparams) == set(FLAT_SETTINGS) | set(NAMED)
    assert set(settings.FLAGS) == set(FLAT_SETTINGS)
    chosen = settings.module_settings(**FLAT_SETTINGS)
    assert chosen.flat() == FLAT_SETTINGS  # each value reaches its group and back under its name
    assert chosen.optimiser.betas == [0.8, 0.9] and chosen.runtime.doc_separator == 3
    assert chosen.routing == {"gate_freeze_steps": 4, "gate_release_loss": 2.5, "gate_grad_normalize": True}
    with pytest.raises(ValueError, match=r"^model\.muon_lrr: unknown setting; closest: muon_lr"):
        settings.module_settings(muon_lrr=1.0)


def test_every_flag_of_before_still_parses():
    """`lrattn fit`'s parser takes each --model.NAME of before, with the value it meant."""
    from lrattn_lightning.cli.sweep import fit_parser

    parser = fit_parser()
    flags = {o[len("--model."):] for a in parser._actions for o in a.option_strings if o.startswith("--model.")}
    assert flags == set(FLAT_SETTINGS)  # (size, ablation, registry and provenance: links, not flags)
    argv = ["--size", "tiny", "--ablation", "gated-residual"]
    for name, value in FLAT_SETTINGS.items():
        argv += [f"--model.{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    model = parser.parse_args(argv).model
    for name, value in FLAT_SETTINGS.items():
        assert model[name] == (tuple(value) if name == "betas" else value), name


def test_a_kinds_training_control_declares_its_flags_by_its_class(monkeypatch, registry, tiny):
    """A control's keyword parameters become module flags with their types and defaults (train/controls.py), and
    control_for builds it for its kind: the module names no kind."""
    class Warmup:
        def __init__(self, router, warm_steps: int = 5, warm_loss: float | None = None):
            self.router, self.steps, self.loss = router, warm_steps, warm_loss

    monkeypatch.setitem(controls.CONTROLS, "denseformer", Warmup)
    found = controls.parameters()
    assert {k: (p.annotation, p.default) for k, p in found.items() if k.startswith("warm")} == {
        "warm_steps": (int, 5), "warm_loss": (float | None, None)}
    assert found["gate_freeze_steps"].default == 0  # the gated residual's, from GateHold
    cfg = ModelConfig(tiny, registry.ablation("denseformer"))
    control = controls.control_for(cfg, "router", {"warm_steps": 2, "warm_loss": None, "gate_freeze_steps": 0})
    assert isinstance(control, Warmup) and control.steps == 2 and control.router == "router"
    assert controls.control_for(ModelConfig(tiny, registry.ablation("baseline")), "router", {}) is None
    sig = inspect.signature(settings.module_settings)  # what LightningCLI makes flags of
    assert [p.name for p in sig.parameters.values()] == list(settings.FLAGS)


def _counting(monkeypatch) -> dict[str, int]:
    """Counts registry reads (every load_registry parses) and `git rev-parse` runs."""
    counts = {"registry": 0, "git": 0}
    parse, run = registry_module.parse_registry, subprocess.run

    def parse_counted(*args, **kwargs):
        counts["registry"] += 1
        return parse(*args, **kwargs)

    def run_counted(cmd, *args, **kwargs):
        counts["git"] += isinstance(cmd, list) and cmd[:2] == ["git", "rev-parse"]
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(registry_module, "parse_registry", parse_counted)
    monkeypatch.setattr(subprocess, "run", run_counted)
    return counts


def test_fit_and_validate_read_the_registry_once_and_old_checkpoints_still_load(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    common = ["--size", "tiny", "--ablation", "gated-residual", "--data.data_dir", str(data), "--data.batch_size", "4",
              "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
              "--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    fit = [*common, "--trainer.val_check_interval", "2", "--model.warmup_steps", "1", "--model.gate_freeze_steps", "1",
           "--model.schedule_steps", "2"]
    counts = _counting(monkeypatch)
    assert main(["fit", *fit, "--trainer.max_steps", "2"]) == 0
    assert counts == {"registry": 1, "git": 1}
    path = tmp_path / "runs/lrattn/tiny-gated-residual-seed0/checkpoints/last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    stored = ckpt["hyper_parameters"]
    reg = registry_module.load_registry()
    assert stored["model_config"] == reg.model("tiny", "gated-residual").to_dict()
    assert stored["registry_sha256"] == reg.sha256 and stored["gate_freeze_steps"] == 1
    # the hyper_parameters as the code before the groups wrote them: every setting flat, in its order
    before = {**dict.fromkeys(FLAT_SETTINGS), **{k: stored[k] for k in FLAT_SETTINGS}, "betas": list(stored["betas"]),
              "size": "tiny", "ablation": "gated-residual", "registry": None, "model_config": stored["model_config"],
              "registry_sha256": stored["registry_sha256"], "git_commit": "0" * 40,
              "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    old = tmp_path / "before.ckpt"
    torch.save({**ckpt, "hyper_parameters": before}, old)
    counts.update(registry=0, git=0)
    assert main(["validate", *common, "--ckpt_path", str(old)]) == 0
    assert counts == {"registry": 1, "git": 1}
    assert main(["fit", *fit, "--trainer.max_steps", "3", "--ckpt_path", str(old)]) == 0  # resumed to step 3
    assert torch.load(path, weights_only=True)["global_step"] == 3
    loaded = LRAttnModule.load_from_checkpoint(old, map_location="cpu")  # Lightning's way (docs/cpu-study.md)
    assert loaded.cfg.ablation.name == "gated-residual" and loaded.routing_control.freeze_steps == 1
