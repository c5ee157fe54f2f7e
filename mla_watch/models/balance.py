"""DeepSeek-V3's auxiliary-loss-free balancing rule, which training and the ``bias`` re-tune both apply."""

from __future__ import annotations

import torch

__all__ = ["sign_step"]


def sign_step(load: torch.Tensor, gamma: float) -> torch.Tensor:
    """How far each expert's correction bias moves after a batch: ``gamma * sign(mean_load - load_i)`` (an
    underloaded expert gains ``gamma``, an overloaded one loses it; ``load``: selections per expert)."""
    return gamma * torch.sign(load.mean() - load)
