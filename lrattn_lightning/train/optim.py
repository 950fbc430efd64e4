"""The paper's optimiser split and training schedule (docs/method.md §5).

Muon for the >= 2-D hidden matrices (attention, MLP, key projections, gates); AdamW for the embedding,
the LM head, the pseudo-queries and every 1-D parameter (the reference's split). Both are param groups
of one real `torch.optim.Optimizer`, `MuonWithAuxAdamW` (group key `use_muon`), so its `state_dict` and
`load_state_dict` are torch's own and a scheduler or LR monitor always acts on the live groups.

The Muon update itself (lrattn_lightning/train/muon.py) comes in two variants:

| variant     | orthogonaliser            | neuron-wise 2nd moment | scale                  | weight decay     |
|-------------|---------------------------|------------------------|------------------------|------------------|
| `reference` | Polar Express, 5 quintics | beta2 0.95, norm kept  | sqrt(max(1, m/n))      | cautious         |
| `torch`     | Newton-Schulz quintic     | none                   | 0.2 sqrt(max(m, n))    | decoupled        |

`reference` is the paper's code (jon123boss/LR-AttnRes); `torch` is torch.optim.Muon with
adjust_lr_fn="match_rms_adamw". Cautious decay shrinks a weight only where the update has its sign:
W <- W - lr * lambda * [O * W >= 0] * W. Plain decoupled decay: W <- (1 - lr * lambda) W.

Muon's step orthogonalises a group's same-shape matrices (8 layers' q/k/v, o, fc1, fc2: four shapes) as one batch
(B, m, n) per shape, at most MAX_BATCH_ELEMENTS elements a call; each matrix keeps its own momentum buffer and
second moment, and its O equals the one-matrix call's to rounding (`max_batch_elements=1`: one matrix a call).
The orthogonalisers run in `orthogonalizer_dtype` (bfloat16: the reference's rounding; float32), which `auto`
resolves per device when the optimiser is built (muon.py resolve_muon_dtype).

Under FSDP2 (`--trainer.strategy fsdp`) parameters, gradients and optimiser state are sharded by rows
(DTensors): AdamW updates each rank's rows; Muon gathers each matrix's momentum direction whole (in the
orthogonaliser's dtype, so exactly what one process orthogonalises: bfloat16 moves half the bytes of float32),
every rank orthogonalises it and keeps its own rows of O; the neuron-wise second moment is kept whole on every
rank. One process and FSDP agree to rounding (tests/e2e/test_fsdp.py).

The learning-rate and momentum schedule that drives both groups: train/schedule.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

import torch
from torch import nn

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.train.muon import (
    DTYPES,
    MuonDtype,
    Orthogonalizer,
    UpdateScale,
    momentum_direction,
    normalize_neurons,
    orthogonalize,
    resolve_muon_dtype,
    update_scale,
    variance_shape,
)

MuonVariant = Literal["reference", "torch"]
MUON_VARIANTS: dict[str, dict[str, Any]] = {
    "reference": {"orthogonalizer": "polar_express", "scale": "original", "variance_beta2": 0.95, "cautious": True},
    "torch": {"orthogonalizer": "newton_schulz", "scale": "match_rms_adamw", "variance_beta2": None, "cautious": False},
}
# orthogonalizer_dtype: the reference's bfloat16 for an optimiser built directly; LRAttnModule passes its muon_dtype
MUON_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "orthogonalizer_dtype": "bfloat16",
                 **MUON_VARIANTS["reference"]}
# what a resumed run must share with its checkpoint's Muon group (torch would restore the saved values silently);
# a checkpoint from before orthogonalizer_dtype ran bfloat16
MUON_RESUME_KEYS = {**{key: None for key in MUON_VARIANTS["reference"]}, "orthogonalizer_dtype": "bfloat16"}
# one batched orthogonalisation holds at most this many elements (B m n): 256 MB in float32, which bounds its
# temporaries (and, under FSDP, the whole matrices gathered at once) at any model size
MAX_BATCH_ELEMENTS = 1 << 26
ADAMW_DEFAULTS = {"lr": 3e-4, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8}
# 2-D parameters that stay with AdamW: the token embedding and the LM head (matched as whole name components,
# also under a wrapper's prefix such as `_orig_mod.`), and what the routing kind says of its router's.
ADAMW_ONLY = (".embed.", ".head.")


def _router_adamw(model: nn.Module) -> set[int]:
    """ids of the router parameters AdamW takes: what each decoder's routing kind says of its router
    (AttnRes: the pseudo-queries and query gates; an external router: its own word, or all of them)."""
    ids: set[int] = set()
    for module in model.modules():
        cfg, router = getattr(module, "cfg", None), getattr(module, "router", None)
        if router is None or not hasattr(cfg, "kind"):
            continue
        names = cfg.kind.adamw_names(router)
        ids |= {id(p) for n, p in router.named_parameters() if names is None or n in names}
    return ids


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(muon, adamw) parameter lists."""
    muon, adamw = [], []
    routing = _router_adamw(model)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2 and id(p) not in routing and not any(tag in f".{name}" for tag in ADAMW_ONLY):
            muon.append(p)
        else:
            adamw.append(p)
    return muon, adamw


