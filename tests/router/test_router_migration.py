"""Request migration and stall detection through a real router in front of two real workers
(tiny model, in process): a stream whose worker fails mid-stream (its engine fails: an
in-stream error event; or its engine thread stops: a stall) continues on the other worker, and
the client sees exactly the uninterrupted stream (ids, text, one completion id, usage).

The slow module fleet/test_router_migration_real.py does the same with SIGKILL / SIGSTOP of worker
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
from services.router.migration import StreamTracker
from services.worker.routes import RUNTIME_KEY
from shared.protocol.pd import PHASES_HEADER, ApiKind
from tests.support.sse import split_events

BOUND_S = 60.0
MAX_TOKENS = 24
PAUSE_AT = 4  # engine steps: the prompt's (first token), two more tokens, then the gate
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
                stream: Stream, after: int = 2) -> Stream:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        stream.worker_id = json.loads(resp.headers[PHASES_HEADER])["decode_worker"]
        async for line in resp.content:
            stream.raw += line
            if line.startswith(b"data: {") and b'"choices":[{' in line:
                stream.events.append(json.loads(line[6:]))
                if len(stream.events) >= after:
                    stream.got.set()
    stream.events = [e for e in map(json.loads, split_events(stream.raw)[:-1]) if "choices" in e]
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


class Gate:
    """A worker engine's fault hook for the cut run: from its PAUSE_AT-th step it waits for the
    test, which then sets `fault` (run on every later step) and opens `go`. The engine cannot
    run ahead of the test, so the fault always lands mid-stream, whatever the machine's load."""

    def __init__(self) -> None:
        self.steps = 0
        self.paused = threading.Event()
        self.go = threading.Event()
        self.fault: Any = None

    def __call__(self, batch: Any) -> None:
        self.steps += 1
        if self.steps == PAUSE_AT:
            self.paused.set()
            self.go.wait(BOUND_S)
        if self.fault is not None:
            self.fault(batch)


async def _cut_run(router: TestClient, workers: list[TestClient], url: str,
                   body: dict[str, Any], fault: Any, everywhere: bool = False) -> Stream:
    """The stream, with `fault` on its worker's engine (on every worker's if `everywhere`)
    once the client got the first tokens."""
    gates = {id(w): Gate() for w in workers}
    for w in workers:
        w.app[RUNTIME_KEY].engine.engine.runner.fault_hook = gates[id(w)]
    async with aiohttp.ClientSession() as s:
        cut = Stream()
        task = asyncio.create_task(_read(s, url, body, cut))
        await asyncio.wait_for(cut.got.wait(), BOUND_S)
        victim = _worker_of(router, workers, cut.worker_id)
        assert gates[id(victim)].paused.wait(BOUND_S)  # (the gate pauses before the 4th token)
        for w in workers:
            if everywhere or w is victim:
                gates[id(w)].fault = fault
        for gate in gates.values():
            gate.go.set()
        return await asyncio.wait_for(task, BOUND_S)


async def _migrate_one(router: TestClient, workers: list[TestClient], path: str,
                       body: dict[str, Any], fault: Any) -> tuple[Stream, Stream]:
    """The uninterrupted stream, then the same stream cut by `fault` on its worker."""
    url = str(router.make_url(path))
    async with aiohttp.ClientSession() as s:
        reference = await asyncio.wait_for(_read(s, url, body, Stream()), BOUND_S)
    return reference, await _cut_run(router, workers, url, body, fault)


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


def _assert_continuous_usage(stream: Stream) -> None:
    """Each chunk's usage counts the tokens sent so far (its token ids, summed) and the
    original prompt: across a migration too, where the continuation's prompt holds them."""
    *chunks, last = stream.events
    sent = 0
    for event in chunks:
        sent += sum(len(c.get("token_ids") or []) for c in event["choices"])
        assert event["usage"] == {"prompt_tokens": last["usage"]["prompt_tokens"],
                                  "completion_tokens": sent,
                                  "total_tokens": last["usage"]["prompt_tokens"] + sent}
    assert sent == last["usage"]["completion_tokens"] == MAX_TOKENS


@pytest.mark.parametrize("continuous", [False, True], ids=["usage", "continuous_usage"])
async def test_engine_failure_mid_stream_continues_on_the_other_worker(router, tiny_workers,
                                                                      continuous):
    def boom(batch: Any) -> None:
        raise RuntimeError("injected step failure")

    body = {**COMPLETION, "return_token_ids": True}
    if continuous:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    reference, migrated = await _migrate_one(router, tiny_workers, "/v1/completions", body, boom)
    _assert_same_stream(reference, migrated)
    if continuous:
        _assert_continuous_usage(reference)
        _assert_continuous_usage(migrated)
    assert "prompt_token_ids" in json.dumps(migrated.events[0])  # asked for: kept, once
    assert json.dumps(migrated.events).count("prompt_token_ids") == 1
    assert await _metric(router, "error_event") == 1


def test_a_continuations_role_chunk_with_continuous_usage_is_dropped():
    """A continuation repeats the role chunk, with usage under continuous_usage_stats: it is
    dropped (not sent as a choice-less usage chunk), and the counts of the next chunk have
    the resumed ids moved from the prompt to the output."""
    tracker = StreamTracker(ApiKind.CHAT, client_wants_ids=False)
    first = {"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"content": "a"},
                                                   "token_ids": [5, 6]}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    assert tracker.outgoing(first) is not None
    assert tracker.resume() == [5, 6]
    role = {"id": "d", "created": 2, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}}
    assert tracker.outgoing(role) is None
    more = {"id": "d", "created": 2, "choices": [{"index": 0, "delta": {"content": "b"},
                                                  "token_ids": [7]}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    out = tracker.outgoing(more)
    assert out is not None and out["id"] == "c"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


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


async def test_when_no_decode_is_left_the_client_gets_the_error_event(router, tiny_workers):
    """Both workers' engines fail: the stream moves once, fails again, and with no worker
    left the client gets what it got before migration existed: an error event, then [DONE]
    (the text before it is the uninterrupted text's beginning)."""
    def boom(batch: Any) -> None:
        raise RuntimeError("injected step failure")

    url = str(router.make_url("/v1/completions"))
    async with aiohttp.ClientSession() as s:
        reference = await asyncio.wait_for(_read(s, url, COMPLETION, Stream()), BOUND_S)
    cut = await _cut_run(router, tiny_workers, url, COMPLETION, boom, everywhere=True)
    events = [json.loads(e) for e in split_events(cut.raw)[:-1]]  # ends with [DONE]
    assert "error" in events[-1] and all("error" not in e for e in events[:-1])
    text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    assert text and reference.text.startswith(text) and text != reference.text
    assert await _metric(router, "error_event") == 1  # one move, then nowhere to go
