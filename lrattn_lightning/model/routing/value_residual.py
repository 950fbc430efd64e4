"""Value residual learning (ResFormer; Zhou et al., arXiv 2410.17897; docs/method.md §10; `routing: value_residual`).

The residual stream stays the plain one; what changes is the token attention's values. Layer 1 keeps its values
V_1 = W_V^1 RMSNorm(h) (per token and head, before attention), and every later layer n mixes them into its own:

    V_n <- lambda_n V_1 + (1 - lambda_n) V_n          (queries and keys unchanged; the KV cache holds the mixed V)

ResFormer (Zcchill/Value-Residual-Learning, `modeling_llama_resformer.py`) fixes lambda = 0.5 for every layer
(`value_lambda: 0.5`); the learnable form (modded-nanogpt's) is one scalar per layer n >= 2 started at the same
value (`value_lambda_learned: true`). Neither is the baseline at init (lambda = 0.5 mixes from the first step);
`value_lambda: 0` is the baseline exactly. V_1 is layer 1's own unmixed values, taken through the router protocol's
`mix_values` extension (router.py): routing state beyond the residual stream.

    params = L - 1 learned scalars (0 fixed)          FLOPs/token = (L - 1) 3 d   (lambda V_1, + (1 - lambda) V_n)

KV-cache decoding: a new token's V_1 is computed by layer 1 in the same pass (per token), and the cached
positions' values are already mixed: no cache of its own. The lambdas are scalars: AdamW takes them under
muon_adamw (the usual rule). Diagnostics ("mixing"): a recording pass keeps, per layer n >= 2, the row
(lambda_n, 1 - lambda_n): the weights of V_1 and of the layer's own values.

Shape legend: B batch, T tokens, H heads, hd head width, D = d_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from torch import Tensor, nn

from lrattn_lightning.core.errors import config_error
from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.options import Range
from lrattn_lightning.model.routing.kind import KindOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router

Lambda = Annotated[float, Range(0, 1, note="0: the baseline, ResFormer: 0.5")]


@dataclass
class ValueResidualState:
    stream: Tensor  # h [B, T, D], the plain residual stream
    first_values: Tensor | None = None  # V_1 of this pass's tokens [B, T, H, hd]
    weights: list[Tensor] | None = None  # recording: per layer n >= 2, (lambda_n, 1 - lambda_n) as [2, 1, 1, 1]


class ValueResidualRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = cfg.options
        self.d, self.start_lambda, self.learned = cfg.size.d_model, float(a.value_lambda), a.value_lambda_learned
        if self.learned:
            self.lambdas = nn.Parameter(torch.empty(cfg.size.n_layers - 1))  # layers 2..L
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.learned:
            with torch.no_grad():
                self.lambdas.fill_(self.start_lambda)

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> ValueResidualState:
        return ValueResidualState(emb_BTD, weights=[] if record else None)

    def write(self, state: ValueResidualState, i: int, out_BTE: Tensor) -> None:
        state.stream = state.stream + out_BTE[..., : self.d]

    def read(self, state: ValueResidualState, j: int) -> Tensor:
        return state.stream

    def mix_values(self, state: ValueResidualState, layer: int, v_BTHd: Tensor) -> Tensor:
        if layer == 0:
            state.first_values = v_BTHd
            return v_BTHd
        lam = self.lambdas[layer - 1].to(v_BTHd.dtype) if self.learned else self.start_lambda
        if state.weights is not None:
            w = lam.detach().float() if self.learned else torch.tensor(lam, device=v_BTHd.device)
            state.weights.append(torch.stack((w, 1 - w)).view(2, 1, 1, 1))
        return lam * state.first_values + (1 - lam) * v_BTHd


@dataclass(frozen=True)
class ValueResidualOptions(KindOptions):
    """`value_residual: {value_lambda: 0.5, value_lambda_learned: true}` (flat: the same names)."""

    value_lambda: Lambda = 0.5  # lambda: the weight of layer 1's values (fixed, or the learned lambdas' start)
    value_lambda_learned: bool = False  # one learned lambda per layer n >= 2 (modded-nanogpt) instead of fixed


class ValueResidualKind(UnkeyedKind):
    name = "value_residual"
    Options = ValueResidualOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        if cfg.size.n_layers < 2:
            raise config_error(where, "routing", "value_residual needs at least 2 layers (layer 1 only keeps V_1)")

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return ValueResidualRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        return cfg.size.n_layers - 1 if cfg.options.value_lambda_learned else 0

    def added_flops(self, cfg: ModelConfig) -> int:
        return (cfg.size.n_layers - 1) * 3 * cfg.size.d_model

    def adamw_names(self, router: nn.Module) -> None:
        return None  # scalars

    def code_paths(self, options: ValueResidualOptions) -> list[str]:
        return []


KIND = ValueResidualKind()
