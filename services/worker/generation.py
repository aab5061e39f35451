"""Running the choices of one HTTP request on the engine and merging their output streams.

One HTTP request becomes `len(prompts) * n` engine requests ("choices"), each with its own
id and `SamplingParams.for_choice(i)`. Their streams are merged into one async iterator of
(choice, output). Leaving `running_choices` early (client gone, error, cancellation) closes
every engine stream and aborts the requests that had not finished, so their KV blocks are
freed within one engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.common.errors import (
    ApiError,
    BadRequestError,
    InternalServerError,
    ServiceUnavailableError,
)
from services.worker.engine_client import EngineClient
from shared.engine.kv_connector import KVRequestOptions
from shared.engine.outputs import RequestOutput, TokenLogprob
from shared.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for the engine; `text` is kept for `echo`."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class ChoiceJob:
    """One engine request: choice `index` of the response, generated from `prompt_index`."""

    index: int
    prompt_index: int
    engine_request_id: str
    params: SamplingParams


@dataclass
class ChoiceState:
    """What a choice produced so far (cumulative), plus streaming bookkeeping."""

    job: ChoiceJob
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    started: bool = False  # streaming: the first chunk (role / echo) was sent
    text_offset: int = 0  # completions logprobs: offset of the next token in the text

    def update(self, out: RequestOutput) -> None:
        self.token_ids = out.token_ids
        self.text = out.text
        self.num_cached_tokens = out.num_cached_tokens
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason.value if out.finish_reason else "stop"
            self.stop_reason = out.stop_reason


class EngineRequestError(Exception):
    """The engine refused or failed one of the choices; `api_error` is what the client gets."""

    def __init__(self, api_error: ApiError) -> None:
        super().__init__(api_error.message)
        self.api_error = api_error

    def for_request(self, request_id: str | None) -> ApiError:
        """`api_error` with the request's id (X-Request-Id) in its message, as the client gets
        it: one id ties the client's error to the worker's log and the router's."""
        err = self.api_error
        return type(err)(f"{err.message} (request id {request_id})", param=err.param,
                         code=err.code, headers=err.headers)


ENGINE_FAILED = "engine_failed"  # error code (and /health reason) once the engine has failed


def _engine_failure(engine: EngineClient, exc: BaseException | None, message: str) -> EngineRequestError:
    """Classify a failure. The engine failed: a request it was running gets 500, one it
    refused 503 (both `engine_failed`); engine stopped -> 503; request refused (ValueError)
    -> 400; anything else (e.g. NaN logits for this request) -> 500 `engine_error`."""
    if engine.failure is not None:
        if exc is None:
            return EngineRequestError(InternalServerError(
                f"The engine failed while running this request: {message}", code=ENGINE_FAILED))
        return EngineRequestError(ServiceUnavailableError(
            f"The engine is not running: {message}", code=ENGINE_FAILED))
    if not engine.healthy:
        return EngineRequestError(ServiceUnavailableError(
            f"The engine is not running: {message}", code="engine_dead"))
    if isinstance(exc, ValueError):
        return EngineRequestError(BadRequestError(f"Request refused by the engine: {message}"))
    return EngineRequestError(InternalServerError(f"Generation failed: {message}", code="engine_error"))


class _StreamEnd:
    """Queue sentinel: one choice's stream ended."""


# What the pumps hand the merger: an output, the exception that ended a stream, or its end.
Outputs = asyncio.Queue[tuple[ChoiceJob, RequestOutput | BaseException | _StreamEnd]]


async def _pump(engine: EngineClient, job: ChoiceJob, prompt_ids: list[int], queue: Outputs,
                kv: KVRequestOptions | None) -> None:
    stream = engine.generate(job.engine_request_id, prompt_ids, job.params, kv)
    try:
        async for out in stream:
            await queue.put((job, out))
    except Exception as exc:  # handed to the consumer, which reports it to the client
        await queue.put((job, exc))
        return
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    await queue.put((job, _StreamEnd()))


@contextlib.asynccontextmanager
async def running_choices(engine: EngineClient, jobs: list[ChoiceJob],
                          prompts: list[PreparedPrompt], kv: KVRequestOptions | None = None,
                          ) -> AsyncIterator[AsyncIterator[tuple[ChoiceJob, RequestOutput]]]:
    """Start every choice on the engine; yields an iterator of (job, output) as the engine
    produces them, until every choice has finished.

    The engine requests exist once this is entered (each pump's first step submits its request
    before the body runs), so a decode leg can hand its KV to them right away. `kv` goes to
    every `engine.generate` call (the P/D legs: HOLD, AWAIT_REMOTE). Leaving, however early,
    aborts the unfinished requests at once, which frees their KV blocks.
    """
    queue: Outputs = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(engine, job, prompts[job.prompt_index].token_ids, queue, kv))
             for job in jobs]
    unfinished = {job.engine_request_id for job in jobs}
    try:
        await asyncio.sleep(0)  # every pump runs up to its first await: requests submitted
        yield _merged(engine, queue, unfinished, len(jobs))
    finally:
        # Abort first: it is synchronous, so it happens even if we are cancelled again below.
        for request_id in unfinished:
            try:
                engine.abort(request_id)
            except Exception:  # engine already down: nothing left to free
                log.debug("abort of %s failed", request_id, exc_info=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(engine: EngineClient, queue: Outputs, unfinished: set[str], open_streams: int,
                  ) -> AsyncIterator[tuple[ChoiceJob, RequestOutput]]:
    while open_streams:
        job, item = await queue.get()
        if isinstance(item, _StreamEnd):
            open_streams -= 1
            if job.engine_request_id in unfinished:
                raise _engine_failure(engine, None, f"stream of choice {job.index} ended early")
            continue
        if isinstance(item, BaseException):
            raise _engine_failure(engine, item, str(item)) from item
        if item.error is not None:
            raise _engine_failure(engine, None, item.error)
        if item.finished:
            unfinished.discard(job.engine_request_id)
        yield job, item