def _check_group(i: int, group: dict) -> None:
    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"param group {i} ({group.get('name', '?')}): {field}: {why}")

    if not 0.0 <= group["lr"]:
        raise bad("lr", f"{group['lr']} must be >= 0")
    if not 0.0 <= group["weight_decay"]:
        raise bad("weight_decay", f"{group['weight_decay']} must be >= 0")
    if not group["use_muon"]:
        if not all(0.0 <= b < 1.0 for b in group["betas"]):
            raise bad("betas", f"{tuple(group['betas'])} must lie in [0, 1)")
        return
    if not 0.0 <= group["momentum"] < 1.0:
        raise bad("momentum", f"{group['momentum']} must lie in [0, 1)")
    if group["orthogonalizer"] not in get_args(Orthogonalizer):
        raise bad("orthogonalizer", f"'{group['orthogonalizer']}' is not one of {', '.join(get_args(Orthogonalizer))}")
    if group["orthogonalizer_dtype"] not in DTYPES:
        raise bad("orthogonalizer_dtype", f"'{group['orthogonalizer_dtype']}' is not one of {', '.join(get_args(MuonDtype))}")
    if group["scale"] not in get_args(UpdateScale):
        raise bad("scale", f"'{group['scale']}' is not one of {', '.join(get_args(UpdateScale))}")
    beta2 = group["variance_beta2"]
    if beta2 is not None and not 0.0 <= beta2 < 1.0:
        raise bad("variance_beta2", f"{beta2} must lie in [0, 1) or be None (off)")
    for p in group["params"]:
        if p.ndim != 2:
            raise bad("params", f"Muon needs matrices; got a parameter of shape {tuple(p.shape)}")


