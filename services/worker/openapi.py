"""The worker's REST surface as OpenAPI operations (served at GET /openapi.json).

Request bodies are the field tables the handlers validate with (services/common/
openai_fields.py); tests check that this list covers every route of the app.
"""

from __future__ import annotations

from typing import Any

from services.common.openai_fields import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    KV_TRANSFER_ABORT,
    TOKENIZE,
)
from services.common.openapi import (
    TEXT,
    Credential,
    Operation,
    document,
    obj,
    openapi_operation,
)

COMPLETION_ANSWER = obj("id", "object", "created", "model", "choices")
OPERATIONS = (
    Operation("POST", "/v1/completions", "Text completion (OpenAI)", request=COMPLETION,
              answer=COMPLETION_ANSWER, streams=True),
    Operation("POST", "/v1/chat/completions", "Chat completion (OpenAI)", request=CHAT,
              answer=COMPLETION_ANSWER, streams=True),
    Operation("POST", "/v1/kv_transfer/abort", "Release a prefill's KV lease (P/D, internal)",
              request=KV_TRANSFER_ABORT, answer=obj("released")),
    Operation("GET", "/v1/models", "Served model names", answer=obj("object", "data")),
    Operation("GET", "/v1/models/{model}", "One served model (404 model_not_found otherwise)",
              answer=obj("id", "object", "created", "owned_by")),
    Operation("GET", "/v1/metadata", "Model, engine, KV-cache and role facts",
              answer=obj("model")),
    Operation("POST", "/tokenize", "Prompt or chat to token ids (vLLM)", request=TOKENIZE,
              answer=obj("count", "max_model_len", "tokens")),
    Operation("POST", "/detokenize", "Token ids to text (vLLM)", request=DETOKENIZE,
              answer=obj("prompt")),
    Operation("GET", "/health", "Readiness: 200 when serving, else 503 naming the reason",
              Credential.OPEN, answer=obj("status")),
    Operation("GET", "/live", "Liveness: 200 while the event loop answers, whatever the "
              "engine's state", Credential.OPEN, answer=obj("status")),
    Operation("GET", "/metrics", "Prometheus metrics", Credential.OPEN, media_type=TEXT,
              answer={"type": "string"}),
    openapi_operation(),
)


def worker_document() -> dict[str, Any]:
    return document("pdmesh worker", OPERATIONS)
