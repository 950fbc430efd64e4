"""RMS Block AttnRes (`block_summary: rms`; docs/method.md §10): a completed block summarises its outputs normalised.

kimmichtank/rms-block-attnres (`small/pretrain_core.py`, `HiddenNormalizedSum` and its backbone) forms the
sources of a read as [embedding, completed summaries, raw sum of the pending outputs], where a block that
completes is summarised as

    v_B = sum_{i in B} RMS(o_i)          RMS(x) = x / sqrt(mean(x^2) + 1e-6), no gain, nothing after the sum

each output normalised in float32 and cast back to its own dtype before the sum (we normalise in the routing's
compute dtype: float64 for a float64 model, where the public code would round to float32). The embedding and
the partial (current) block stay raw. Keys follow from the summary value as for every summary (keys.py): value
keys are v_B (and the read's key norm normalises v_B again, as the public code's aggregator does with its
sources), sliced keys its last r dims, value_projected keys W RMSNorm(v_B); P-LR keys are emitted rows, not
derived from the value, so a block's key stays the sum of its normalised emitted keys. The public code only has
value keys; the LR forms are ours.

Every backend takes it through `AttnResRouter.new_partial` / `completed` (reference.py): the summary is an
ordinary tensor handed to the backend's store, so its gradient is torch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from lrattn_lightning.model.routing._math import PartialBlock, compute_dtype

RMS_EPS = 1e-6  # the public code's


def output_rms(x_BTD: Tensor) -> Tensor:
    """RMS(o) in the compute dtype with eps 1e-6, cast back to o's dtype (the public code's `transform`)."""
    return F.rms_norm(x_BTD.to(compute_dtype(x_BTD.dtype)), (x_BTD.shape[-1],), eps=RMS_EPS).to(x_BTD.dtype)


@dataclass
class RmsPartialBlock(PartialBlock):
    """The raw running sums (what a read of the partial block sees), plus the sum of the normalised outputs
    (what the block's summary becomes when it completes)."""

    normed: Tensor | None = None  # sum_i RMS(o_i) [B, T, D]

    def add(self, value_BTD: Tensor, key_BTr: Tensor | None, i: int) -> None:
        super().add(value_BTD, key_BTr, i)
        normed = output_rms(value_BTD)
        self.normed = normed if self.count == 1 else self.normed + normed

    def clear(self) -> None:
        super().clear()
        self.normed = None

    def completed(self) -> PartialBlock:
        """The block as its summary sees it: the normalised sum as the value, the emitted keys' sum unchanged."""
        return PartialBlock(self.normed, self.key, self.count, self.last)
