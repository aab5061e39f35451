"""A small OpenAI-compatible stand-in server for the bench tests (aiohttp, 127.0.0.1).

It streams one word-token per SSE chunk with a fixed delay, implements vLLM-style /tokenize and
/detokenize with a word-level vocabulary, the include_usage chunk, OpenAI error envelopes on
demand, and (optionally) a per-phase report: in the x-pdmesh-phases header (seconds,
disagg_decision, retries) or in the usage chunk as pdmesh's router writes it (*_ms, decision,
attempts).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

PHASES = {"queue": 0.001, "prefill": 0.012, "handshake": 0.002, "kv_transfer": 0.004,
          "first_token": 0.016, "decode": 0.030}
KV_BYTES = 3 * 2**20


@dataclass
class FakeOpenAI:
    token_delay_s: float = 0.002
    phases: str | None = None  # None | "header" | "usage"
    fail_every: int = 0  # every Nth generation request gets a 503 envelope
    usage: bool = True
    tokenize_endpoints: bool = True
    vocab: list[str] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    bodies: list[dict] = field(default_factory=list)
    started: int = 0
    finished: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        if self.tokenize_endpoints:
            app.router.add_post("/tokenize", self.tokenize)
            app.router.add_post("/detokenize", self.detokenize)
        return app

    # word-level toy tokenizer: every distinct whitespace-separated word is one id
    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        inverse = {i: w for w, i in self.ids.items()}
        return " ".join(inverse.get(i, f"unk{i}") for i in ids)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "prompt" not in body:
            return web.json_response({"error": {"message": "prompt missing"}}, status=400)
        tokens = self.encode(body["prompt"])
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": self.decode(body["tokens"])})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.started += 1
        if self.fail_every and self.started % self.fail_every == 0:
            envelope = {"error": {"message": "draining", "type": "ServiceUnavailableError",
                                  "param": None, "code": 503}}
            return web.json_response(envelope, status=503)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(self.encode(prompt))
        headers = {"Content-Type": "text/event-stream"}
        info = {**PHASES, "kv_bytes": KV_BYTES, "disagg_decision": "remote_prefill",
                "retries": 1 if self.started % 2 else 0}
        if self.phases == "header":
            headers["x-pdmesh-phases"] = json.dumps(info)
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for is_token, event in self._events(chat, n, prompt_tokens, info):
            if is_token:
                await asyncio.sleep(self.token_delay_s)
            await resp.write(event.encode())
        self.finished += 1
        return resp

    def _events(self, chat: bool, n: int, prompt_tokens: int,
                info: dict) -> list[tuple[bool, str]]:
        """(is a token chunk, SSE text) in send order; token chunks are paced."""
        def sse(obj: object) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        out = [(False, ": ping\n\n")]
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            out.append((False, sse({"choices": [role], "usage": None})))
        for k in range(n):
            choice = {"index": 0, "delta": {"content": f"w{k} "}} if chat else \
                {"index": 0, "text": f"w{k} "}
            out.append((True, sse({"choices": [choice], "usage": None})))
        end = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else \
            {"index": 0, "text": "", "finish_reason": "length"}
        out.append((False, sse({"choices": [end], "usage": None})))
        if self.usage:
            usage: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                           "total_tokens": prompt_tokens + n}
            if self.phases == "usage":  # pdmesh router's own spelling: *_ms, decision, attempts
                usage["pdmesh"] = {**{f"{k}_ms": v * 1000 for k, v in PHASES.items()},
                                   "total_ms": 99.0, "kv_bytes": KV_BYTES,
                                   "decision": info["disagg_decision"],
                                   "attempts": info["retries"] + 1, "prefill_worker": "p0"}
            out.append((False, sse({"choices": [], "usage": usage})))
        out.append((False, "data: [DONE]\n\n"))
        return out


@asynccontextmanager
async def serve(fake: FakeOpenAI) -> AsyncIterator[str]:
    """Run the fake on a free 127.0.0.1 port; yields its base URL."""
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
