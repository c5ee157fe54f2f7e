"""How much of a reference set one reading reads: each prompt up to the reader's limit, the set within its budget.

A reader reads a prompt up to ``limit`` tokens: the model's context for the model served here,
``--reference-max-tokens`` beside an engine (whose context it may not fill: one token is generated). A set
reads at most its ``max_tokens`` (:mod:`mla_watch.references.prompts`), its prompts in order: a prompt that does not
fit whole is left out with every one after it (so the set keeps its longest reach), the first one cut to the
budget. What was cut or left out is said, in the reading and once in the log, naming the file, the key and
the value. A generated set's documents are made as long as the limit: long enough a text is tokenized, and
cut there.

No torch: the tokenizer is the reader's (the model's own, or the engine's ``/tokenize``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mla_watch.references.prompts import ReferenceSet

__all__ = ["CHARS_PER_TOKEN", "MAX_CHARS_PER_TOKEN", "ReadPlan", "plan_reading"]

# A generated document is first made CHARS_PER_TOKEN characters a token long (English prose and code run 3 to 5),
# and twice as long while it tokenizes short, up to MAX_CHARS_PER_TOKEN; a given prompt's text is cut there too
# before it is tokenized, which bounds the tokenizer's work by the limit, not by the file.
CHARS_PER_TOKEN = 6
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class ReadPlan:
    """The token ids one reading of a set reads, and what of the set it leaves out."""

    ids: tuple[tuple[int, ...], ...]  # per prompt read, in order
    prompts: int  # the set's prompts (a generated set's documents)
    limit: int  # the reader's tokens a prompt
    cut: int  # prompts read cut to the limit (or to the budget)
    left_out: int  # prompts past the set's budget, not read
    too_short: int  # prompts of fewer than 2 tokens: nothing to predict, not read
    note: str | None  # what was cut or left out, in one sentence naming the file, the key and the value

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(ids) for ids in self.ids)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def plan_reading(reference: ReferenceSet, tokenize: Callable[[Sequence[str]], list[list[int]]], limit: int) -> ReadPlan:
    """The plan of ``reference`` read ``limit`` tokens a prompt at most, ``tokenize`` being the reader's."""
    if limit < 2:
        raise ValueError(f"limit = {limit!r}: expected at least 2 tokens a prompt")
    if reference.generate is None:
        tokenized = tokenize([text[: limit * MAX_CHARS_PER_TOKEN] for text in reference.prompts])
    else:
        tokenized = _generated(reference, tokenize, limit)
    budget = reference.max_tokens
    read: list[tuple[int, ...]] = []
    cut = left_out = too_short = total = 0
    for ids in tokenized:
        if len(ids) < 2:
            too_short += 1
            continue
        if left_out:
            left_out += 1
            continue
        whole = len(ids) <= limit
        ids = ids[:limit]
        if total + len(ids) > budget:
            if read:
                left_out += 1
                continue
            ids = ids[:budget]  # one prompt past the whole budget: read as far as it goes
            whole = False
        cut += not whole
        read.append(tuple(ids))
        total += len(ids)
    return ReadPlan(
        tuple(read),
        reference.count,
        limit,
        cut,
        left_out,
        too_short,
        _note(reference, limit, cut, left_out, too_short, total),
    )


def _generated(
    reference: ReferenceSet, tokenize: Callable[[Sequence[str]], list[list[int]]], limit: int
) -> list[list[int]]:
    characters = limit * CHARS_PER_TOKEN
    while True:
        tokenized = tokenize(reference.texts(characters))
        if min(len(ids) for ids in tokenized) >= limit or characters >= limit * MAX_CHARS_PER_TOKEN:
            return tokenized
        characters *= 2


def _note(reference: ReferenceSet, limit: int, cut: int, left_out: int, too_short: int, total: int) -> str | None:
    said = []
    if cut and reference.generate is None:
        said.append(f"{cut} prompts cut to {limit} tokens (the reader's limit a prompt)")
    if left_out:
        said.append(
            f"{left_out} prompts left out past max_tokens = {reference.max_tokens} (the set's token budget; "
            f"{total} tokens read)"
        )
    if too_short:
        said.append(f"{too_short} prompts of fewer than 2 tokens left out (nothing to predict)")
    if not said:
        return None
    return f"{reference.source or reference.name}: " + "; ".join(said)