class MuonWithAuxAdamW(torch.optim.Optimizer):
    """Muon for the groups with `use_muon=True`, AdamW for the others; one optimiser, one `state`.

    Each group carries its own options: Muon groups lr, weight_decay, momentum, nesterov, orthogonalizer,
    orthogonalizer_dtype (auto | bfloat16 | float32; auto is resolved here, for the device of the group's first
    parameter), scale, variance_beta2 (None: off), cautious; AdamW groups lr, weight_decay, betas, eps.
    max_batch_elements: the most elements one batched orthogonalisation holds (1: one matrix a call).
    """

    def __init__(self, param_groups: Iterable[dict], max_batch_elements: int = MAX_BATCH_ELEMENTS):
        self.max_batch_elements = max_batch_elements
        groups = []
        for i, group in enumerate(param_groups):
            if "use_muon" not in group:
                raise InputError(f"param group {i}: use_muon: missing (True for Muon, False for AdamW)")
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAMW_DEFAULTS
            unknown = set(group) - set(defaults) - {"params", "use_muon", "name"}
            if unknown:
                raise InputError(f"param group {i}: unknown option(s) {', '.join(sorted(unknown))}")
            group = {**defaults, **group, "params": list(group["params"])}
            if group["use_muon"] and group["orthogonalizer_dtype"] == "auto":
                device = group["params"][0].device.type if group["params"] else "cpu"
                group["orthogonalizer_dtype"] = resolve_muon_dtype("auto", device)
            _check_group(i, group)
            groups.append(group)
        super().__init__(groups, {})

    def load_state_dict(self, state_dict: dict) -> None:
        if "optimizers" in state_dict:
            raise InputError("optimizer state: written by the old two-part MuonAdamW wrapper, which this version "
                             "cannot resume; start the run again (or load only its weights)")
        # torch restores every group option from the state; the update rule must not change silently
        state_dict = {**state_dict, "param_groups": [dict(g) for g in state_dict["param_groups"]]}
        for saved, now in zip(state_dict["param_groups"], self.param_groups, strict=False):
            if saved.get("use_muon") != now["use_muon"]:
                raise InputError(f"optimizer state: group '{now.get('name')}' was trained with use_muon="
                                 f"{saved.get('use_muon')!r}, this run has {now['use_muon']!r}; resume with the same "
                                 "optimizer")
            for key, before in (MUON_RESUME_KEYS.items() if now["use_muon"] else ()):
                saved.setdefault(key, before)
                if saved[key] != now[key]:
                    flag, fix = (("model.muon_dtype", f"pass --model.muon_dtype {saved[key]} (auto resolves per "
                                  "device)") if key == "orthogonalizer_dtype" else
                                 ("model.muon_variant", "resume with the same variant"))
                    raise InputError(f"optimizer state: group '{now.get('name')}' was trained with {key}="
                                     f"{saved[key]!r}, this run has {now[key]!r} ({flag}); {fix}")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
                continue
            for p in group["params"]:
                if p.grad is not None:
                    self._adamw_step(p, group)
        return loss

    def _muon_group_step(self, group: dict) -> None:
        """Muon on a group, a batch of same-shape matrices at a time: each one's direction U (whole under FSDP),
        O of the batch (B, m, n) in one call, normalised against each matrix's own second moment, then each update."""
        params = [p for p in group["params"] if p.grad is not None]
        for batch in same_shape_batches([p.shape for p in params], self.max_batch_elements):
            ps = [params[i] for i in batch]
            us = [self._direction(p, group) for p in ps]
            o = orthogonalize(us[0] if len(ps) == 1 else torch.stack(us), group)  # (m, n) or (B, m, n)
            if group["variance_beta2"] is not None:
                variances = [self.state[p]["variance"] for p in ps]
                v = variances[0] if len(ps) == 1 else torch.stack(variances)
                o = normalize_neurons(o, v, group["variance_beta2"])  # updates v, the EMA of O's mean squares
                if len(ps) > 1:
                    for old, new in zip(variances, v, strict=True):
                        old.copy_(new)
            for p, o_p in zip(ps, [o] if len(ps) == 1 else o.unbind(0), strict=True):
                self._muon_update(p, o_p, group)

    def _direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """U of matrix p from its gradient and momentum buffer (made here at the first step), the whole matrix."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)  # sharded like p under FSDP (a DTensor)
            if group["variance_beta2"] is not None:  # one entry per row or column of the whole matrix, replicated
                state["variance"] = torch.zeros(variance_shape(p.shape), device=_local(p).device, dtype=p.dtype)
        u = momentum_direction(_local(p.grad), _local(state["momentum_buffer"]), group)
        if _is_sharded(p):  # FSDP2: this rank's rows; Muon orthogonalises the whole matrix (gathered)
            return _whole(p, u, DTYPES[group["orthogonalizer_dtype"]])
        return u

    def _muon_update(self, p: torch.Tensor, o: torch.Tensor, group: dict) -> None:
        """W <- W - lr (lambda decay) - lr scale O, with O the whole matrix's direction (FSDP: p's rows of it)."""
        if _is_sharded(p):
            o = _rows_of(p, o)
        w = _local(p)
        lr, wd = group["lr"], group["weight_decay"]
        if wd > 0 and group["cautious"]:
            w.addcmul_((o * w >= 0).to(w.dtype), w, value=-lr * wd)  # decay only where O agrees with W's sign
        elif wd > 0:
            w.mul_(1 - lr * wd)
        w.add_(o.to(w.dtype), alpha=-lr * update_scale(group["scale"], p.shape))

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        """torch.optim.AdamW's update: decoupled decay, bias-corrected first and second moments."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t, (beta1, beta2), lr, g = state["step"], group["betas"], group["lr"], _local(p.grad)
        w, m, v = _local(p), _local(state["exp_avg"]), _local(state["exp_avg_sq"])  # (FSDP: this rank's rows)
        w.mul_(1 - lr * group["weight_decay"])
        m.lerp_(g, 1 - beta1)  # m <- beta1 m + (1 - beta1) g
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v <- beta2 v + (1 - beta2) g^2
        # W <- W - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)
        denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
        w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


