"""Streamed vLLM requests counted by replay: vLLM puts no routing in a stream, so its tokens are sent again.

For a stream it relays, the proxy asks vLLM for the token ids (``return_token_ids``, taken out of
what the client receives unless it asked for them itself). Once the stream has ended, each of its
choices is replayed as one non-streamed completion of ``prompt ids + generated ids[:-1]`` with
``max_tokens: 1`` and temperature 0. Its routing has the rows the same request made without streaming
returns - every prompt row and one per forwarded generated token - and the prompt part is a
prefix-cache hit, so the engine mostly looks it up. Choices after the first that share its prompt
are replayed with ``routed_experts_prompt_start`` at the prompt's end: the prompt rows are counted
once, as for an unstreamed answer with ``n > 1``.

What a replay may cost is bounded by :class:`ReplayBudget`: the share of streams replayed, the replays
at once and waiting, and the tokens replayed per second (a token bucket that may run one request into
debt, so a long request is not starved). Every stream is counted once in
``mla_watch_engine_stream_replays_total{outcome}``, one of :data:`REPLAY_OUTCOMES`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mla_watch.common.setting_errors import SettingProblem
from mla_watch.engines.count_queue import CountQueue
from mla_watch.engines.formats import DROP_CHUNK, PROMPT_START_FIELD, RoutingPlan
from mla_watch.engines.watch import EngineMetrics

__all__ = [
    "MAX_STREAM_TOKENS",
    "REPLAY_OUTCOMES",
    "TOKEN_IDS_FIELD",
    "ReplayBudget",
    "Send",
    "StreamReplayer",
    "StreamTokens",
    "read_chunk",
    "read_chunk_apart",
]

log = logging.getLogger("mla_watch.engines")

TOKEN_IDS_FIELD = "return_token_ids"  # vLLM's request field (chat_completion/protocol.py, completion/protocol.py)
# What became of a stream's replay: replayed (counted), no_routing / data_error (vLLM's answer to the replay),
# failed (the replay got no answer), sampled_out (--replay-rate), over_token_budget, queue_full, incomplete
# (the stream ended before every choice finished: the client left, or the engine failed), no_token_ids (the
# engine sent none: not vLLM, or a reasoning parser hid them), unreadable (ids that are no token ids).
REPLAY_OUTCOMES = (
    "replayed",
    "no_routing",
    "data_error",
    "failed",
    "sampled_out",
    "over_token_budget",
    "queue_full",
    "incomplete",
    "no_token_ids",
    "unreadable",
)
MAX_STREAM_TOKENS = 1 << 20  # token ids held per stream (prompt and generated, all choices): 4 MiB as int32
MAX_WAITING_TOKENS = 1 << 23  # token ids of all the replays waiting: 32 MiB
MAX_CHOICES = 16
_TOKEN_ID_LIMIT = 1 << 31
LOG_EVERY_SECONDS = 60.0


@dataclass(frozen=True)
class ReplayBudget:
    """How much replaying streams may cost the engine (``serve --replay-*``)."""

    rate: float = 1.0  # the share of streams replayed, 0..1
    concurrency: int = 4  # replay requests in flight at once
    tokens_per_second: float = 0.0  # tokens replayed per second, all replays together; 0: no limit
    queue: int = 256  # streams waiting for a replay

    def problems(self) -> list[SettingProblem]:
        """What is wrong with the budget, each setting named as ``ServerConfig.replay`` holds it."""
        found = []
        if not 0.0 <= self.rate <= 1.0:
            found.append(SettingProblem("replay.rate", f"{self.rate:g}", "a share between 0 and 1"))
        if self.concurrency < 1:
            found.append(SettingProblem("replay.concurrency", f"{self.concurrency}", "an integer >= 1"))
        if self.tokens_per_second < 0:
            found.append(
                SettingProblem("replay.tokens_per_second", f"{self.tokens_per_second:g}", ">= 0 (0: no limit)")
            )
        if self.queue < 1:
            found.append(SettingProblem("replay.queue", f"{self.queue}", "an integer >= 1"))
        return found


@dataclass
class _Choice:
    prompt: array | None = None  # int32: a long prompt's ids as Python ints would take 9x the memory
    generated: array = field(default_factory=lambda: array("i"))
    finished: bool = False


class StreamTokens:
    """The token ids of one vLLM stream, per choice, read from its chunks as they pass.

    ``strip``: the proxy asked for the ids, not the client; they are taken out of each chunk, and a
    chat chunk vLLM sent only because ids were asked for (an empty delta that finishes nothing) is
    dropped, as vLLM drops it without them (chat_completion/serving.py, ``if delta_message is None``).
    """

    def __init__(self, kind: str, *, strip: bool) -> None:
        self.kind = kind  # "chat" or "completion"
        self.strip = strip
        self._choices: dict[int, _Choice] = {}
        self._held = 0
        self.unreadable: str | None = None  # why the ids cannot be replayed

    def take(self, chunk: dict[str, Any]) -> bool:
        """Read (and with ``strip``, remove) the ids of one chunk; False: leave the chunk out of the stream."""
        prompt = self._pop(chunk, "prompt_token_ids") if self.kind == "chat" else None
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return True
        keep = True
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index")
            if type(index) is not int or not 0 <= index < MAX_CHOICES:
                self._refuse(f"a choice index of {_kind(index)}")
                continue
            state = self._choices.setdefault(index, _Choice())
            choice_prompt = self._pop(choice, "prompt_token_ids") if self.kind == "completion" else prompt
            if choice_prompt is not None and state.prompt is None:
                state.prompt = self._ids(choice_prompt)
            generated = self._pop(choice, "token_ids")
            if generated is not None:
                state.generated += self._ids(generated)
            if choice.get("finish_reason") is not None:
                state.finished = True
            elif (
                self.strip
                and self.kind == "chat"
                and choice.get("delta") == {}
                and choice.get("logprobs") is None
                and len(choices) == 1
            ):
                keep = False
        return keep

    def replays(self) -> list[tuple[array, int]] | str:
        """Each choice's replay - the prompt to send and the prompt rows to leave out - or the outcome that
        says why there is none."""
        if self.unreadable is not None:
            return "unreadable"
        if not self._choices or any(c.prompt is None or not c.generated for c in self._choices.values() if c.finished):
            return "no_token_ids"
        if not all(choice.finished for choice in self._choices.values()):
            return "incomplete"
        replays: list[tuple[array, int]] = []
        prompts_seen: set[bytes] = set()
        for _, choice in sorted(self._choices.items()):
            prompt = choice.prompt.tobytes()  # type: ignore[union-attr]
            start = len(choice.prompt) if prompt in prompts_seen else 0  # type: ignore[arg-type]
            prompts_seen.add(prompt)
            replays.append((choice.prompt + choice.generated[:-1], start))  # type: ignore[operator]
        return replays

    def prompt_length(self) -> int | None:
        """How many tokens the prompt had, where the stream's ids said (every choice shares it)."""
        prompts = {len(choice.prompt) for choice in self._choices.values() if choice.prompt is not None}
        return prompts.pop() if len(prompts) == 1 and self.unreadable is None else None

    def samples(self) -> list[tuple[list[int], int]]:
        """Each finished choice's prompt plus completion ids and the prompt's length, to capture (``[]`` when the
        stream's ids could not be read)."""
        if self.unreadable is not None:
            return []
        return [
            ((choice.prompt + choice.generated).tolist(), len(choice.prompt))
            for _, choice in sorted(self._choices.items())
            if choice.finished and choice.prompt is not None and choice.generated
        ]

    def merge(self, other: StreamTokens) -> None:
        """Add the ids ``other`` read from one chunk (in a decoding process) to this stream's."""
        if other.unreadable is not None:
            self._refuse_as(other.unreadable)
        for index, part in other._choices.items():
            state = self._choices.setdefault(index, _Choice())
            if state.prompt is None:
                state.prompt = part.prompt
            state.generated += part.generated
            state.finished |= part.finished
            self._held += len(part.generated) + len(part.prompt or ())
        if self._held > MAX_STREAM_TOKENS:
            self._refuse(f"more than {MAX_STREAM_TOKENS} token ids")

    def _pop(self, container: dict[str, Any], key: str) -> Any:
        return container.pop(key, None) if self.strip else container.get(key)

    def _ids(self, value: Any) -> array:
        if not isinstance(value, list) or not all(type(i) is int and 0 <= i < _TOKEN_ID_LIMIT for i in value):
            self._refuse(f"token ids of {_kind(value)}")
            return array("i")
        self._held += len(value)
        if self._held > MAX_STREAM_TOKENS:
            self._refuse(f"more than {MAX_STREAM_TOKENS} token ids")
            return array("i")
        return array("i", value)

    def _refuse(self, what: str) -> None:
        self._refuse_as(f"the stream carried {what}: expected lists of token ids")

    def _refuse_as(self, why: str) -> None:
        if self.unreadable is None:
            self.unreadable = why


