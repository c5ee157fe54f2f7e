"""A stream's lines: bounded by a limit of their own; one that carries routing, by the answer's."""

from __future__ import annotations

import pytest

from mla_watch.engines.stream_lines import ROUTING_KEY_WINDOW, AnswerTooLarge, EventLines


def test_a_line_without_routing_is_cut_at_the_line_limit() -> None:
    lines = EventLines(1000, routing_limit=10_000)
    assert lines.feed(b'data: {"x": 1}\n\ndata: {"y": "') == [b'data: {"x": 1}', b""]
    with pytest.raises(AnswerTooLarge) as raised:
        lines.feed(b"c" * 1000)
    assert raised.value.limit == 1000


def test_a_line_that_names_routing_early_may_reach_the_routing_limit_and_no_further() -> None:
    lines = EventLines(1000, routing_limit=10_000)
    assert lines.feed(b'data: {"choices":[{"index":0,"routed_experts":"' + b"A" * 5000) == []
    assert lines.feed(b'"}]}\n') == [b'data: {"choices":[{"index":0,"routed_experts":"' + b"A" * 5000 + b'"}]}']
    lines.feed(b'data: {"sglext":{"routed_experts":"')
    with pytest.raises(AnswerTooLarge) as raised:
        lines.feed(b"A" * 10_000)
    assert raised.value.limit == 10_000


def test_the_routing_key_counts_only_near_the_start_of_a_line() -> None:
    limit = 2 * ROUTING_KEY_WINDOW
    lines = EventLines(limit, routing_limit=10 * limit)
    lines.feed(b"data: " + b" " * (ROUTING_KEY_WINDOW - 10))  # the key would end past the window
    with pytest.raises(AnswerTooLarge) as raised:
        lines.feed(b'"routed_experts":"' + b"A" * limit)
    assert raised.value.limit == limit


@pytest.mark.parametrize(
    "reads",
    [
        [b"data: " + b"y" * 2000 + b"\n\n"],  # one read, whole lines
        [b"data: " + b"y" * 900, b"y" * 200 + b'\ndata: {"t": 1}\n'],  # the line ends in the read that passes the limit
        [b"data: " + b"y" * 900, b"y" * 200 + b"\r"],
    ],
)
def test_a_line_over_the_limit_is_cut_however_its_end_arrives(reads: list[bytes]) -> None:
    lines = EventLines(1000, routing_limit=10_000)
    with pytest.raises(AnswerTooLarge) as raised:
        for read in reads:
            lines.feed(read)
    assert raised.value.limit == 1000


def test_lines_within_the_limit_pass_in_one_long_read() -> None:
    lines = EventLines(1000, routing_limit=10_000)
    read = b"".join(b"data: " + bytes([65 + i % 26]) * 900 + b"\n\n" for i in range(5))
    assert lines.feed(read) == [line for i in range(5) for line in (b"data: " + bytes([65 + i % 26]) * 900, b"")]
