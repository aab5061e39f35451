"""DNS discovery under load: replicas come and go while requests run, and none fails.

Real workers (the tiny random model, tests.support.pd_mesh) each on its own loopback address,
127.0.0.2 and .3 for the prefill name, .4 and .5 for the decode name, one port per name, as
replicas behind a DNS name are. The router (in the test's loop) resolves both names through a
`FakeResolver` that the test changes while clients keep sending requests, streamed and not:
a decode is added, the first decode removed, a prefill added, the first prefill removed.
Each address is removed while the router has requests on it. Every answer must succeed and
equal a separate mixed worker's (greedy); each removed worker gets no request after it left
the registry, and every request it had completed (a middleware on each worker records what
it served).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import DiscoveryConfig, DiscoveryTarget, Policy, RouterConfig
from services.router.state import STATE_KEY
from tests.support.dns import FakeResolver
from tests.support.net import free_port_on
from tests.support.pd import Answer, post, settle_to_zero
from tests.support.pd_mesh import MODEL, make_model, worker_config
from tests.support.real_mesh import until
from tests.support.worker import WorkerThread, wait_ready

PREFILL = ["127.0.0.2", "127.0.0.3"]
DECODE = ["127.0.0.4", "127.0.0.5"]
PROMPTS = [f"Replica {i} answers the question number {i * 7}" for i in range(8)]
CLIENTS = 3


@dataclass
class Served:
    """One POST a worker served: when it arrived and ended (test-process monotonic clock)."""

    path: str
    started: float
    finished: float | None = None
    status: int | None = None


@dataclass
class Replica:
    thread: WorkerThread
    served: list[Served] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.thread.url


def _recorder(served: list[Served]) -> Any:
    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        entry = Served(request.path, time.monotonic())
        served.append(entry)
        try:
            resp = await handler(request)
            entry.status = resp.status
            return resp
        finally:
            entry.finished = time.monotonic()

    return record


@dataclass
class Fleet:
    reference: WorkerThread  # a mixed worker alone: the expected answers
    replicas: dict[str, Replica]  # by address
    prefill_port: int
    decode_port: int


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = make_model(tmp_path_factory.mktemp("dns") / "tiny", seed=0)
    pp, dp = free_port_on(PREFILL), free_port_on(DECODE)
    replicas: dict[str, Replica] = {}
    for addrs, role, port in ((PREFILL, "prefill", pp), (DECODE, "decode", dp)):
        for addr in addrs:
            cfg = worker_config(model, role)
            assert cfg.kv is not None
            # Each replica's KV service on its own address, as in a container.
            cfg = dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, host=addr))
            thread = WorkerThread(cfg, host=addr, port=port)
            replica = Replica(thread)
            thread.app.middlewares.append(_recorder(replica.served))
            replicas[addr] = replica
    reference = WorkerThread(worker_config(model, "mixed"))
    threads = [reference, *(r.thread for r in replicas.values())]
    try:
        for t in threads:
            t.start()

        async def ready() -> None:
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(wait_ready(session, t.url, 120) for t in threads))

        asyncio.run(ready())
        yield Fleet(reference, replicas, pp, dp)
    finally:
        for t in threads:
            if t.port:
                t.stop()


@pytest.fixture
async def router(fleet: Fleet) -> AsyncIterator[tuple[TestClient, FakeResolver]]:
    resolver = FakeResolver({"prefill": [PREFILL[0]], "decode": [DECODE[0]]})
    targets = (DiscoveryTarget.parse(f"dns://prefill:{fleet.prefill_port}"),
               DiscoveryTarget.parse(f"dns://decode:{fleet.decode_port}"))
    config = RouterConfig(model=MODEL, health_interval_s=0.05, health_timeout_s=2.0,
                          prefill_policy=Policy.ROUND_ROBIN, decode_policy=Policy.ROUND_ROBIN,
                          discovery=DiscoveryConfig(targets=targets, interval_s=0.05))
    client = TestClient(TestServer(create_app(config, resolver), host="127.0.0.1"))
    await client.start_server()
    yield client, resolver
    await client.close()


def _body(i: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 6,
            "temperature": 0.0, "stream": i % 2 == 1}


async def _expected(session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, str]:
    out = {}
    for i in range(len(PROMPTS)):
        answer = await post(session, fleet.reference.url + "/v1/completions",
                            {**_body(i), "stream": False})
        assert answer.status == 200, answer.body
        out[PROMPTS[i]] = answer.text
    return out


class Load:
    """CLIENTS loops sending requests through the router until stopped; keeps every answer."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self._session = session
        self._url = url
        self._stop = asyncio.Event()
        self.answers: list[tuple[dict[str, Any], Answer]] = []
        self._tasks = [asyncio.create_task(self._loop(c)) for c in range(CLIENTS)]

    async def _loop(self, client: int) -> None:
        i = client
        while not self._stop.is_set():
            body = _body(i)
            self.answers.append((body, await post(self._session, self._url, body)))
            i += CLIENTS

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_replicas_come_and_go_while_requests_run(router, fleet: Fleet):
    client, resolver = router
    state = client.app[STATE_KEY]
    reps = fleet.replicas

    def registered(addr: str) -> bool:
        return state.registry.find(reps[addr].url) is not None

    def usable(addr: str) -> bool:
        worker = state.registry.find(reps[addr].url)
        return worker is not None and worker.usable()

    def check(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
        return lambda: asyncio.sleep(0, predicate())

    await until(check(lambda: usable(PREFILL[0]) and usable(DECODE[0])), 30, "never joined")
    async with aiohttp.ClientSession() as session:
        expected = await _expected(session, fleet)
        load = Load(session, str(client.make_url("/v1/completions")))
        left: dict[str, float] = {}  # when each removed worker left the registry
        held: dict[str, int] = {}  # router attempts on it when its address went away

        async def serves(addr: str) -> None:
            count = len(reps[addr].served)
            await until(check(lambda: len(reps[addr].served) > count + 1), 60,
                        f"{addr} never served")

        async def leave(kind: str, addr: str) -> None:
            """Drop `addr` from its name while the router has requests on it: the resolver
            changes in the same loop step that sees them (no await between)."""
            worker = state.registry.find(reps[addr].url)
            assert worker is not None
            await until(check(lambda: worker.attempts > 0), 60, f"{addr} idle", interval=0.001)
            held[addr] = worker.attempts
            resolver.names[kind].remove(addr)
            await until(check(lambda: not registered(addr)), 60, f"{addr} never left")
            left[addr] = time.monotonic()

        try:
            await serves(DECODE[0])
            resolver.names["decode"].append(DECODE[1])
            await until(check(lambda: usable(DECODE[1])), 30, "decode 2 never joined")
            await serves(DECODE[1])
            await leave("decode", DECODE[0])
            resolver.names["prefill"].append(PREFILL[1])
            await until(check(lambda: usable(PREFILL[1])), 30, "prefill 2 never joined")
            await serves(PREFILL[1])
            await leave("prefill", PREFILL[0])
            await serves(PREFILL[1])
            await serves(DECODE[1])
        finally:
            await load.stop()

        failed = [(b, a.status, a.error) for b, a in load.answers if a.status != 200 or a.error]
        assert not failed, failed
        wrong = [(b["prompt"], a.text) for b, a in load.answers
                 if a.text != expected[b["prompt"]]]
        assert not wrong, wrong
        assert sum(1 for b, _ in load.answers if b["stream"]) > 0
        assert set(left) == set(held) == {DECODE[0], PREFILL[0]}
        for addr, when in left.items():
            served = reps[addr].served
            assert served, f"{addr} served nothing before it left"
            assert all(s.started < when for s in served), f"{addr} got a request after leaving"
            assert all(s.finished is not None and s.status == 200 for s in served), (
                f"{addr}: a request it had did not complete")
        await settle_to_zero(session, *(r.url for r in reps.values()))
