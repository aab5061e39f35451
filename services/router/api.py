"""Client-facing handlers: completions, chat, models, tokenize, detokenize.

Generation requests pass admission, then the orchestrator; the rest are proxied to one usable
worker (another is tried if it fails). Worker errors reach the client with their own status and
envelope; the router's own (no servable group, queue) use the same envelope.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

from aiohttp import web

from services.common.errors import ApiError, BadRequestError, ServiceUnavailableError
from services.common.json_body import json_response, read_json_object
from services.common.middleware import REQUEST_ID_KEY
from services.common.openai_fields import STREAM_OPTIONS
from services.router.orchestrator import ClientRequest
from services.router.phases import Phases
from services.router.state import STATE_KEY, RouterState
from services.router.upstream import UpstreamFailure
from shared.protocol.pd import ApiKind


def _validate(body: dict[str, Any]) -> None:
    """Checks the prefill rewrite would hide from the worker (it drops these fields)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is None:
        return
    if not stream:
        raise BadRequestError("'stream_options' is only allowed when 'stream' is true",
                              param="stream_options")
    if not isinstance(options, dict):
        raise BadRequestError("'stream_options' must be an object", param="stream_options")
    for field in STREAM_OPTIONS:  # booleans: the router's own early chunks follow them too
        value = options.get(field.name)
        if value is not None and not isinstance(value, bool):
            raise BadRequestError(f"'stream_options.{field.name}' must be a boolean",
                                  param=f"stream_options.{field.name}")


async def _generate(request: web.Request, kind: ApiKind, path: str) -> web.StreamResponse:
    phases = Phases()
    state = request.app[STATE_KEY]
    status = 500
    try:
        body = await read_json_object(request)
        _validate(body)
        req = ClientRequest(kind, path, body, request[REQUEST_ID_KEY], request, phases)
        async with state.admission.slot() as waited:
            state.metrics.queue_depth.set(state.admission.depth)
            state.metrics.inflight.set(state.admission.inflight)
            phases.queue_ms = waited * 1000.0
            state.metrics.queue_time.observe(waited)
            resp = await state.rt.orchestrator.serve(req)
        status = resp.status
        return resp
    except ApiError as err:
        status = err.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's convention)
        raise
    finally:
        _observe(state, path, status, phases)


def _observe(state: RouterState, path: str, status: int, phases: Phases) -> None:
    m = state.metrics
    m.requests.labels(path, str(status)).inc()
    m.queue_depth.set(state.admission.depth)
    m.inflight.set(state.admission.inflight)
    if status == 200:
        if phases.first_token_ms is not None:
            m.ttft.observe(phases.first_token_ms / 1000.0)
        m.e2e.observe(time.monotonic() - phases.start)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ApiKind.COMPLETIONS, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ApiKind.CHAT, "/v1/chat/completions")


async def _proxy(request: web.Request, path: str, body: dict[str, Any] | None) -> web.Response:
    """One usable worker answers (least in flight first); a second is tried on a retryable
    failure. Non-retryable worker errors are returned as they are."""
    state = request.app[STATE_KEY]
    workers = sorted(state.registry.usable(), key=lambda w: w.inflight)[:2]
    if not workers:
        raise ServiceUnavailableError(state.registry.unservable_reason(), code="no_usable_worker",
                                      headers={"x-should-retry": "true", "Retry-After": "1"})
    last: UpstreamFailure | None = None
    for worker in workers:
        try:
            if body is None:
                doc = await state.rt.upstream.get_json(worker.id, worker.url + path,
                                                       state.config.health_timeout_s)
            else:
                doc, _ = await state.rt.upstream.post_json(worker.id, worker.url + path, body,
                                                           request[REQUEST_ID_KEY])
            return json_response(doc)
        except UpstreamFailure as failure:
            last = failure
            if not failure.retryable:
                break
    assert last is not None
    raise last.to_api_error()


async def list_models(request: web.Request) -> web.Response:
    return await _proxy(request, "/v1/models", None)


async def retrieve_model(request: web.Request) -> web.Response:
    # The worker answers: it knows its served names; its 404 comes back as it is.
    return await _proxy(request, "/v1/models/" + quote(request.match_info["model"], safe="/"),
                        None)


async def tokenize(request: web.Request) -> web.Response:
    return await _proxy(request, "/tokenize", await read_json_object(request))


async def detokenize(request: web.Request) -> web.Response:
    return await _proxy(request, "/detokenize", await read_json_object(request))


def routes() -> list[web.AbstractRouteDef]:
    return [
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", retrieve_model),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
    ]
