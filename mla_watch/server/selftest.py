"""Start-up self-test: does the configured attention compute what eager attention does?

Fused attention kernels have disagreed with MLA before (flash-attention with MLA's
asymmetric head sizes multiplied perplexity by ten), silently. Before serving, the server
runs one fixed batch - with a padded row - through the configured implementation and
through eager attention, and refuses the configured one when the logits disagree beyond a
tolerance relative to their scale (1e-3 in float32, 2e-2 in 16-bit types) or when the
perplexity differs by more than 1%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SelfTestResult", "attention_self_test"]


@dataclass(frozen=True)
class SelfTestResult:
    configured: str
    used: str
    max_relative_difference: float
    perplexity_ratio: float
    tolerance: float
    message: str

    @property
    def refused(self) -> bool:
        return self.configured != self.used

    def as_dict(self) -> dict[str, Any]:
        def finite(value: float) -> float | None:  # JSON has no infinity; None reads "could not be measured"
            return value if math.isfinite(value) else None

        return {
            "configured": self.configured,
            "used": self.used,
            "refused": self.refused,
            "max_relative_difference": finite(self.max_relative_difference),
            "perplexity_ratio": finite(self.perplexity_ratio),
            "tolerance": self.tolerance,
            "message": self.message,
        }


def _fixed_batch(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab_size, (2, 48), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # left padding exercises the masked path too
    return ids.to(device), mask.to(device)


def _perplexity(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    # Only real tokens predicting real tokens: logits at padded positions are undefined in every implementation.
    targets = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return math.exp(float(loss))


@torch.no_grad()
def attention_self_test(model: Any, configured: str, tolerance: float | None = None) -> SelfTestResult:
    """Compare ``configured`` with eager attention; leave the model on the one to serve with."""
    if tolerance is None:
        tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 2e-2
    if configured == "eager":
        model.set_attn_implementation("eager")
        return SelfTestResult("eager", "eager", 0.0, 1.0, tolerance, "eager attention is the reference")
    device = next(model.parameters()).device
    ids, mask = _fixed_batch(model.config.vocab_size, device)
    model.set_attn_implementation("eager")
    reference = model(input_ids=ids, attention_mask=mask).logits.float()
    try:
        model.set_attn_implementation(configured)
        candidate = model(input_ids=ids, attention_mask=mask).logits.float()
    except Exception as error:  # an implementation that cannot even run is refused the same way
        model.set_attn_implementation("eager")
        return SelfTestResult(
            configured,
            "eager",
            math.inf,
            math.inf,
            tolerance,
            f"attention {configured!r} failed on the self-test batch ({error}); serving with eager",
        )
    real = mask.bool()
    scale = reference[real].abs().max().clamp(min=1e-6)
    difference = float((candidate - reference)[real].abs().max() / scale)
    ratio = _perplexity(candidate, ids, mask) / _perplexity(reference, ids, mask)
    if not math.isfinite(difference) or difference > tolerance or abs(ratio - 1) > 0.01:
        model.set_attn_implementation("eager")
        return SelfTestResult(
            configured,
            "eager",
            difference,
            ratio,
            tolerance,
            f"attention {configured!r} disagrees with eager on the self-test batch: max relative logit "
            f"difference {difference:.3g} (tolerance {tolerance:g}), perplexity x{ratio:.3f}; serving with eager",
        )
    return SelfTestResult(
        configured,
        configured,
        difference,
        ratio,
        tolerance,
        f"attention {configured!r} agrees with eager (max relative difference {difference:.2g})",
    )
