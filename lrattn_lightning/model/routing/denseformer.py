"""DenseFormer's depth-weighted average (DWA; Pagliardini et al. 2024, docs/method.md §9; `routing: denseformer`).

Inside each layer the residual stream is the plain one (h = x' + o_attn, then x_t = h + o_mlp). After layer t
(1..L) its output x_t is kept, and the next layer (and the head, after the last) reads

    x'_t = sum_{s in G_t} w_{t,s} x_s       G_t = {s <= t : s = t mod k}     (k: `dilation`, default 1)

with x_0 the embedding and x_s the outputs as the layers wrote them (before their own average). A DWA sits
only after the layers t with t mod p = 0 (p: `period`, default 1); elsewhere x'_t = x_t. The weights are
learned scalars, no input dependence, initialised to the identity (w_{t,t} = 1, the others 0), so at
initialisation the model is the baseline exactly. This follows epfml/DenseFormer's `DWAModules` (one weight
vector of (t + k) // k entries per averaged layer; the outputs kept in k interleaved groups).

    params = sum_{t: t mod p = 0} (t + k) // k          FLOPs/token = 2 d x that   (one multiply-add per weight)

Depth routing is per token: KV-cache decoding needs no cache of its own. The weight vectors are 1-D, so AdamW
takes them under muon_adamw (the usual rule). Diagnostics ("mixing"): a recording pass keeps each DWA's weights
as one heatmap row over x_0 .. x_t (NaN at the outputs a dilation leaves out of G_t).

Shape legend: B batch, T tokens, D = d_model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.options import PositiveInt
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router


def averaged_layers(cfg: ModelConfig) -> list[int]:
    """The layers t (1..L) after which a DWA sits."""
    return [t for t in range(1, cfg.size.n_layers + 1) if t % cfg.options.period == 0]


def group_of(t: int, dilation: int) -> list[int]:
    """G_t: the kept outputs s <= t with s = t mod k, oldest first (the last weight is x_t's own)."""
    return list(range(t % dilation, t + 1, dilation))


@dataclass
class DWAState:
    outputs: list[Tensor]  # x_0 (the embedding), x_1 .. x_t: the layers' outputs as they wrote them
    stream: Tensor  # the stream inside the current layer
    weights: list[Tensor] | None = field(default=None)  # recording: per DWA, w over x_0..x_t as [t + 1, 1, 1, 1]


class DenseFormerRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d, self.dilation = cfg.size.d_model, cfg.options.dilation
        self.layers = averaged_layers(cfg)
        # one weight vector per averaged layer, over G_t (named by the layer: dwa.<t>)
        self.dwa = nn.ParameterDict({str(t): nn.Parameter(torch.empty(len(group_of(t, self.dilation))))
                                     for t in self.layers})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w in self.dwa.values():  # the identity: x'_t = x_t
                w.zero_()
                w[-1] = 1.0

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> DWAState:
        return DWAState([emb_BTD], emb_BTD, [] if record else None)

    def write(self, state: DWAState, i: int, out_BTE: Tensor) -> None:
        state.stream = state.stream + out_BTE[..., : self.d]
        if i % 2:  # the attention sublayer: the plain residual inside the layer
            return
        t = i // 2
        state.outputs.append(state.stream)  # x_t, before its average
        if str(t) in self.dwa:
            w = self.dwa[str(t)]
            group = group_of(t, self.dilation)
            sources = [state.outputs[s] for s in group]
            state.stream = sum(w[n].to(x.dtype) * x for n, x in enumerate(sources))
            if state.weights is not None:  # input-independent: one value per source; NaN outside G_t
                row = torch.full((t + 1,), float("nan"), device=w.device)
                row[group] = w.detach().float()
                state.weights.append(row.view(t + 1, 1, 1, 1))

    def read(self, state: DWAState, j: int) -> Tensor:
        return state.stream


@dataclass(frozen=True)
class DenseFormerOptions(KindOptions):
    dilation: PositiveInt = 1  # k: a DWA averages every k-th earlier output (and the current one)
    period: PositiveInt = 1  # p: a DWA after every p-th layer


class DenseFormerKind(UnkeyedKind):
    name = "denseformer"
    Options = DenseFormerOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        L = cfg.size.n_layers
        if cfg.options.period > L:
            raise cfg.options.error(where, "period", f"period={cfg.options.period} exceeds the {L} layers: no layer "
                                    f"would average; choose period <= {L}")

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return DenseFormerRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        return sum(len(group_of(t, cfg.options.dilation)) for t in averaged_layers(cfg))

    def added_flops(self, cfg: ModelConfig) -> int:
        return 2 * cfg.size.d_model * self.routing_params(cfg)

    def adamw_names(self, router: nn.Module) -> set[str]:
        return set()  # its weight vectors go by the usual rule (vectors: AdamW)

    def code_paths(self, options: DenseFormerOptions) -> list[str]:
        return []


KIND = DenseFormerKind()
