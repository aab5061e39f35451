"""The worker's route table and its thin handlers (parse -> service -> JSON).

Readiness (503), auth (401), body limits (413) and error envelopes are middlewares; the
handlers below can assume a loaded engine on every path the readiness gate guards.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from services.common.errors import BadRequestError, ServiceUnavailableError
from services.common.json_body import json_response, read_json_object
from services.common.lifecycle import LIFECYCLE_KEY
from services.common.openai_fields import DETOKENIZE, TOKENIZE
from services.common.openapi import openapi_route
from services.worker.chat_messages import parse_messages
from services.worker.fields import Fields, invalid
from services.worker.generation import ENGINE_FAILED
from services.worker.generation_defaults import with_defaults
from services.worker.leg_auth import is_trusted_leg_caller
from services.worker.metadata import build_metadata
from services.worker.openai_protocol import (
    parse_chat_request,
    parse_completion_request,
    parse_template_options,
)
from services.worker.openapi import worker_document
from services.worker.runtime import WorkerRuntime
from services.worker.serving import GenerationService
from shared.engine.stats import EngineStats

MODEL_DEGRADED = "model_degraded"  # /health reason after non-finite logits
RUNTIME_KEY = web.AppKey("worker_runtime", WorkerRuntime)
STARTED_AT_KEY = web.AppKey("started_at", int)


def _service(request: web.Request) -> GenerationService:
    service = request.app[RUNTIME_KEY].service
    assert service is not None, "the readiness gate only lets requests through once loaded"
    return service


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    service = _service(request)
    with service.leg(body, trusted=is_trusted_leg_caller(request)) as leg:  # parsed first: a leg refused for any reason is let go
        req = parse_completion_request(with_defaults(body, service.sampling_defaults))
        return await service.completion(request, req, leg)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json_object(request)
    service = _service(request)
    with service.leg(body, trusted=is_trusted_leg_caller(request)) as leg:
        req = parse_chat_request(with_defaults(body, service.sampling_defaults))
        return await service.chat(request, req, leg)


async def kv_transfer_abort(request: web.Request) -> web.Response:
    """POST /v1/kv_transfer/abort {"kv_transfer_params": <what this prefill returned>}: the
    client left between the legs, so the dispatcher frees the prefill's lease now."""
    body = await read_json_object(request)
    pd_legs = _service(request).pd_legs
    if pd_legs is None:
        raise BadRequestError("this worker has no KV-transfer service (role mixed)",
                              code="kv_wrong_role")
    return json_response({"released": pd_legs.abort_offer(body.get("kv_transfer_params"))})


def _model_card(request: web.Request, name: str) -> dict[str, Any]:
    """One served name as OpenAI's model object, with vLLM's extra fields."""
    service = _service(request)
    return {"id": name, "object": "model", "created": request.app[STARTED_AT_KEY],
            "owned_by": "pdmesh", "root": service.config.engine.model, "parent": None,
            "max_model_len": service.engine.max_model_len, "permission": []}


async def list_models(request: web.Request) -> web.Response:
    names = _service(request).config.model_names
    return json_response({"object": "list", "data": [_model_card(request, n) for n in names]})


