"""Models built for tests: a routing kind's tiny config from its options (parsed as a registry entry, so bad options
raise as a user's would), a model whose router parameters are drawn off their start, and a checkpoint in `lrattn
fit`'s format without a fit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from conftest import DEEPER, randomize_routing

from lrattn_lightning.model.config import ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import Registry, load_registry, parse_registry


def kind_config(routing: str, size: SizeConfig = DEEPER, **options) -> ModelConfig:
    """The model of routing kind `routing` with `options` at `size`: a one-entry registry parsed strictly."""
    raw = {"sizes": {}, "ablations": {"x": {"doc": "tests", "control": None, "routing": routing, **options}}}
    return ModelConfig(size, parse_registry(raw).ablation("x"))


def randomized(cfg: ModelConfig, draw: Callable[[str, torch.Tensor], torch.Tensor], seed: int = 0,
               float64: bool = True) -> torch.nn.Module:
    """The model of `cfg` built after torch.manual_seed(seed), in float64 unless told, in eval mode, each router
    parameter then replaced by draw(name, parameter) (the same generator, in the parameters' order)."""
    torch.manual_seed(seed)
    model = build_decoder(cfg)
    model = (model.double() if float64 else model).eval()
    with torch.no_grad():
        for name, p in model.router.named_parameters():
            p.copy_(draw(name, p))
    return model


@functools.cache
def _registry() -> Registry:
    return load_registry()


def make_checkpoint(path: Path, name: str, *, seq_len: int = 64, doc_separator: int | None = None) -> torch.nn.Module:
    """A checkpoint in `lrattn fit`'s format (model_config, state_dict under model.*, tokenizer spec) of the tiny
    model of registry entry `name` at `seq_len` (AttnRes routing randomised): the model, in eval mode."""
    size = dataclasses.replace(_registry().size("tiny"), seq_len=seq_len, name=f"tiny-{seq_len}")
    cfg = ModelConfig(size, fit_to_size(_registry().ablation(name), size))
    model = build_decoder(cfg)
    if cfg.ablation.routing == "attnres":
        randomize_routing(model)
    torch.save({"hyper_parameters": {"model_config": cfg.to_dict(), "document_masking": doc_separator is not None,
                                     "doc_separator": doc_separator},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "tokenizer": {"kind": "byte"}, "global_step": 7}, path)
    model.doc_separator = doc_separator
    return model.eval()
