"""OpenAPI 3.1 documents generated from the services' operation lists and field tables.

Each service lists its operations (`Operation`: method, path, request table, answer schema,
credential); `document()` turns the list into the document its `GET /openapi.json` serves.
Request bodies come from the same `FieldTable`s the handlers validate with (schema.py), so
the document cannot drift from what the server accepts; a test checks that every route of an
app is documented and that the document is valid OpenAPI 3.1.

Every operation documents the OpenAI error envelope as its `default` answer: any 4xx/5xx
carries it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any

from aiohttp import web

from services.common.json_body import json_response
from services.common.schema import FieldTable

OPENAPI_PATH = "/openapi.json"
ERROR_ENVELOPE: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "integer", "null"]}}}}}

TEXT = "text/plain"
# One server-sent event (as schemathesis reads a stream): `data` is a chunk's JSON, an error
# envelope, or "[DONE]" last.
SSE_EVENT: dict[str, Any] = {"type": "object", "required": ["data"],
                             "properties": {"data": {"type": "string"},
                                            "event": {"type": "string"}}}


def obj(*required: str) -> dict[str, Any]:
    """An object schema naming its required members (others allowed)."""
    return {"type": "object", "required": list(required)}


class Credential(enum.Enum):
    """Who may call an operation (the security scheme it names)."""

    OPEN = "open"  # probes and metrics
    API_KEY = "apiKey"  # the client API key, when the service has keys configured
    ADMIN = "adminToken"  # the router's admin token


SECURITY_SCHEMES: dict[str, Any] = {
    Credential.API_KEY.value: {
        "type": "http", "scheme": "bearer",
        "description": "A client API key (--api-key); not checked when none is configured."},
    Credential.ADMIN.value: {
        "type": "http", "scheme": "bearer",
        "description": "The router's admin token (--admin-token); changes fail closed "
                       "without one."},
}


@dataclass(frozen=True)
class Operation:
    """One method on one path: what it takes and what a success looks like."""

    method: str
    path: str
    summary: str
    credential: Credential = Credential.API_KEY
    request: FieldTable | None = None  # a JSON object body
    answer: Mapping[str, Any] | None = None  # the JSON schema of a success (any object)
    status: int = 200
    streams: bool = False  # a success may be text/event-stream instead
    media_type: str = "application/json"  # of a success

    def spec(self) -> dict[str, Any]:
        answer = dict(self.answer) if self.answer is not None else {"type": "object"}
        content: dict[str, Any] = {self.media_type: {"schema": answer}}
        if self.streams:
            content["text/event-stream"] = {"schema": SSE_EVENT}
        out: dict[str, Any] = {
            "summary": self.summary,
            "operationId": f"{self.method}_{self.path}".replace("/", "_").strip("_")
                           .replace("{", "").replace("}", "").replace(".", "_"),
            "responses": {
                str(self.status): {"description": "Success", "content": content},
                "default": {"description": "An error in the OpenAI envelope", "content": {
                    "application/json": {"schema": ERROR_ENVELOPE}}}},
            "security": ([] if self.credential is Credential.OPEN
                         else [{self.credential.value: []}]),
        }
        params = [p[1:-1] for p in self.path.split("/") if p.startswith("{")]
        if params:
            out["parameters"] = [{"name": p, "in": "path", "required": True,
                                  "schema": {"type": "string"}} for p in params]
        if self.request is not None:
            out["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": self.request.object_schema()}}}
        return out


def package_version() -> str:
    try:
        return importlib_metadata.version("pdmesh")
    except importlib_metadata.PackageNotFoundError:
        return "0.0.0"


def document(title: str, operations: Sequence[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `operations`."""
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method.lower()] = op.spec()
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": package_version()},
        "paths": paths,
        "components": {"securitySchemes": SECURITY_SCHEMES},
    }


def openapi_operation(credential: Credential = Credential.OPEN) -> Operation:
    return Operation("GET", OPENAPI_PATH, "This document", credential,
                     answer={"type": "object", "required": ["openapi", "paths"]})


def openapi_route(doc: Mapping[str, Any]) -> web.RouteDef:
    """GET /openapi.json serving `doc` (built once, at app creation)."""
    async def handler(_request: web.Request) -> web.Response:
        return json_response(doc)

    return web.get(OPENAPI_PATH, handler)