async def retrieve_model(request: web.Request) -> web.Response:
    """OpenAI's GET /v1/models/{model} (the SDK's `models.retrieve`): the card of one served
    name (which may hold slashes, as `org/name` does), or 404 model_not_found."""
    name = _service(request).resolve_model(request.match_info["model"])
    return json_response(_model_card(request, name))


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {model, prompt | messages, add_special_tokens} -> {count, max_model_len, tokens}."""
    body = await read_json_object(request)
    service = _service(request)
    f = Fields(body)
    service.resolve_model(f.read(TOKENIZE["model"]))
    builder = service.prompts
    text: str | None
    add_special: bool | None = f.read(TOKENIZE["add_special_tokens"])
    if f.has("messages"):
        messages = list(parse_messages(f.read(TOKENIZE["messages"])))
        text = builder.render_chat(messages, parse_template_options(f, TOKENIZE), None)
        add_special = False if add_special is None else add_special
    else:
        text = f.read(TOKENIZE["prompt"])
        if text is None:
            raise BadRequestError("Either 'prompt' or 'messages' is required", param="prompt")
        add_special = True if add_special is None else add_special
    tokens = builder.encode(text, add_special, "messages" if "messages" in body else "prompt")
    result: dict[str, Any] = {"count": len(tokens), "max_model_len": builder.max_model_len,
                              "tokens": tokens}
    if f.read(TOKENIZE["return_token_strs"]):
        result["token_strs"] = [service.formatter.token_text(t) for t in tokens]
    return json_response(result)


async def detokenize(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    service = _service(request)
    f = Fields(body)
    service.resolve_model(f.read(DETOKENIZE["model"]))
    tokens = f.array("tokens")
    if tokens is None:
        raise invalid("tokens", "missing required field")
    service.prompts.check_token_ids(f.read(DETOKENIZE["tokens"]), "tokens")
    return json_response({"prompt": service.prompts.tokenizer.decode(tokens, skip_special_tokens=False)})


async def health(request: web.Request) -> web.Response:
    """200 once the model is loaded and warm and the engine is healthy; else 503 with an
    error envelope whose code is the reason (not_ready, draining, startup_failed,
    engine_failed, model_degraded). Read-only: the engine's failure listener moves the
    lifecycle."""
    lifecycle = request.app[LIFECYCLE_KEY]
    engine = request.app[RUNTIME_KEY].engine
    if not lifecycle.ready:
        raise lifecycle.unavailable()
    if engine is None or not engine.healthy:  # failed a moment ago: the listener is queued
        raise ServiceUnavailableError(f"The engine is not running: {engine and engine.failure}",
                                      code=ENGINE_FAILED, headers={"Retry-After": "1"})
    check_logits(engine.stats(), request.app[RUNTIME_KEY].config.degraded_hold_seconds)
    return json_response({"status": "ok"})


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while the event loop answers, whatever the engine's state (a loading or
    draining worker is alive; /health is the readiness check)."""
    return json_response({"status": "alive"})


def degraded_for(stats: EngineStats, hold_s: float) -> float | None:
    """Seconds left of the `model_degraded` hold after NaN/inf logits, or None."""
    at = stats.non_finite_logits_at
    if at is None or time.monotonic() - at >= hold_s:
        return None
    return hold_s - (time.monotonic() - at)


def check_logits(stats: EngineStats, hold_s: float) -> None:
    """503 `model_degraded` for `hold_s` after the model produced NaN/inf logits (readiness
    fails, so load balancers move traffic away; the engine itself still runs)."""
    left = degraded_for(stats, hold_s)
    if left is not None:
        raise ServiceUnavailableError(
            f"The model produced non-finite logits (NaN or inf) {hold_s - left:.1f} s ago; "
            f"{stats.num_non_finite_logits} requests failed so since start",
            code=MODEL_DEGRADED, headers={"Retry-After": str(max(1, round(left)))})


async def metadata(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME_KEY]
    service = _service(request)
    doc = build_metadata(runtime.config, service.engine, runtime.admission.active,
                         runtime.kv_link)
    doc["parsers"] = service.chat_format.parsers.describe()  # a gpt-oss model's defaults too
    # A router reads only this document: it must see a degraded model as /health does.
    left = degraded_for(service.engine.stats(), runtime.config.degraded_hold_seconds)
    doc["health"] = ({"status": "ok"} if left is None else
                     {"status": MODEL_DEGRADED, "reason": "non-finite logits (NaN or inf)",
                      "retry_after_s": round(left, 1)})
    return json_response(doc)


def routes(runtime: WorkerRuntime) -> list[web.AbstractRouteDef]:
    return [
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/kv_transfer/abort", kv_transfer_abort),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", retrieve_model),
        web.get("/v1/metadata", metadata),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/health", health),
        web.get("/live", live),
        web.get("/metrics", make_aiohttp_handler(runtime.metrics.registry)),
        openapi_route(worker_document()),
    ]
