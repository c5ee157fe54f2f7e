"""The perplexity gate's three-way decision: the paired statistics on tiny inputs, then the real
bundled model judging a candidate that really is worse, and one that is not."""

from __future__ import annotations

import math

import pytest
import torch

import mla_watch
from mla_watch.models import corpus
from mla_watch.quality.local_model import copy_without_hooks, make_batches, score_model
from mla_watch.quality.paired import PerplexityMargin, compare_perplexity, parse_margin
from mla_watch.retune.gates import Band, evaluate_gates

RELATIVE_2 = PerplexityMargin(0.02, relative=True)


def test_margins_are_absolute_numbers_or_percentages_and_errors_name_the_value() -> None:
    assert parse_margin(0.3) == PerplexityMargin(0.3, relative=False)
    assert parse_margin("2%") == parse_margin(" 2 % ") == RELATIVE_2
    assert parse_margin("0.5") == PerplexityMargin(0.5, relative=False)
    assert str(RELATIVE_2) == "2%" and str(parse_margin(0.3)) == "0.3"
    # ppl 14 with +0.3 allowed is a 2.1 % margin; 2 % is 2 % at any scale
    assert math.isclose(parse_margin(0.3).log_ratio_limit(14.0), math.log(14.3 / 14.0))
    assert math.isclose(RELATIVE_2.log_ratio_limit(97.0), math.log(1.02))
    for bad in (-1, "abc", "150%", True, None, float("nan")):
        with pytest.raises(
            ValueError,
            match=r"^max_perplexity_increase = .*: expected an absolute perplexity "
            r"increase \(a number >= 0, e\.g\. 0\.3\) or a relative one",
        ):
            parse_margin(bad)


def _samples(count: int, tokens: int, live: float, shift: float, noise: float, seed: int = 0):
    """Per-sample summed losses: ``live`` nats per token, the candidate ``shift`` worse, with per-sample noise."""
    generator = torch.Generator().manual_seed(seed)
    jitter = torch.randn(count, generator=generator) * noise
    base = [live * tokens] * count
    candidate = [live * tokens + (shift + float(j)) * tokens for j in jitter]
    return base, candidate, [tokens] * count


def test_the_same_losses_pass_and_a_clear_worsening_on_enough_tokens_is_rejected_with_its_interval() -> None:
    base, same, tokens = _samples(40, 12, 2.0, 0.0, 0.0)
    decided = compare_perplexity(base, same, tokens, margin=RELATIVE_2, min_tokens=400)
    assert decided.decision == "pass" and decided.tokens == 480 and decided.samples == 40
    assert decided.low == decided.high == decided.candidate_perplexity == pytest.approx(math.exp(2.0))

    base, worse, tokens = _samples(40, 12, 2.0, 0.10, 0.05)  # ~10 % worse per token, little spread
    decided = compare_perplexity(base, worse, tokens, margin=RELATIVE_2, min_tokens=400)
    assert decided.decision == "reject"
    assert decided.limit < decided.low < decided.candidate_perplexity < decided.high
    assert decided.message().startswith("perplexity worse than allowed: candidate perplexity")
    assert "on 480 held-out tokens in 40 distinct samples" in decided.message()


def test_too_few_tokens_or_an_interval_across_the_margin_is_not_enough_data_never_a_rejection() -> None:
    base, worse, tokens = _samples(10, 12, 2.0, 0.10, 0.05)  # as clearly worse, on 120 tokens
    decided = compare_perplexity(base, worse, tokens, margin=RELATIVE_2, min_tokens=400)
    assert decided.decision == "insufficient"
    assert decided.message() == (
        "not enough held-out data to judge perplexity: 120 scored tokens in 10 distinct "
        "samples, the gate needs at least 400 tokens in 8 distinct samples"
    )

    base, noisy, tokens = _samples(40, 12, 2.0, 0.02, 0.30, seed=1)  # at the margin, with a wide spread
    decided = compare_perplexity(base, noisy, tokens, margin=RELATIVE_2, min_tokens=400)
    assert decided.decision == "insufficient" and decided.low < decided.limit < decided.high
    assert "the interval straddles the limit" in decided.message()
    # The same spread over 25 times the samples narrows the interval enough to decide.
    base, noisy, tokens = _samples(1000, 12, 2.0, 0.10, 0.30, seed=1)
    assert compare_perplexity(base, noisy, tokens, margin=RELATIVE_2, min_tokens=400).decision == "reject"

    (one,) = [compare_perplexity([24.0], [30.0], [12], margin=RELATIVE_2, min_tokens=1)]
    assert one.decision == "insufficient" and one.as_dict()["high"] is None  # one sample has no spread to go on


@pytest.fixture(scope="module")
def bundled_batches() -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """A hook-free copy of the bundled model and held-out batches of every corpus domain to score it on."""
    model, tokenizer = mla_watch.load_model("bundled", device="cpu")
    texts = [text for domain in corpus.DOMAINS for text in corpus.generate(domain, 12, seed=4242)]
    ids = [tokenizer(text)["input_ids"][:48] for text in texts]
    return copy_without_hooks(model).eval(), make_batches(ids, batch_size=8, pad_id=tokenizer.pad_token_id or 0)


def test_the_real_model_rejects_router_noise_with_its_interval_and_passes_its_own_routers(bundled_batches) -> None:
    model, batches = bundled_batches
    live = score_model(model, batches)
    gate = model.model.layers[1].mlp.gate
    routers = ["model.layers.1.mlp.gate"]
    band = Band("entropy_bits", low=5.2)
    original = gate.weight.detach().clone()
    try:
        with torch.no_grad():
            gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(5)))
        noisy = score_model(model, batches)
    finally:
        with torch.no_grad():
            gate.weight.copy_(original)
    report = evaluate_gates(live, noisy, routers=routers, band=band, max_perplexity_increase="2%", min_tokens=400)
    assert live.tokens >= 400  # the rejection rests on at least the stated minimum of held-out tokens
    assert report.decision == "reject", report.as_dict()
    paired = report.as_dict()["perplexity"]
    assert paired["decision"] == "reject" and paired["low"] > paired["limit"] and paired["tokens"] == live.tokens
    assert paired["margin"] == "2%" and paired["confidence"] == 0.95

    again = score_model(model, batches)  # the live routers against themselves: not worse by any margin
    assert evaluate_gates(live, again, routers=routers, band=band, min_tokens=400).decision == "pass"
    assert evaluate_gates(live, again, routers=routers, band=band, min_tokens=100_000).decision == "insufficient"
