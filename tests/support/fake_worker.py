"""Small in-process fake workers that implement the P/D contract, for router tests.

The "model" is deterministic: token i of a completion is the word ` w<(seed + i) % 97>` where
seed is the sum of the prompt's word codes, so a mixed worker, a P/D pair and a prefill-only
call all agree on every token, which is what the tests compare.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from services.common.stream_usage import StreamUsage, TokenCounts

MODEL = "fake-model"


def prompt_words(body: dict[str, Any]) -> list[str]:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"]).split()
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return [str(t) for t in prompt]
    return str(prompt).split()


def token_texts(body: dict[str, Any], n: int) -> list[str]:
    seed = sum(sum(map(ord, w)) for w in prompt_words(body))
    return [f" w{(seed + i) % 97}" for i in range(n)]


def expected_text(body: dict[str, Any]) -> str:
    return "".join(token_texts(body, body.get("max_tokens") or 16))


@dataclass
class Fault:
    """What the next generation request gets instead of a normal answer."""

    status: int | None = None  # answer this HTTP status with an error envelope
    cut_after: int | None = None  # stream this many tokens, then drop the connection
    hang: bool = False  # never answer (until cancelled)


@dataclass
class Rendezvous:
    """Push mode: prefills announce transfer ids here; decodes wait for theirs."""

    seen: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, transfer_id: str) -> asyncio.Event:
        return self.seen.setdefault(transfer_id, asyncio.Event())


@dataclass
class Call:
    path: str
    body: dict[str, Any]
    headers: CIMultiDict[str]
    started: float
    finished: float | None = None
    aborted: bool = False


class FakeWorker:
    """One fake worker; `calls` records every generation request (body, headers, timing)."""

    def __init__(self, role: str, *, compat_hash: str = "hash-a", transfer_mode: str = "pull",
                 rendezvous: Rendezvous | None = None, token_delay: float = 0.0,
                 prefill_delay: float = 0.0, model: str = MODEL) -> None:
        self.role = role
        self.compat_hash = compat_hash
        self.transfer_mode = transfer_mode
        self.model = model
        self.engine_id = uuid.uuid4().hex[:8]
        self.rendezvous = rendezvous or Rendezvous()
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.faults: deque[Fault] = deque()
        self.metadata_status = 200
        self.calls: list[Call] = []
        self.lease_aborts: list[dict[str, Any]] = []  # bodies of POST /v1/kv_transfer/abort
        self.decode_gate: asyncio.Event | None = None  # decode streams wait for it if set
        self.running = 0
        self._cache: set[str] = set()
        self._ids = itertools.count()
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.post("/v1/completions", self._generate), web.post("/v1/chat/completions", self._generate),
            web.get("/v1/models", self._models), web.get("/v1/models/{model:.+}", self._model),
            web.get("/v1/metadata", self._metadata),
            web.post("/tokenize", self._tokenize), web.post("/detokenize", self._detokenize),
            web.get("/health", self._health),
            web.post("/v1/kv_transfer/abort", self._lease_abort)])
        return app

    async def start(self, host: str = "127.0.0.1", port: int | None = None) -> FakeWorker:
        self.server = TestServer(self.app(), host=host, port=port)
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    def metadata(self) -> dict[str, Any]:
        return {
            "role": self.role, "engine_id": self.engine_id,
            "model": {"id": self.model, "fingerprint": "fp-1", "source": self.model},
            "dtype": "float32", "max_model_len": 2048, "block_size": 4,
            "kv_cache": {"num_total_blocks": 100, "num_used_blocks": 10, "usage": 0.1},
            "load": {"num_running": self.running, "num_waiting": 0},
            "compat_hash": self.compat_hash,
            "compat_factors": {"model": self.model, "transfer_mode": self.transfer_mode},
            "transfer_mode": self.transfer_mode,
            "kv_endpoint": {"host": "127.0.0.1", "port": 14000 + hash(self.engine_id) % 1000},
        }

    async def _metadata(self, request: web.Request) -> web.Response:
        if self.metadata_status != 200:
            return web.json_response({"error": {"message": "down", "type": "server_error",
                                                "param": None, "code": None}},
                                     status=self.metadata_status)
        return web.json_response(self.metadata())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _lease_abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lease_aborts.append(body)
        return web.json_response({"released": True})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model:
            return web.json_response({"error": {
                "message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}}, status=404)
        return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "fake"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        tokens = [sum(map(ord, w)) % 1000 for w in prompt_words(body)]
        return web.json_response({"count": len(tokens), "max_model_len": 2048, "tokens": tokens})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": " ".join(map(str, body["tokens"]))})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        call = Call(request.path, body, CIMultiDict(request.headers), time.monotonic())
        self.calls.append(call)
        self.running += 1
        try:
            return await self._serve(request, body, call)
        except (asyncio.CancelledError, ConnectionResetError):
            call.aborted = True
            raise
        finally:
            self.running -= 1
            call.finished = time.monotonic()

    async def _serve(self, request: web.Request, body: dict[str, Any], call: Call) -> web.StreamResponse:
        fault = self.faults.popleft() if self.faults else None
        if fault and fault.hang:
            await asyncio.Event().wait()
        if fault and fault.status:
            return _error(fault.status, f"injected {fault.status}")
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return await self._prefill(request, body, params)
        if params.get("do_remote_prefill"):
            err = await self._await_kv(params)
            if err is not None:
                return err
        return await self._complete(request, body, fault, call)

    async def _prefill(self, request: web.Request, body: dict[str, Any],
                       params: dict[str, Any]) -> web.Response:
        if self.role != "prefill":
            return _error(400, "not a prefill worker")
        await asyncio.sleep(self.prefill_delay)
        key = " ".join(prompt_words(body))
        cached = len(prompt_words(body)) // 4 * 4 if key in self._cache else 0
        self._cache.add(key)
        if params.get("transfer_id"):
            self.rendezvous.event(params["transfer_id"]).set()
        doc = _completion(request.path, body, token_texts(body, 1), "length", f"p{next(self._ids)}")
        doc["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        doc["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id, "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": request.headers.get("X-Request-Id"),
            "transfer_id": params.get("transfer_id"), "lease_id": f"lease-{next(self._ids)}"}
        return web.json_response(doc)

    async def _await_kv(self, params: dict[str, Any]) -> web.Response | None:
        if self.role != "decode":
            return _error(400, "not a decode worker")
        if params.get("transfer_id"):
            try:
                await asyncio.wait_for(self.rendezvous.event(params["transfer_id"]).wait(), 5)
            except TimeoutError:
                return _error(504, "push rendezvous timed out")
        elif "remote_engine_id" not in params:
            return _error(400, "kv_transfer_params without a remote engine")
        return None

    async def _complete(self, request: web.Request, body: dict[str, Any], fault: Fault | None,
                        call: Call) -> web.StreamResponse:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        texts = token_texts(body, n)
        cid = f"cmpl-{self.role}-{next(self._ids)}"
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay * n)
            doc = _completion(request.path, body, texts, "length", cid)
            return web.json_response(doc, headers={"x-pdmesh-phases": json.dumps({"kv_transfer_ms": 1.5})})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "x-pdmesh-phases": json.dumps({"kv_transfer_ms": 1.5})})
        await resp.prepare(request)
        if self.decode_gate is not None:
            await self.decode_gate.wait()
        chat = request.path.endswith("chat/completions")
        options = body.get("stream_options") or {}
        usage = StreamUsage.of(options.get("include_usage") is True,
                               options.get("continuous_usage_stats") is True)
        for event in _stream_events(chat, cid, texts, usage, len(prompt_words(body))):
            if fault and fault.cut_after is not None and event.get("_index", 0) >= fault.cut_after:
                request.transport.close()
                return resp
            event.pop("_index", None)
            await asyncio.sleep(self.token_delay)
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "server_error" if status >= 500
                                        else "invalid_request_error", "param": None, "code": status}},
                             status=status)


def _usage(body: dict[str, Any], n: int) -> dict[str, Any]:
    p = len(prompt_words(body))
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _completion(path: str, body: dict[str, Any], texts: list[str], finish: str, cid: str) -> dict[str, Any]:
    text = "".join(texts)
    if path.endswith("chat/completions"):
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": cid, "object": obj, "created": 1, "model": MODEL, "choices": [choice],
            "usage": _usage(body, len(texts))}


def _stream_events(chat: bool, cid: str, texts: list[str], usage: StreamUsage,
                   prompt_tokens: int) -> list[dict[str, Any]]:
    """The chunks a worker streams; with continuous usage each carries the counts so far
    (none on the role chunk), as a real worker's do."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    base: dict[str, Any] = {"id": cid, "object": obj, "created": 1, "model": MODEL}
    if usage.include_usage:
        base["usage"] = None
    events = []
    if chat:
        events.append({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        events.append({**base, "choices": [choice], "_index": i})
    if usage.continuous:
        for event in events:
            done = event.get("_index", -1) + 1
            event["usage"] = TokenCounts(prompt_tokens, done).usage()
    if usage.include_usage:
        events.append({"id": cid, "object": obj, "created": 1, "model": MODEL, "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(texts),
                                 "total_tokens": prompt_tokens + len(texts),
                                 "prompt_tokens_details": {"cached_tokens": prompt_tokens}}})
    return events
