"""A small test dispatcher playing the router's part in front of P/D workers
(tests.support.worker runs them), and the client side: answers, metadata, block accounting.

The dispatcher sends the two legs as the router does (services/router/legs.py): pull is
prefill then decode with the prefill's `kv_transfer_params`, push sends both legs at once with
one transfer id.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from services.common.signing import signed_json
from shared.protocol.pd import PrefillLegParams, PushDecodeParams, TransferMode

# The real-model P/D checks (pd and pipeline tests): a chat and a long, chunked completion.
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user",
                                            "content": "What is the capital of France?"}]}),
    ("/v1/completions", {"prompt": "Here is a short history of the printing press. " * 25}),
]


# ---- the test dispatcher -------------------------------------------------------------


@dataclass
class Answer:
    """What the client got: status, the JSON body (or the stream's chunks), and token ids."""

    status: int
    body: dict[str, Any] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    prefill: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def phases(self) -> dict[str, Any]:
        """What the decode reported about its KV (x-pdmesh-phases)."""
        return json.loads(self.headers.get("x-pdmesh-phases", "{}"))

    @property
    def error(self) -> dict[str, Any] | None:
        if "error" in self.body:
            return self.body["error"]
        return next((c["error"] for c in self.chunks if "error" in c), None)

    @property
    def token_ids(self) -> list[int]:
        if self.chunks:
            return [t for c in self.chunks for ch in c.get("choices", [])
                    for t in ch.get("token_ids") or []]
        return self.body["choices"][0]["token_ids"]

    @property
    def text(self) -> str:
        if self.chunks:
            return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                           for c in self.chunks for ch in c.get("choices", []))
        choice = self.body["choices"][0]
        return choice.get("text") if "text" in choice else choice["message"]["content"]


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               secret: bytes | None = None) -> Answer:
    """POST a completion (JSON or SSE) and collect the answer, signed with the mesh's KV
    `secret` if given (as the router signs). A worker that vanished mid-request becomes a 502
    envelope here, as the router reports it to its client."""
    try:
        return await _post(session, url, body, secret)
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
        return Answer(502, {"error": {"message": f"upstream {url} failed: {exc!r}",
                                      "type": "server_error", "param": None,
                                      "code": "upstream_unreachable"}})


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                secret: bytes | None) -> Answer:
    data, headers = signed_json(secret, URL(url).path, body)
    async with session.post(url, data=data, headers=headers) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        if resp.content_type != "text/event-stream":
            return Answer(resp.status, await resp.json(), headers=headers)
        chunks = []
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
        return Answer(resp.status, chunks=chunks, headers=headers)


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    out.pop("stream_options", None)
    return out


async def dispatch_pull(session: aiohttp.ClientSession, prefill: str, decode: str,
                        path: str, body: dict[str, Any], secret: bytes | None = None) -> Answer:
    """Prefill, then decode (both legs signed with `secret`, if given, as the router signs).
    A client gone after the prefill answered gets the prefill's lease aborted (in the
    background: we are being cancelled), as a router does."""
    pre = await post(session, prefill + path, prefill_body(body, PrefillLegParams().to_wire()),
                     secret)
    if pre.status != 200:
        return pre
    params = pre.body["kv_transfer_params"]
    try:
        answer = await post(session, decode + path, {**body, "kv_transfer_params": params},
                            secret)
    except asyncio.CancelledError:
        _background(session.post(f"{prefill}/v1/kv_transfer/abort",
                                 json={"kv_transfer_params": params}))
        raise
    answer.prefill = pre.body
    return answer


_BACKGROUND: set[asyncio.Task] = set()


def _background(request: Any) -> None:
    async def run() -> None:
        async with request as resp:
            await resp.read()

    task = asyncio.ensure_future(run())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def dispatch_push(session: aiohttp.ClientSession, prefill: str, decode: str,
                        path: str, body: dict[str, Any], prefill_meta: dict[str, Any]) -> Answer:
    """Both legs at once; a failed decode cancels the prefill leg (as the router does)."""
    tid = uuid.uuid4().hex
    to_p = PrefillLegParams(TransferMode.PUSH, tid).to_wire()
    to_d = PushDecodeParams(tid, prefill_meta["kv_host"], prefill_meta["kv_port"],
                            prefill_meta["engine_id"],
                            prefill_meta["kv_endpoint"].get("tls", False)).to_wire()
    pre = asyncio.ensure_future(post(session, prefill + path, prefill_body(body, to_p)))
    try:
        answer = await post(session, decode + path, {**body, "kv_transfer_params": to_d})
        if answer.status == 200:
            answer.prefill = (await pre).body
        return answer
    finally:
        if not pre.done():
            pre.cancel()
        await asyncio.gather(pre, return_exceptions=True)


async def metadata(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/metadata") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def blocks_in_use(session: aiohttp.ClientSession, url: str) -> tuple[int, int, int]:
    """(engine blocks in use, engine held blocks, KV-service held blocks) of one worker."""
    md = await metadata(session, url)
    kv = md.get("kv_transfer") or {}
    return (md["kv_cache"]["num_used_blocks"], md["kv_cache"]["num_held_blocks"],
            kv.get("held_blocks", 0))


async def settle_to_zero(session: aiohttp.ClientSession, *urls: str,
                         timeout: float = 10.0) -> None:
    """Wait until every worker holds no block (background releases take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        counts = {url: await blocks_in_use(session, url) for url in urls}
        if all(c == (0, 0, 0) for c in counts.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use (used, held, leased): {counts}")
        await asyncio.sleep(0.05)
