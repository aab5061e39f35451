"""Decode failover, stall detection and the half-open breaker with real worker processes
(the regressions of issue 20's "Tried" list).

- 16 greedy streams over two pull decodes; one decode is SIGKILLed once every stream has
  received a few chunks: every client completes, each stream's ids and text equal an
  uninterrupted run's (the mixed worker's), migrations are counted, and no block stays held.
- The same with SIGSTOP instead (8 streams, and 4 requests not streamed): the stalled streams
  leave the frozen decode once the router's 2 s stall timeout and a failed health probe say
  it is gone (the requests not streamed are retried), rather than waiting silently for as long
  as it is stopped.
- The only decode is killed under load and restarted: once the router routes to it again, a
  burst of 8 concurrent requests all succeed (the half-open breaker used to 503 them).

The extra decode is this module's own process (the fleet's are shared and restored).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.pd import Answer, post, settle_to_zero
from tests.support.real_mesh import (
    MODEL,
    Fleet,
    Service,
    has_status,
    metric,
    router_in_test,
    until,
    worker,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 48
SEEN = 4  # chunks every stream has received before the fault
BODY = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}


def _prompt(i: int) -> str:
    return f"Story {i}: the robot number {i * 7} walked into the"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-migration")


@pytest.fixture(scope="module")
def extra(fleet: Fleet, logs: Path) -> Iterator[Service]:
    """A second pull decode in the fleet decode's group: the victim of this module."""
    service = worker("decode-b", "decode", logs).start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def references(fleet: Fleet) -> list[Answer]:
    """The uninterrupted answers, from the mixed worker (P/D gives the same: parity tests)."""
    async def ask() -> list[Answer]:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(
                post(s, fleet.mixed.url + "/v1/completions", {**BODY, "prompt": _prompt(i)})
                for i in range(16))))

    answers = asyncio.run(ask())
    assert all(a.status == 200 and len(a.token_ids) == MAX_TOKENS for a in answers)
    return answers


@dataclass
class Client:
    """One streaming client; `seen` is set after SEEN chunks (or at the end)."""

    prompt: str
    chunks: list[dict[str, Any]] = field(default_factory=list)
    status: int = 0
    seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, session: aiohttp.ClientSession, url: str) -> Client:
        body = {**BODY, "prompt": self.prompt, "stream": True}
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                self.status = resp.status
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        self.chunks.append(json.loads(line[6:]))
                        if len(self.chunks) >= SEEN:
                            self.seen.set()
        finally:
            self.seen.set()
        return self

    @property
    def answer(self) -> Answer:
        return Answer(self.status, chunks=self.chunks)


async def _alive(session: aiohttp.ClientSession, service: Service) -> None:
    if not service.alive():
        service.start()
    await service.wait_healthy(session, 240.0)


async def _streams_through_a_fault(router: Service, n: int, fault: Any,
                                   whole: int = 0) -> tuple[list[Client], list[Answer]]:
    """`n` streams, and `whole` requests not streamed (prompts n, n+1...) sent with them;
    `fault()` once each stream has received SEEN chunks (or finished)."""
    async with aiohttp.ClientSession() as s:
        clients = [Client(_prompt(i)) for i in range(n)]
        tasks = [asyncio.create_task(c.run(s, router.url)) for c in clients]
        plain = asyncio.gather(*(post(s, router.url + "/v1/completions",
                                      {**BODY, "prompt": _prompt(n + i)}) for i in range(whole)))
        await asyncio.wait_for(asyncio.gather(*(c.seen.wait() for c in clients)), 300.0)
        fault()
        streams = await asyncio.wait_for(asyncio.gather(*tasks), 300.0)
        return list(streams), list(await asyncio.wait_for(plain, 300.0))


def _assert_uninterrupted(clients: list[Client], references: list[Answer]) -> None:
    for client, ref in zip(clients, references, strict=False):
        answer = client.answer
        assert client.status == 200 and answer.error is None, answer.error
        assert answer.token_ids == ref.token_ids, client.prompt
        assert answer.text == ref.text, client.prompt
        assert len({c["id"] for c in client.chunks}) == 1
        assert sum(1 for c in client.chunks for ch in c["choices"] if ch["finish_reason"]) == 1


def _pd_flags(fleet: Fleet, extra: Service) -> tuple[str, ...]:
    return ("--prefill", fleet.prefill.url, "--decode", fleet.decode.url, "--decode", extra.url,
            "--decode-policy", "round_robin", "--stall-timeout", "2")


async def test_sigstop_of_a_decode_moves_its_streams_after_the_stall_timeout(
        fleet, extra, logs, references):
    async with aiohttp.ClientSession() as s:
        await _alive(s, extra)
    async with router_in_test("router-stall", logs, *_pd_flags(fleet, extra)) as router:
        try:
            clients, plain = await _streams_through_a_fault(router, 8, extra.freeze, whole=4)
        finally:
            extra.thaw()
        _assert_uninterrupted(clients, references)
        for answer, ref in zip(plain, references[8:12], strict=True):  # retried, not migrated
            assert answer.status == 200 and answer.token_ids == ref.token_ids, answer.body
        async with aiohttp.ClientSession() as s:
            assert await metric(s, router.url, "pdmesh:router_migrations_total",
                                '{reason="stall"}') >= 1
            # Thawed, the decode finds its streams' connections closed and frees their blocks.
            await settle_to_zero(s, fleet.prefill.url, fleet.decode.url, extra.url, timeout=30.0)


async def test_sigkill_of_a_decode_during_16_streams_loses_no_request(
        fleet, extra, logs, references):
    async with aiohttp.ClientSession() as s:
        await _alive(s, extra)
    async with router_in_test("router-failover", logs, *_pd_flags(fleet, extra)) as router:
        clients, _ = await _streams_through_a_fault(router, 16, extra.kill)
        _assert_uninterrupted(clients, references)
        async with aiohttp.ClientSession() as s:
            assert await metric(s, router.url, "pdmesh:router_migrations_total",
                                '{reason="disconnect"}') >= 1
            await settle_to_zero(s, fleet.prefill.url, fleet.decode.url, timeout=30.0)


async def test_restarted_decode_takes_a_burst_of_8_at_once(fleet, extra, logs, references):
    """Kill the only decode under load (its breaker opens), restart it: as soon as the router
    routes to it again, 8 concurrent requests all succeed."""
    async with aiohttp.ClientSession() as s:
        await _alive(s, extra)
    async with router_in_test("router-half-open", logs, "--prefill", fleet.prefill.url,
                              "--decode", extra.url, "--breaker-failures", "1",
                              "--breaker-cooldown", "600") as router:
        async with aiohttp.ClientSession() as s:
            await _streams_through_a_fault(router, 4, extra.kill)  # they fail: no other decode
            await until(lambda: has_status(s, router.url + "/health", 503), 30.0,
                        "/health never turned 503")
            extra.start()
            await extra.wait_healthy(s, 240.0)
            await until(lambda: has_status(s, router.url + "/health", 200), 30.0,
                        "the router never took the restarted decode back")
            burst = await asyncio.gather(*(
                post(s, router.url + "/v1/completions", {**BODY, "prompt": _prompt(i)})
                for i in range(8)))
            for answer, ref in zip(burst, references, strict=False):
                assert answer.status == 200, answer.body
                assert answer.token_ids == ref.token_ids
