"""The router's REST surface as OpenAPI operations (served at GET /openapi.json).

Client endpoints take the bodies the workers validate (the router forwards them), so their
schemas are the same field tables (services/common/openai_fields.py). Tests check that this
list covers every route of the app and which credential each needs.
"""

from __future__ import annotations

from typing import Any

from services.common.openai_fields import CHAT, COMPLETION, DETOKENIZE, TOKENIZE
from services.common.openapi import (
    TEXT,
    Credential,
    Operation,
    document,
    obj,
    openapi_operation,
)
from services.common.schema import Field, Kind, table
from shared.protocol.pd import Role

# POST /workers (admin.add_worker checks these members).
ADD_WORKER = table(
    Field("url", Kind.STRING, required=True, doc="The worker's http(s) base URL."),
    Field("role", Kind.CHOICE, choices=tuple(r.value for r in Role),
          doc="Taken from the worker's /v1/metadata if omitted."),
)
COMPLETION_ANSWER = obj("id", "object", "created", "model", "choices")
OPERATIONS = (
    Operation("POST", "/v1/completions", "Text completion (OpenAI), routed", request=COMPLETION,
              answer=COMPLETION_ANSWER, streams=True),
    Operation("POST", "/v1/chat/completions", "Chat completion (OpenAI), routed", request=CHAT,
              answer=COMPLETION_ANSWER, streams=True),
    Operation("GET", "/v1/models", "Served model names", answer=obj("object", "data")),
    Operation("GET", "/v1/models/{model}", "One served model (404 model_not_found otherwise)",
              answer=obj("id", "object", "created", "owned_by")),
    Operation("POST", "/tokenize", "Prompt or chat to token ids (vLLM)", request=TOKENIZE,
              answer=obj("count", "max_model_len", "tokens")),
    Operation("POST", "/detokenize", "Token ids to text (vLLM)", request=DETOKENIZE,
              answer=obj("prompt")),
    Operation("GET", "/v1/router/metadata", "The router, its workers and compatibility groups",
              answer=obj("router", "workers", "groups", "servable")),
    Operation("GET", "/workers", "The registered workers", answer=obj("workers", "counts")),
    Operation("POST", "/workers", "Register a worker (validated by a background job)",
              Credential.ADMIN, request=ADD_WORKER, answer=obj("job_id", "state"), status=202),
    Operation("GET", "/workers/jobs/{job_id}", "A registration job",
              answer=obj("job_id", "state")),
    Operation("DELETE", "/workers/{worker_id}", "Remove a worker (by id or URL)",
              Credential.ADMIN, answer=obj("id", "url", "removed")),
    Operation("GET", "/health", "Readiness: 200 while a compatibility group can serve",
              Credential.OPEN, answer=obj("status")),
    Operation("GET", "/live", "Liveness: always 200", Credential.OPEN, answer=obj("status")),
    Operation("GET", "/metrics", "Prometheus metrics", Credential.OPEN, media_type=TEXT,
              answer={"type": "string"}),
    openapi_operation(),
)


def router_document() -> dict[str, Any]:
    return document("pdmesh router", OPERATIONS)
