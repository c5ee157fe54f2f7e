"""The language-modelling loss the bundled model trains on, and the re-tune gates and router fine-tuning score with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["next_token_loss", "next_token_losses", "scored_targets"]


def scored_targets(mask: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per row: which next-token targets count (``[B, T-1]`` bool); known before any forward pass."""
    scored = mask if loss_mask is None else loss_mask * mask
    return scored[:, 1:] != 0


def next_token_losses(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the batch: the summed next-token cross-entropy over its scored targets, and their count.

    Differentiable (the caller decides about ``no_grad``); right padding marked by ``mask == 0``.
    ``loss_mask`` (default: ``mask``) marks the tokens that count as targets; the others are
    still read as context. The paired perplexity gate compares two models row by row.
    """
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    targets = ids[:, 1:].masked_fill(~scored_targets(mask, loss_mask), -100)
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view(targets.shape)
    return losses.sum(dim=1), (targets != -100).sum(dim=1)


def next_token_loss(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the scored targets of the whole batch, and their count."""
    losses, counts = next_token_losses(model, ids, mask, loss_mask)
    return losses.sum(), int(counts.sum())
