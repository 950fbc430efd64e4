"""The plain residual stream (routing: residual), the baseline every ablation is compared against.

    h_0 = o_0 (the embedding)        h_i = h_{i-1} + o_i        read site j returns h_j

With the decoder's parameter-free pre-norm this is exactly the standard pre-norm Transformer. No
parameters; one implementation (the `impl` backend names only AttnRes code and is ignored here).

Shape legend: B batch, T tokens, D = d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from lrattn_lightning.model.config import ModelConfig
from lrattn_lightning.model.routing.kind import NoOptions, UnkeyedKind
from lrattn_lightning.model.routing.router import Router


@dataclass
class ResidualState:
    stream: Tensor  # h [B, T, D]
    weights: list[Tensor] | None = None  # recording: stays empty (no routing weights)


class ResidualRouter(Router):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.d = cfg.size.d_model

    def reset_parameters(self) -> None:
        pass

    def start(self, emb_BTD: Tensor, *, record: bool = False, cache: None = None,
              segments: Tensor | None = None) -> ResidualState:
        return ResidualState(emb_BTD, [] if record else None)

    def write(self, state: ResidualState, i: int, out_BTE: Tensor) -> None:
        state.stream = state.stream + out_BTE[..., : self.d]

    def read(self, state: ResidualState, j: int) -> Tensor:
        return state.stream


class ResidualKind(UnkeyedKind):
    """No options, no parameters, no FLOPs beyond the core."""

    name = "residual"
    Options = NoOptions

    def validate_model(self, cfg: ModelConfig, where: str) -> None:
        """No options: nothing depends on the size."""

    def build(self, cfg: ModelConfig, impl: str) -> nn.Module:
        return ResidualRouter(cfg)

    def routing_params(self, cfg: ModelConfig) -> int:
        return 0

    def added_flops(self, cfg: ModelConfig) -> int:
        return 0

    def adamw_names(self, router: nn.Module) -> set[str]:
        return set()  # no parameters

    def code_paths(self, options: NoOptions) -> list[str]:
        return []


KIND = ResidualKind()
