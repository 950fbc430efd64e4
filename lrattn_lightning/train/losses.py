"""The training loss's parts, shared by training, validation and `lrattn eval`'s exact validation loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, mean z-loss term logsumexp^2), both in float32."""
    logits = logits.float().flatten(0, 1)
    ce = F.cross_entropy(logits, targets.flatten())
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return ce, z
