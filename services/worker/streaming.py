"""Server-sent events: `data: <json>\\n\\n` frames, ending with `data: [DONE]\\n\\n`.

An error after the stream started cannot change the HTTP status any more, so it is sent as a
`data: {"error": {...}}` event (the OpenAI SDK raises APIError on it) followed by [DONE].
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.common.errors import RESPONSE_STARTED_KEY, ApiError
from services.common.json_body import dumps

DONE_FRAME = b"data: [DONE]\n\n"


def frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload).encode("utf-8") + b"\n\n"


class SseWriter:
    """One SSE response; headers go out on `start()` (or with the first event)."""

    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.started = False

    async def start(self) -> None:
        if not self.started:
            self.started = True
            self.request[RESPONSE_STARTED_KEY] = True
            await self.response.prepare(self.request)

    async def send(self, payloads: list[dict[str, Any]]) -> None:
        """Write several events in one transport write (n>1 and finish chunks come in groups)."""
        if payloads:
            await self.start()
            await self.response.write(b"".join(frame(p) for p in payloads))

    async def send_error(self, error: ApiError) -> None:
        await self.start()
        await self.response.write(frame(error.body()))

    async def done(self) -> None:
        await self.start()
        await self.response.write(DONE_FRAME)
        await self.response.write_eof()