def read_chunk(tokens: StreamTokens, data: bytes, extra: dict[str, Any] | None) -> bytes | None:
    """One chunk of a vLLM stream (its ``data:`` JSON): its token ids into ``tokens``, and what the client
    gets: ``None`` for the chunk as it came, :data:`~mla_watch.engines.formats.DROP_CHUNK`, or new JSON
    (the ids taken out, mla_watch's object added where ``extra`` is given)."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):
        chunk = None
    if not isinstance(chunk, dict):
        tokens._refuse("a chunk that is no JSON object")
        return None
    if not tokens.take(chunk):
        return DROP_CHUNK
    if not tokens.strip and extra is None:
        return None
    if extra is not None:
        chunk["mla_watch"] = extra
    return json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()


def read_chunk_apart(
    data: bytes, kind: str, strip: bool, extra: dict[str, Any] | None
) -> tuple[bytes | None, StreamTokens]:
    """:func:`read_chunk` in a decoding process, for a chunk too long to parse on the event loop (a long
    prompt's ids): the ids come back in a :class:`StreamTokens` of their own, to :meth:`StreamTokens.merge`."""
    tokens = StreamTokens(kind, strip=strip)
    return read_chunk(tokens, data, extra), tokens


@dataclass(frozen=True)
class _Replay:
    business_line: str
    plan: RoutingPlan
    model: str | None
    headers: dict[str, str]
    prompts: list[tuple[array, int]]
    client: str | None = None


# Sends one replay (a /v1/completions body, the request's headers) and returns the engine's answer;
# raises for any answer but a 200 (the proxy's bounded exchange).
Send = Callable[[dict[str, Any], dict[str, str]], Awaitable[bytes]]


class StreamReplayer:
    """Replays finished vLLM streams within a :class:`ReplayBudget`, counting each replay's routing."""

    def __init__(
        self,
        send: Send,
        counter: CountQueue,
        budget: ReplayBudget,
        *,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._send = send
        self._counter = counter
        self.budget = budget
        self._clock = clock
        self._draw = draw
        self._waiting: asyncio.Queue[_Replay] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._tokens = budget.tokens_per_second  # the bucket starts full: one second's worth
        self._waiting_tokens = 0
        self._filled_at = clock()
        self._logged_at = float("-inf")

    @property
    def metrics(self) -> EngineMetrics:
        return self._counter.routing.metrics

    def sampled(self) -> bool:
        """Whether a stream about to start is to be replayed (``--replay-rate``); one that is not is never
        asked for its token ids."""
        return self.budget.rate >= 1.0 or self._draw() < self.budget.rate

    def skipped(self, business_line: str, outcome: str) -> None:
        """A stream that is not replayed (``sampled_out``): counted as a response without routing."""
        self._finish(business_line, outcome)

    def after_stream(
        self,
        business_line: str,
        plan: RoutingPlan,
        model: str | None,
        headers: dict[str, str],
        tokens: StreamTokens,
        *,
        client: str | None = None,
    ) -> str:
        """A stream has ended: queue its replay, or say why not (the outcome, also counted). Never waits."""
        outcome = self._admit(tokens)
        if isinstance(outcome, str):
            self._finish(business_line, outcome)
            return outcome
        self._start()
        # Counted by position as the client's prompt, not as the replay's (its prompt carries the generated tokens);
        # not by position where the stream did not say its prompt's length.
        prompt = tokens.prompt_length()
        plan = (
            dataclasses.replace(plan, prompt_tokens=prompt)
            if prompt is not None
            else dataclasses.replace(plan, position_edges=None)
        )
        self._waiting.put_nowait(  # type: ignore[union-attr]
            _Replay(
                business_line,
                plan,
                model,
                headers,
                outcome,
                client,
            )
        )
        self._waiting_tokens += sum(len(prompt) for prompt, _ in outcome)
        return "queued"

    async def close(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []

    @property
    def waiting(self) -> int:
        return 0 if self._waiting is None else self._waiting.qsize()

    # ------------------------------------------------------------------ internals
    def _admit(self, tokens: StreamTokens) -> list[tuple[array, int]] | str:
        replays = tokens.replays()
        if isinstance(replays, str):
            return replays
        size = sum(len(prompt) for prompt, _ in replays)
        if self.waiting >= self.budget.queue or (self.waiting and self._waiting_tokens + size > MAX_WAITING_TOKENS):
            return "queue_full"
        if self.budget.tokens_per_second:
            now = self._clock()
            self._tokens = min(
                self.budget.tokens_per_second, self._tokens + (now - self._filled_at) * self.budget.tokens_per_second
            )
            self._filled_at = now
            if self._tokens <= 0:
                return "over_token_budget"
            self._tokens -= size
        return replays

    def _start(self) -> None:
        if self._workers:
            return
        self._waiting = asyncio.Queue()
        for index in range(self.budget.concurrency):
            self._workers.append(asyncio.create_task(self._work(), name=f"mla-watch-replay-{index}"))

    async def _work(self) -> None:
        while True:
            replay = await self._waiting.get()  # type: ignore[union-attr]
            self._waiting_tokens -= sum(len(prompt) for prompt, _ in replay.prompts)
            try:
                outcome = await self._replay(replay)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the engine failed, or its answer: this stream is not counted
                self._log_failure(error)
                outcome = "failed"
            if outcome == "failed":
                self._counter.routing.count(replay.business_line, None, streamed=True)
            self.metrics.stream_replays.labels(outcome).inc()

    async def _replay(self, replay: _Replay) -> str:
        bodies = []
        for prompt, start in replay.prompts:
            payload: dict[str, Any] = {"prompt": prompt.tolist(), "max_tokens": 1, "temperature": 0, "stream": False}
            if replay.model is not None:
                payload["model"] = replay.model
            if start:
                payload[PROMPT_START_FIELD] = start
            bodies.append(await self._send(payload, replay.headers))
            self.metrics.replay_tokens.inc(len(prompt))
        counted = await self._counter.count_replay(replay.business_line, replay.plan, bodies, replay.client)
        return "replayed" if counted == "counted" else counted  # or vLLM's answer had no usable routing

    def _finish(self, business_line: str, outcome: str) -> None:
        self._counter.routing.count(business_line, None, streamed=True)
        self.metrics.stream_replays.labels(outcome).inc()

    def _log_failure(self, error: Exception) -> None:
        now = self._clock()
        if now - self._logged_at >= LOG_EVERY_SECONDS:
            self._logged_at = now
            log.warning(
                "a stream's replay failed, its routing is not counted (logged once a minute): %s",
                getattr(error, "message", None) or type(error).__name__,
            )


def _kind(value: Any) -> str:
    return f"a {type(value).__name__}" if not isinstance(value, int) or isinstance(value, bool) else repr(value)
