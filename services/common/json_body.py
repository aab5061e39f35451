"""Reading a request body as a JSON object, with 400/413 in the OpenAI envelope."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from services.common.errors import BadRequestError


def _reject_constant(name: str) -> Any:
    # json accepts NaN/Infinity by default; they are not JSON and break range checks.
    raise ValueError(f"{name} is not valid JSON")


# A \uD800-\uDFFF escape: the body may hold a lone surrogate (valid JSON, invalid Unicode).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a dict; malformed JSON, bad UTF-8 or a non-object top level raise 400.

    Strings with unpaired surrogates are refused too: tokenizers and UTF-8 encoders reject
    them deep in the stack. The (recursive) check runs only when the raw body has an escape
    in the surrogate range, which well-formed pairs (escaped emoji) also trigger.
    """
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise BadRequestError(f"Malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise BadRequestError("The request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise BadRequestError("The body holds a string with an unpaired UTF-16 surrogate",
                              code="invalid_json")
    return value


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """Read (bounded by the app's client_max_size: 413 past it) and parse the body."""
    raw = await request.read()
    return parse_json_object(raw)


def dumps(value: Any) -> str:
    """Compact JSON; NaN/Infinity are refused (callers sanitise floats first)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(value, status=status, headers=headers, dumps=dumps)