def same_shape_batches(shapes: list[torch.Size], max_elements: int) -> list[list[int]]:
    """Indices of the matrices of each shape (in order of first appearance), cut into batches of at most
    max_elements elements (a matrix larger than that: a batch of its own)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, shape in enumerate(shapes):
        by_shape.setdefault(tuple(shape), []).append(i)
    batches = []
    for shape, indices in by_shape.items():
        per = max(1, max_elements // math.prod(shape))
        batches += [indices[k:k + per] for k in range(0, len(indices), per)]
    return batches


# ---- FSDP2: parameters sharded by rows (DTensor, Shard(0) over the data-parallel mesh) -----------------------
def _is_sharded(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the same storage), or the tensor itself."""
    return t.to_local() if _is_sharded(t) else t


def _whole(p: torch.Tensor, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole matrix from every rank's rows `local`, laid out as parameter p is (an all-gather), in `dtype`, the
    orthogonaliser's: it rounds its input to that dtype first, so gathering it rounded is exact (and bfloat16
    moves half the bytes)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(dtype), p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride()).full_tensor()


def _rows_of(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a whole matrix, as parameter p holds them."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def sharded_grad_norm(model: nn.Module) -> torch.Tensor:
    """The total L2 norm of the gradients of a model sharded by FSDP2: every rank's squared sum, all-reduced."""
    import torch.distributed as dist

    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    total = sum((g.float().square().sum() for g in grads), torch.zeros((), device=grads[0].device if grads else None))
    group = next((p.device_mesh.get_group() for p in model.parameters() if _is_sharded(p)), None)
    if group is not None:
        dist.all_reduce(total, group=group)
    return total.sqrt()


def build_optimizer(
    model: nn.Module,
    *,
    kind: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    muon_lr: float,
    muon_weight_decay: float,
    muon_momentum: float = 0.95,
    muon_variant: str = "reference",
    muon_dtype: str = "auto",
) -> torch.optim.Optimizer:
    muon_params, adamw_params = split_parameters(model)
    if kind == "adamw":
        params = adamw_params + muon_params
        return torch.optim.AdamW([{"params": params, "name": "adamw"}], lr=lr, betas=betas, weight_decay=weight_decay,
                                 **adamw_kernel(params))
    if kind != "muon_adamw":
        raise InputError(f"optimizer: unknown kind '{kind}'; use 'muon_adamw' or 'adamw'")
    if muon_variant not in MUON_VARIANTS:
        raise InputError(f"muon_variant: unknown '{muon_variant}'; use one of {', '.join(MUON_VARIANTS)}")
    groups = [{"params": adamw_params, "use_muon": False, "name": "adamw", "lr": lr, "betas": tuple(betas),
               "weight_decay": weight_decay}]
    if muon_params:
        groups.insert(0, {"params": muon_params, "use_muon": True, "name": "muon", "lr": muon_lr,
                          "weight_decay": muon_weight_decay, "momentum": muon_momentum,
                          "orthogonalizer_dtype": muon_dtype, **MUON_VARIANTS[muon_variant]})
    return MuonWithAuxAdamW(groups)


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch.optim.AdamW's fused CUDA kernel (one launch for every parameter, its step count on the device: no host
    read) where every parameter is a plain CUDA tensor; elsewhere its default (foreach on CUDA, FSDP2's sharded
    DTensors included; the per-parameter loop on CPU, whose numbers the CPU studies were trained with)."""
    if params and all(p.device.type == "cuda" and not _is_sharded(p) for p in params):
        return {"fused": True}
    return {}


def muon_dtype_of(optimizers: Iterable[torch.optim.Optimizer]) -> str | None:
    """The dtype Muon's orthogonalisers run in (auto resolved), or None where no optimiser has a Muon group."""
    for opt in optimizers:
        for group in opt.param_groups:
            if group.get("use_muon"):
                return group["orthogonalizer_dtype"]
    return None
