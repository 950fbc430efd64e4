"""Golden numbers from the paper's reference code: the deterministic weights and inputs both sides use,
and the comparison of our decoder against a stored entry.

The golden data (tests/golden/reference.pt, made by tests/golden/make_reference_golden.py from a
checkout of the reference) holds, per registry entry, the reference model's logits, loss and
gradients on fixed inputs. Weights are not stored: they are generated here from each *reference*
parameter name (so they do not depend on our module layout), loaded into the reference model there
and into ours here through `fidelity.from_reference_state_dict`.

Golden size: the `small` size (8 layers: every registry entry's block layout is the one trained at
`small` and `cpu-study`; d = 128 so ranks up to 128 fit) with a 64-token vocabulary and 16 positions.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from lrattn_lightning.model.config import ModelConfig, SizeConfig, fit_to_size
from lrattn_lightning.model.registry import Registry
from lrattn_lightning.tools.fidelity.interface import from_reference_state_dict

SEED = 20261130
BATCH, LENGTH = 2, 16
WEIGHT_STD = 0.02
# routing parameters that start at zero get values far from zero, so routing is far from uniform
ROUTING_STD = {"lrid_queries": 0.2, "attn_residuals": 0.2, "lrid_query_gates": 0.5, "static": 0.5}
PROBE_AT = 4096  # gradients with at least this many elements are stored as two random projections


def golden_size(reg: Registry) -> SizeConfig:
    return dataclasses.replace(reg.size("small"), name="golden", doc="golden data size", vocab_size=64, seq_len=16)


def config(reg: Registry, name: str) -> ModelConfig:
    """Entry `name` at the golden size (ranks above d are clipped to d; the name records it)."""
    size = golden_size(reg)
    return ModelConfig(size, fit_to_size(reg.ablation(name), size))


def _generator(name: str, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED ^ zlib.crc32(name.encode()) ^ salt)


def reference_weights(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights by reference parameter name."""
    out = {}
    for name, shape in shapes.items():
        std = next((v for k, v in ROUTING_STD.items() if k in name), WEIGHT_STD)
        out[name] = torch.randn(shape, generator=_generator(name)) * std
    return out


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets), each [BATCH, LENGTH] int64."""
    g = _generator("inputs")
    tokens = torch.randint(0, 64, (BATCH, LENGTH + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def stores_gradient(name: str, cfg: ModelConfig) -> bool:
    """Which gradients the golden data keeps: every routing parameter, the embedding, the head, and the
    first and last layers' matrices (the gradient of every other layer flows through these)."""
    last = cfg.size.n_layers - 1
    return name.startswith(("router.", "embed.", "head.", "layers.0.", f"layers.{last}."))


def gradient_record(name: str, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """A gradient as stored: in full, or (G u, G^T v) for fixed random u, v when it is large."""
    grad = grad.detach().float()
    if grad.numel() < PROBE_AT or grad.dim() != 2:
        return {"full": grad.clone()}
    g = _generator(name, salt=1)
    u, v = torch.randn(grad.shape[1], generator=g), torch.randn(grad.shape[0], generator=g)
    return {"u": grad @ u, "v": grad.t() @ v}


def compare(cfg: ModelConfig, entry: dict[str, Any], data: dict[str, Any], *, impl: str = "auto",
            dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Our decoder with the entry's weights against its golden numbers: max |Δlogit|, the worst relative
    gradient error (max |Δ| / max |g| per stored gradient) and |Δloss|."""
    from lrattn_lightning.model.decoder import build_decoder

    weights = reference_weights(entry["reference_shapes"])
    check = sum(float(w.double().sum()) for w in weights.values())
    if abs(check - entry["weights_sum"]) > 1e-6 * max(1.0, abs(entry["weights_sum"])):
        raise RuntimeError("the golden weights no longer regenerate (torch's generator changed?); "
                           "remake tests/golden/reference.pt as tests/golden/README.md says")
    model = build_decoder(cfg, impl=impl)
    model.load_state_dict(from_reference_state_dict(weights, cfg), strict=True)
    model.to(dtype)
    idx, targets = inputs()
    logits = model(idx)
    loss = loss_of(logits, targets)
    loss.backward()
    params = dict(model.named_parameters())
    dgrad = 0.0
    for name, record in entry["grads"].items():
        mine = gradient_record(name, params[name].grad)
        for part, ref in record.items():
            scale = float(ref.abs().max()) or 1.0
            dgrad = max(dgrad, float((mine[part] - ref).abs().max()) / scale)
    return {
        "dlogit": float((logits.detach().float() - entry["logits"]).abs().max()),
        "dgrad": dgrad,
        "dloss": abs(float(loss.detach()) - entry["loss"]),
    }


def load(path: str) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


# ---- the golden loss file (torchtitan's habit): a short fixed run any refactor must reproduce --------

LOSS_ENTRIES = ("baseline", "attnres-block-n8", "s-lr-full-r16", "p-lr-block-n8-r32")


def train_losses(cfg: ModelConfig, *, steps: int = 20, impl: str = "auto") -> list[float]:
    """Losses of `steps` AdamW steps (CE + 1e-5 z-loss, clip 1.0) on fixed patterned tokens.

    Weights are drawn per parameter *name* (queries and gates zero, as at init), so a refactor that
    keeps the names and the math reproduces the losses whatever order it builds modules in.
    """
    from lrattn_lightning.model.decoder import build_decoder

    model = build_decoder(cfg, impl=impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            zero = name.endswith(("queries", "query_gates"))
            p.copy_(torch.zeros_like(p) if zero else torch.randn(p.shape, generator=_generator(name)) * WEIGHT_STD)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = _generator("train-data")
    B, T, V = 4, 24, min(64, cfg.size.vocab_size)
    start = torch.randint(0, V, (steps, B, 1), generator=g)
    noise = torch.rand(steps, B, T + 1, generator=g) < 0.2
    random = torch.randint(0, V, (steps, B, T + 1), generator=g)
    seq = torch.empty(steps, B, T + 1, dtype=torch.long)
    seq[..., :1] = start
    for t in range(1, T + 1):  # mostly x_{t+1} = 7 x_t + 3 mod V: something to learn in 20 steps
        seq[..., t] = torch.where(noise[..., t], random[..., t], (7 * seq[..., t - 1] + 3) % V)
    losses = []
    for step in range(steps):
        logits = model(seq[step, :, :-1]).float()
        ce = F.cross_entropy(logits.flatten(0, 1), seq[step, :, 1:].flatten())
        loss = ce + 1e-5 * torch.logsumexp(logits, dim=-1).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses
