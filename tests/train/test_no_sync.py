"""No host-device synchronisation inside a train step (issue 54): forward, loss, backward and the optimiser step of
every registry entry, with AdamW and with Muon, on the meta device, where every read of a tensor's value on the host
(`.item()`, `bool()`, `.tolist()`, `.cpu()`, `nonzero`, a data-dependent shape) raises; on a GPU each would stall
the host until the device catches up. The step's once-a-step finiteness guard (training_step) and the logged values
Lightning reads every log_every_n_steps are outside this contract; benchmarks/gpu-check's profile counts them."""

from __future__ import annotations

import pytest
import torch

from lrattn_lightning.model.config import ModelConfig, fit_to_size
from lrattn_lightning.model.registry import load_registry
from lrattn_lightning.train.lit_module import LRAttnModule
from lrattn_lightning.train.settings import OptimiserSettings, RuntimeSettings

REGISTRY = load_registry()
SIZE = REGISTRY.size("tiny")


def _entries() -> list[str]:
    names = []
    for name in sorted(REGISTRY.ablations):
        try:
            ModelConfig(SIZE, fit_to_size(REGISTRY.ablation(name), SIZE))
        except ValueError:
            continue  # (an entry no tiny model can hold)
        names.append(name)
    return names


ENTRIES = _entries()


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: bool(t), lambda t: t.tolist(), lambda t: t.cpu(),
                                  lambda t: t.nonzero(), lambda t: float(t), lambda t: t[t > 0]],
                         ids=["item", "bool", "tolist", "cpu", "nonzero", "float", "mask-index"])
def test_every_host_read_raises_on_meta(read):
    with pytest.raises((RuntimeError, NotImplementedError)):
        read(torch.ones((), device="meta"))


def test_every_kind_is_covered():
    """Every routing kind the registry has an entry of has one that fits size tiny."""
    kinds = {type(REGISTRY.ablation(name).kind).__name__ for name in ENTRIES}
    assert kinds == {type(REGISTRY.ablation(name).kind).__name__ for name in REGISTRY.ablations}
    assert len(ENTRIES) > 30


# each optimiser and each loss once (the optimiser's step does not see which loss made the gradients)
@pytest.mark.parametrize("optimizer, loss_impl", [("adamw", "chunked"), ("muon_adamw", "logits")])
def test_a_train_step_reads_no_device_value(optimizer, loss_impl):
    failures = {}
    for name in ENTRIES:
        cfg = ModelConfig(SIZE, fit_to_size(REGISTRY.ablation(name), SIZE))
        with torch.device("meta"):
            module = LRAttnModule.from_config(cfg, OptimiserSettings(optimizer=optimizer),
                                              RuntimeSettings(impl="auto", loss_impl=loss_impl))
        batch = torch.zeros(2, 17, dtype=torch.long, device="meta")
        try:
            ce, z = module.model_losses(batch[:, :-1], batch[:, 1:])
            (ce + module.optimiser.z_loss * z).backward()
            opt = module.make_optimizer()
            opt.step()
            opt.zero_grad(set_to_none=True)
        except (RuntimeError, NotImplementedError) as err:
            failures[name] = str(err).splitlines()[0][:160]
    assert failures == {}
