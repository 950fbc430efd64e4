"""Models built for tests: the test sizes (DEEPER, GRAD) and the registry's entry names, an entry clipped to a size
(tiny_config) or changed (variant), token batches, routing parameters drawn off their zero start (randomize_routing,
randomized), a routing kind's tiny config from its options (parsed as a registry entry, so bad options raise as a
user's would), and a checkpoint in `lrattn fit`'s format without a fit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from helpers.paths import REGISTRY_PATH
from lrattn_lightning.model.config import AblationConfig, ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.decoder import build_decoder
from lrattn_lightning.model.registry import Registry, load_registry, parse_registry

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
