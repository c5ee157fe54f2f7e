"""The OpenAI-compatible endpoints: validate, apply the business line's policy, then generate here
(the local model's queue) or forward to the upstream engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mla_watch.policy.model import (
    Adjustment,
    Decision,
    PolicyRejection,
    TaskPolicy,
    UnknownBusinessLine,
    UnknownTask,
    enforce,
)
from mla_watch.policy.params import SamplingValues
from mla_watch.routing.clients import client_id
from mla_watch.server.model_worker import Job, JobTimedOut, Overloaded
from mla_watch.server.requests import ApiError, GenerationRequest, parse_generation_request
from mla_watch.server.responses import LocalCompletion, sse

if TYPE_CHECKING:
    from mla_watch.server.handler_context import HandlerContext

__all__ = ["MAX_CHARS_PER_TOKEN", "Generation"]

MAX_CHARS_PER_TOKEN = 32  # no tokenizer in use packs more characters into one token: a bound before tokenizing


class Generation:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``."""

    def __init__(self, ctx: HandlerContext) -> None:
        self.ctx = ctx

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, kind: Literal["completion", "chat"]) -> Response:
        endpoint = request.url.path
        started = time.perf_counter()
        policy_label: str | None = None
        try:
            if not self.ctx.serving.ready.is_set():
                raise ApiError(
                    503,
                    self.ctx.serving.load_error or "the model is still loading",
                    code="not_ready",
                    error_type="server_error",
                    headers={"Retry-After": "5"},
                )
            body = await self.ctx.read_json(request)
            headers = {k.lower(): v for k, v in request.headers.items()}
            parsed = parse_generation_request(kind, body, headers)
            client = client_id(
                self.ctx.config.client_id, headers, body, request.client.host if request.client is not None else None
            )
            decision, task = self._decide(parsed)
            policy_label = decision.policy_label
            self.ctx.metrics.count_adjustments(decision)
            if self.ctx.serving.upstream is not None:
                response = await self.ctx.serving.upstream.forward(request, parsed, body, decision, client)
            else:
                response = await self._generate_locally(request, parsed, decision, task, client)
        except ApiError as error:
            policy_label = policy_label or error.policy
            response = self.ctx.auth.refused(request, error)
        response.headers["X-MLA-Policy"] = policy_label or "none"
        self.ctx.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        seconds = time.perf_counter() - started
        self.ctx.metrics.request_seconds.labels(endpoint).observe(seconds)
        if self.ctx.client_latency is not None and response.status_code < 400:  # what reference readings yield to
            self.ctx.client_latency.observe(seconds)
        return response

    def _decide(self, parsed: GenerationRequest) -> tuple[Decision, TaskPolicy]:
        """The policy decision and the task policy it came from (resolved once per request)."""
        try:
            policy, task = self.ctx.policies.current.resolve(parsed.business_line, parsed.task)
        except UnknownBusinessLine as error:
            raise ApiError(400, str(error), param="X-Business-Line", code="unknown_business_line") from error
        except UnknownTask as error:
            raise ApiError(400, str(error), param="X-Task", code="unknown_task") from error
        serving = self.ctx.serving
        if parsed.model is not None and serving.upstream is None and parsed.model != serving.model_name:
            raise ApiError(
                404,
                f"model={parsed.model!r} is not served here; expected {serving.model_name!r}",
                param="model",
                code="model_not_found",
            )
        try:
            return enforce(policy, task, parsed.sampling), task
        except PolicyRejection as error:
            self.ctx.metrics.policy_rejections.labels(error.business_line, error.task, error.param).inc()
            raise ApiError(
                400,
                str(error),
                param=error.param,
                code="policy_violation",
                policy=f"{error.business_line}/{error.task}",
            ) from error
        except TypeError as error:
            raise ApiError(400, str(error), code="invalid_value") from error

    @staticmethod
    def _values(parsed: GenerationRequest, decision: Decision) -> SamplingValues:
        """The values the sampler uses, built once from the decision (defaults from the table of sampling
        parameters) with the request's seed and stop strings."""
        try:
            return SamplingValues.from_applied(decision.applied, seed=parsed.seed, stop=parsed.stop)
        except ValueError as error:  # should not happen: policy values lie in the sampler's domain
            raise ApiError(400, str(error), code="invalid_value") from error

    def _refused_by_prompt_limit(self, decision: Decision) -> None:
        """A prompt over the policy's ``max_prompt_tokens``: a refusal of the policy, counted under that parameter
        (``mla_watch_policy_rejections_total``, the status page's "refused")."""
        self.ctx.metrics.policy_rejections.labels(decision.business_line, decision.task, "max_prompt_tokens").inc()

    def _prompt_ids(self, parsed: GenerationRequest, decision: Decision, task: TaskPolicy) -> list[int]:
        """Tokenize the prompt (in a worker thread: it can take a while) and check it fits the policy."""
        assert self.ctx.serving.model_worker is not None  # generating locally: the model is in
        limit = int(self.ctx.serving.model_worker.model.config.max_position_embeddings)
        most_tokens = min(limit, task.max_prompt_tokens or limit)
        # the request parser gives a completion its prompt and a chat its messages
        chars = (
            len(cast(str, parsed.prompt))
            if parsed.kind != "chat"
            else sum(len(m["content"]) for m in cast(list[dict[str, str]], parsed.messages))
        )
        if chars > most_tokens * MAX_CHARS_PER_TOKEN:
            if most_tokens == task.max_prompt_tokens:  # the policy's limit refused it: counted as its refusal
                self._refused_by_prompt_limit(decision)
            raise ApiError(
                400,
                f"the prompt has {chars} characters; at most {most_tokens * MAX_CHARS_PER_TOKEN} "
                f"are read ({most_tokens} tokens of at most {MAX_CHARS_PER_TOKEN} characters)",
                param="messages" if parsed.kind == "chat" else "prompt",
                code="prompt_too_long",
            )
        tokenizer = self.ctx.serving.model_worker.tokenizer
        # verbose=False: a prompt longer than the model's context is refused below, in the answer; the tokenizer's
        # own "Token indices sequence length is longer than ..." warning would log it a second time
        if parsed.kind == "chat":
            encoded = tokenizer.apply_chat_template(
                parsed.messages, add_generation_prompt=True, tokenize=True, tokenizer_kwargs={"verbose": False}
            )
            ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        else:
            ids = tokenizer(parsed.prompt, add_special_tokens=False, verbose=False)["input_ids"]
        ids = [tokenizer.bos_token_id, *list(ids)]
        if task.max_prompt_tokens is not None and len(ids) > task.max_prompt_tokens:
            self._refused_by_prompt_limit(decision)
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; the {decision.policy_label} policy allows at most "
                f"{task.max_prompt_tokens}",
                param="messages" if parsed.kind == "chat" else "prompt",
                code="prompt_too_long",
            )
        return ids

    def _fit_context(
        self, parsed: GenerationRequest, decision: Decision, params: SamplingValues, prompt_tokens: int
    ) -> tuple[Decision, SamplingValues]:
        """``max_tokens`` within what the model's context leaves after the prompt.

        A value the request did not ask for itself (the policy's default or its clamp of what the request asked,
        or the API's default of 16 where no policy says) is lowered to fit, and the response reports it with the
        other adjustments; a value the request asked for itself that does not fit is a 400 that quotes it, as an
        engine would answer.
        """
        assert self.ctx.serving.model_worker is not None  # generating locally: the model is in
        limit = int(self.ctx.serving.model_worker.model.config.max_position_embeddings)
        room = limit - prompt_tokens
        if params.max_tokens <= room:
            return decision, params
        where = "messages" if parsed.kind == "chat" else "prompt"
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {prompt_tokens} tokens: the model's context of {limit} tokens "
                "leaves no room for a completion",
                param=where,
                code="context_length_exceeded",
            )
        chosen = next((a for a in decision.adjustments if a.param == "max_tokens"), None)
        if chosen is None and "max_tokens" in parsed.sampling:  # the request's own value
            raise ApiError(
                400,
                f"the prompt has {prompt_tokens} tokens and max_tokens is {params.max_tokens}: "
                f"{prompt_tokens + params.max_tokens} exceeds the model's context of {limit} tokens",
                param=where,
                code="context_length_exceeded",
            )
        if chosen is None:  # the API's default: no policy says, and the request did not ask
            adjustments = (*decision.adjustments, Adjustment("max_tokens", None, room))
        else:
            adjustments = tuple(
                Adjustment("max_tokens", a.requested, room) if a is chosen else a for a in decision.adjustments
            )
        decision = replace(decision, applied={**decision.applied, "max_tokens": room}, adjustments=adjustments)
        return decision, replace(params, max_tokens=room)

    async def _generate_locally(
        self, request: Request, parsed: GenerationRequest, decision: Decision, task: TaskPolicy, client: str
    ) -> Response:
        params = self._values(parsed, decision)
        prompt_ids = await asyncio.to_thread(self._prompt_ids, parsed, decision, task)
        decision, params = self._fit_context(parsed, decision, params, len(prompt_ids))
        job = Job(
            prompt_ids=prompt_ids,
            params=params,
            business_line=decision.business_line,
            deadline=self.ctx.clock() + self.ctx.config.request_timeout,
            loop=asyncio.get_running_loop(),
            prompt_tokens=len(prompt_ids),
            record_routing=self.ctx.serving.routing_layout is not None,
            client=client,
        )
        assert self.ctx.serving.model_worker is not None  # generating locally: the model is in
        try:
            self.ctx.serving.model_worker.submit(job)
        except Overloaded as error:
            self.ctx.metrics.overloaded.inc()
            raise ApiError(
                429,
                str(error),
                code="overloaded",
                error_type="rate_limit_error",
                headers={"Retry-After": str(error.retry_after)},
            ) from error
        self.ctx.metrics.queue_depth.set(self.ctx.serving.model_worker.queue_depth)
        self.ctx.metrics.prompt_tokens.labels(decision.business_line).inc(len(prompt_ids))
        answer = LocalCompletion(parsed, decision, self.ctx.serving.model_name, len(prompt_ids), params.n)
        answer.routing_layout = self.ctx.serving.routing_layout
        if parsed.stream:
            return StreamingResponse(
                self._stream(job, answer), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            while (event := await job.next_event()) is not None:
                answer.add(event)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        except Exception as error:
            raise self._job_error(error) from error
        answer.routing = job.routing
        self._served(answer, job)
        return JSONResponse(answer.body())

    def _served(self, answer: LocalCompletion, job: Job) -> None:
        """An answer given in full: its tokens, and who they were for."""
        line = answer.decision.business_line
        generated = sum(answer.completion_tokens)
        self.ctx.metrics.completion_tokens.labels(line).inc(generated)
        self.ctx.clients.add(
            line,
            cast(str, job.client),
            job.prompt_tokens + generated,  # a request's job: set
            context=job.prompt_tokens + max(answer.completion_tokens, default=0),
        )

    def _job_error(self, error: Exception) -> ApiError:
        if isinstance(error, JobTimedOut):
            self.ctx.metrics.timeouts.inc()
            return ApiError(
                503,
                f"{error} (timeout {self.ctx.config.request_timeout:g} s)",
                code="timeout",
                error_type="server_error",
                headers={"Retry-After": "1"},
            )
        return ApiError(500, str(error), code="generation_failed", error_type="server_error")

    async def _stream(self, job: Job, answer: LocalCompletion) -> AsyncIterator[bytes]:
        finished = False
        try:
            yield sse(answer.first_chunk())
            while (event := await job.next_event()) is not None:
                chunk = answer.add(event)
                if chunk is not None:
                    yield sse(chunk)
            answer.routing = job.routing
            routing = answer.routing_chunk()
            if routing is not None:  # SGLang's place: one chunk of its own after the last token
                yield sse(routing)
            if answer.parsed.include_usage:
                yield sse(answer.usage_chunk())
            yield b"data: [DONE]\n\n"
            finished = True
            self._served(answer, job)
        except Exception as error:
            api_error = self._job_error(error)
            yield sse(api_error.body())
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away mid-stream: free the model for others
                job.cancelled.set()
                self.ctx.metrics.client_disconnects.inc()
