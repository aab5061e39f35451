"""Request migration and stall detection through a real router in front of two real workers
(tiny model, in process): a stream whose worker fails mid-stream (its engine fails: an
in-stream error event; or its engine thread stops: a stall) continues on the other worker, and
the client sees exactly the uninterrupted stream (ids, text, one completion id, usage).

The slow module test_router_migration_real.py does the same with SIGKILL / SIGSTOP of worker
processes under 16 streams."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app as create_router
from services.router.config import MigrationConfig, RouterConfig
from services.worker.routes import RUNTIME_KEY
from shared.protocol.pd import PHASES_HEADER
from tests.support.sse import split_events

BOUND_S = 60.0
MAX_TOKENS = 24
COMPLETION = {"model": "tiny", "prompt": "migrate me", "max_tokens": MAX_TOKENS,
              "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "migrate me"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True}


@dataclass
class Stream:
    """One client stream, read event by event."""

    worker_id: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    raw: bytes = b""
    got: asyncio.Event = field(default_factory=asyncio.Event)  # some output arrived

    @property
    def text(self) -> str:
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                       for e in self.events for c in e["choices"])

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for c in e["choices"] for t in c.get("token_ids") or []]


async def _read(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                stream: Stream, after: int = 3) -> Stream:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        stream.worker_id = json.loads(resp.headers[PHASES_HEADER])["decode_worker"]
        async for line in resp.content:
            stream.raw += line
            if line.startswith(b"data: {") and b'"choices":[{' in line:
                stream.events.append(json.loads(line[6:]))
                if len(stream.events) >= after:
                    stream.got.set()
    stream.events = [json.loads(e) for e in split_events(stream.raw)[:-1]]
    return stream


@pytest.fixture
async def router(tiny_workers) -> AsyncIterator[TestClient]:
    urls = tuple(str(w.make_url("")).rstrip("/") for w in tiny_workers)
    config = RouterConfig(mixed_urls=urls, health_interval_s=0.2, health_timeout_s=5.0,
                          migration=MigrationConfig(stall_timeout_s=1.0, stall_limit_s=4.0))
    async with TestClient(TestServer(create_router(config), host="127.0.0.1")) as client:
        for _ in range(int(BOUND_S / 0.05)):
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        yield client


def _worker_of(router: TestClient, workers: list[TestClient], worker_id: str) -> TestClient:
    from services.router.state import STATE_KEY

    url = router.app[STATE_KEY].registry.get(worker_id).url
    return next(w for w in workers if str(w.make_url("")).rstrip("/") == url)


async def _metric(router: TestClient, reason: str) -> float:
    text = await (await router.get("/metrics")).text()
    key = f'pdmesh:router_migrations_total{{reason="{reason}"}} '
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(key)),
                0.0)


async def _migrate_one(router: TestClient, workers: list[TestClient], path: str,
                       body: dict[str, Any], hook: Any) -> tuple[Stream, Stream]:
    """The uninterrupted stream, then the same stream with `hook` installed on its worker's
    engine once the client got a few chunks."""
    url = str(router.make_url(path))
    async with aiohttp.ClientSession() as s:
        reference = await asyncio.wait_for(_read(s, url, body, Stream()), BOUND_S)
        cut = Stream()
        task = asyncio.create_task(_read(s, url, body, cut))
        await asyncio.wait_for(cut.got.wait(), BOUND_S)
        victim = _worker_of(router, workers, cut.worker_id)
        victim.app[RUNTIME_KEY].engine.engine.runner.fault_hook = hook
        return reference, await asyncio.wait_for(task, BOUND_S)


def _counts(stream: Stream) -> dict[str, Any]:
    usage = stream.events[-1]["usage"]
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def _assert_same_stream(reference: Stream, migrated: Stream) -> None:
    assert migrated.token_ids == reference.token_ids and len(reference.token_ids) == MAX_TOKENS
    assert migrated.text == reference.text
    assert len({e["id"] for e in migrated.events}) == 1  # one completion id throughout
    assert _counts(migrated) == _counts(reference)
    assert sum(1 for e in migrated.events for c in e["choices"] if c.get("finish_reason")) == 1
    assert not any("error" in e for e in migrated.events)


async def test_engine_failure_mid_stream_continues_on_the_other_worker(router, tiny_workers):
    def boom(batch: Any) -> None:
        raise RuntimeError("injected step failure")

    body = {**COMPLETION, "return_token_ids": True}
    reference, migrated = await _migrate_one(router, tiny_workers, "/v1/completions", body, boom)
    _assert_same_stream(reference, migrated)
    assert "prompt_token_ids" in json.dumps(migrated.events[0])  # asked for: kept, once
    assert json.dumps(migrated.events).count("prompt_token_ids") == 1
    assert await _metric(router, "error_event") == 1


async def test_wedged_engine_is_left_at_the_stall_limit(router, tiny_workers):
    """The engine thread of the stream's worker stops while its HTTP server still answers
    /health (a wedged engine): past the 4 s stall limit the stream continues on the other
    worker. Chat, with logprobs; the token ids the router asked for are not shown. (A worker
    that stops answering altogether, SIGSTOP, is left after one probe: the real-process test.)"""
    release = threading.Event()
    try:
        reference, migrated = await _migrate_one(router, tiny_workers, "/v1/chat/completions", CHAT,
                                                 lambda batch: release.wait(BOUND_S))
    finally:
        release.set()
    # The router asked for token ids to follow the stream; the client did not see them.
    assert b"token_ids" not in migrated.raw and b"token_ids" not in reference.raw
    assert migrated.text == reference.text and len(migrated.events) == len(reference.events)
    assert [e["choices"] for e in migrated.events] == [e["choices"] for e in reference.events]
    assert _counts(migrated) == _counts(reference)
    assert await _metric(router, "stall") == 1
