"""`--discover dns://NAME:PORT` with fake workers: joining after health, draining, sources.

Each replica is a fake worker on its own loopback address (127.0.0.x, one port for all, as
behind a DNS name); `FakeResolver` is the name service, changed by the test. The real-model
test with requests running through the changes is fleet/test_router_discovery_dns.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import (
    BreakerConfig,
    DiscoveryConfig,
    DiscoveryTarget,
    Policy,
    RouterConfig,
)
from services.router.discovery import system_resolver, worker_url
from services.router.state import STATE_KEY
from services.router.workers import Membership
from tests.support.dns import FakeResolver
from tests.support.fake_worker import MODEL, FakeWorker, expected_text
from tests.support.net import free_port_on
from tests.support.real_mesh import until
from tests.support.sse import split_events

ADMIN = {"Authorization": "Bearer admin-secret"}
PREFILL_ADDRS = ["127.0.0.2", "127.0.0.3"]
DECODE_ADDRS = ["127.0.0.4", "127.0.0.5"]


@dataclass
class Replicas:
    """Fake workers by address, all on one port per role."""

    prefill: dict[str, FakeWorker]
    decode: dict[str, FakeWorker]
    prefill_port: int
    decode_port: int

    @property
    def all(self) -> list[FakeWorker]:
        return [*self.prefill.values(), *self.decode.values()]


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    pp, dp = free_port_on(PREFILL_ADDRS), free_port_on(DECODE_ADDRS)
    reps = Replicas({a: FakeWorker("prefill") for a in PREFILL_ADDRS},
                    {a: FakeWorker("decode") for a in DECODE_ADDRS}, pp, dp)
    for addr, w in reps.prefill.items():
        await w.start(addr, pp)
    for addr, w in reps.decode.items():
        await w.start(addr, dp)
    yield reps
    for w in reps.all:
        await w.close()


def _config(reps: Replicas, **overrides: Any) -> RouterConfig:
    targets = (DiscoveryTarget.parse(f"dns://prefill:{reps.prefill_port}"),
               DiscoveryTarget.parse(f"dns://decode:{reps.decode_port}"))
    values: dict[str, Any] = {
        "health_interval_s": 0.05, "health_timeout_s": 1.0, "admin_token": "admin-secret",
        "prefill_policy": Policy.ROUND_ROBIN, "decode_policy": Policy.ROUND_ROBIN,
        "breaker": BreakerConfig(failures=3, window_s=10.0, cooldown_s=60.0, successes=1),
        "discovery": DiscoveryConfig(targets=targets, interval_s=0.02), **overrides}
    return RouterConfig(**values)


@pytest.fixture
async def router(replicas: Replicas) -> AsyncIterator[tuple[TestClient, FakeResolver]]:
    resolver = FakeResolver()
    client = TestClient(TestServer(create_app(_config(replicas), resolver), host="127.0.0.1"))
    await client.start_server()
    yield client, resolver
    await client.close()


async def _get(client: TestClient, path: str) -> dict[str, Any]:
    resp = await client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _url(addr: str, port: int) -> str:
    return f"http://{addr}:{port}"


async def _complete(client: TestClient, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    doc = await resp.json()
    assert doc["choices"][0]["text"] == expected_text(body)
    return doc


async def test_names_that_do_not_resolve_are_harmless(router, replicas):
    client, resolver = router
    await until(lambda: asyncio.sleep(0, resolver.calls >= 4), 5, "discovery never ran")
    assert (await client.get("/live")).status == 200
    resp = await client.get("/health")
    assert resp.status == 503 and "no workers registered" in (await resp.json())["error"]["message"]
    doc = await _get(client, "/v1/router/metadata")
    assert doc["workers"] == []
    assert {d["target"]: (d["addresses"], d["error"]) for d in doc["discovery"]} == {
        f"dns://prefill:{replicas.prefill_port}": ([], None),
        f"dns://decode:{replicas.decode_port}": ([], None)}
    assert all("does not resolve" in d["note"] for d in doc["discovery"])


async def test_found_workers_join_after_their_health_check_and_show_their_source(router,
                                                                                 replicas):
    client, resolver = router
    sick = replicas.decode["127.0.0.5"]
    sick.metadata_status = 503  # answers, but its metadata does not pass
    resolver.names = {"prefill": ["127.0.0.2"], "decode": DECODE_ADDRS}
    state = client.app[STATE_KEY]
    await until(lambda: asyncio.sleep(0, len(state.registry.usable()) == 2), 5, "never joined")
    doc = await _get(client, "/workers")
    by_url = {w["url"]: w for w in doc["workers"]}
    assert set(by_url) == {_url("127.0.0.2", replicas.prefill_port),
                           *(_url(a, replicas.decode_port) for a in DECODE_ADDRS)}
    sick_doc = by_url[_url("127.0.0.5", replicas.decode_port)]
    assert sick_doc["health"] == "unhealthy" and sick_doc["compat_hash"] is None
    meta = await _get(client, "/v1/router/metadata")
    (group,) = meta["groups"]  # the sick one is in no group: it never passed
    assert sick_doc["id"] not in group["decode"] and len(group["decode"]) == 1
    for w in doc["workers"]:
        assert w["source"] == "dns" and w["membership"] == "active"
        port = replicas.prefill_port if w["url"].endswith(f":{replicas.prefill_port}") else (
            replicas.decode_port)
        assert w["discovered_by"] == (f"dns://prefill:{port}" if port == replicas.prefill_port
                                      else f"dns://decode:{port}")
    for i in range(4):
        await _complete(client, f"hello number {i}")
    assert not sick.calls
    # Discovery owns what it found: the admin API cannot delete it.
    resp = await client.delete(f"/workers/{sick_doc['id']}", headers=ADMIN)
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "worker_discovered"
    # Its metadata passes now: it joins at the next health round.
    sick.metadata_status = 200
    await until(lambda: asyncio.sleep(0, len(state.registry.usable()) == 3), 5, "never healed")
    for i in range(4):
        await _complete(client, f"again {i}")
    assert sick.calls


async def test_static_and_admin_workers_are_told_apart(replicas):
    static = replicas.decode["127.0.0.4"]
    admin = replicas.prefill["127.0.0.2"]
    cfg = _config(replicas, decode_urls=(static.url,))
    resolver = FakeResolver({"prefill": [], "decode": []})
    client = TestClient(TestServer(create_app(cfg, resolver), host="127.0.0.1"))
    await client.start_server()
    try:
        resp = await client.post("/workers", json={"url": admin.url}, headers=ADMIN)
        assert resp.status == 202
        state = client.app[STATE_KEY]
        await until(lambda: asyncio.sleep(0, len(state.registry.usable()) == 2), 5, "no add")
        # Discovery finding a registered URL leaves it as it is.
        resolver.names["decode"] = ["127.0.0.4", "127.0.0.5"]
        await until(lambda: asyncio.sleep(0, len(state.registry.all()) == 3), 5, "no find")
        sources = {w["url"]: (w["source"], w["discovered_by"])
                   for w in (await _get(client, "/workers"))["workers"]}
        assert sources == {static.url: ("static", None), admin.url: ("admin", None),
                           _url("127.0.0.5", replicas.decode_port):
                               ("dns", f"dns://decode:{replicas.decode_port}")}
        resp = await client.delete(f"/workers/{state.registry.find(static.url).id}",
                                   headers=ADMIN)
        assert resp.status == 200
    finally:
        await client.close()


async def test_a_vanished_address_drains_then_leaves(router, replicas):
    """The decode chosen for a pull request is held through its prefill leg and its own leg:
    it leaves the registry only when that request is done, and gets nothing new meanwhile."""
    client, resolver = router
    old, new = replicas.decode["127.0.0.4"], replicas.decode["127.0.0.5"]
    resolver.names = {"prefill": ["127.0.0.2"], "decode": ["127.0.0.4"]}
    state = client.app[STATE_KEY]
    await until(lambda: asyncio.sleep(0, len(state.registry.usable()) == 2), 5, "never joined")
    old_worker = state.registry.find(_url("127.0.0.4", replicas.decode_port))
    replicas.prefill["127.0.0.2"].prefill_delay = 0.5
    gate = asyncio.Event()
    old.decode_gate = gate
    body = {"model": MODEL, "prompt": "held through the drain", "max_tokens": 4, "stream": True}
    held = asyncio.create_task(client.post("/v1/completions", json=body))
    await until(lambda: asyncio.sleep(0, old_worker.attempts == 1), 5, "not routed")
    resolver.names["decode"] = ["127.0.0.5"]
    await until(lambda: asyncio.sleep(0, old_worker.membership is Membership.DRAINING), 5,
                "never drained")
    await until(lambda: asyncio.sleep(0, state.registry.find(new.url) is not None
                                      and state.registry.find(new.url).usable()), 5, "no new")
    replicas.prefill["127.0.0.2"].prefill_delay = 0.0
    await until(lambda: asyncio.sleep(0, len(old.calls) == 1), 5, "held decode leg never came")
    assert state.registry.find(old_worker.id) is old_worker  # held: still registered
    for i in range(3):
        await _complete(client, f"while draining {i}")
    assert len(old.calls) == 1 and len(new.calls) == 3
    gate.set()
    resp = await held
    assert resp.status == 200
    text = "".join(c["choices"][0]["text"] for c in await _sse(resp))
    assert text == expected_text(body)
    await until(lambda: asyncio.sleep(0, state.registry.find(old_worker.id) is None), 5,
                "drained worker never left")
    assert old.calls[0].finished is not None and not old.calls[0].aborted


async def test_an_address_back_while_draining_stays_and_resolver_failures_keep_workers(
        router, replicas):
    client, resolver = router
    resolver.names = {"prefill": ["127.0.0.2"], "decode": ["127.0.0.4"]}
    state = client.app[STATE_KEY]
    await until(lambda: asyncio.sleep(0, len(state.registry.usable()) == 2), 5, "never joined")
    decode = state.registry.find(_url("127.0.0.4", replicas.decode_port))
    decode.attempts += 1  # an attempt holds it: the drain cannot finish
    resolver.names["decode"] = []
    await until(lambda: asyncio.sleep(0, decode.membership is Membership.DRAINING), 5, "drain")
    resolver.names["decode"] = ["127.0.0.4"]
    await until(lambda: asyncio.sleep(0, decode.membership is Membership.ACTIVE), 5, "back")
    decode.attempts -= 1
    # SERVFAIL / timeout is not "no replicas": what was found stays, the error is shown.
    resolver.failure = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    calls = resolver.calls
    await until(lambda: asyncio.sleep(0, resolver.calls > calls + 4), 5, "no rounds")
    assert state.registry.find(decode.id) is decode and decode.usable()
    meta = await _get(client, "/v1/router/metadata")
    assert all("Temporary failure" in d["error"] for d in meta["discovery"])
    assert all(len(d["workers"]) == 1 for d in meta["discovery"])
    await _complete(client, "still served")


async def _sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events = split_events(await resp.read())
    return [json.loads(e) for e in events[:-1] if json.loads(e).get("choices")]


def test_the_router_does_not_import_the_kubernetes_client_unless_asked():
    code = ("import sys; from services.router.app import create_app; "
            "from services.router.config import RouterConfig, DiscoveryConfig, DiscoveryTarget; "
            "create_app(RouterConfig(discovery=DiscoveryConfig(targets=("
            "DiscoveryTarget.parse('dns://x:1'),)))); "
            "assert 'kubernetes_asyncio' not in sys.modules, 'imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


async def test_the_system_resolver_and_worker_urls():
    assert await system_resolver("127.0.0.3", 8200) == ["127.0.0.3"]
    assert worker_url("127.0.0.3", 8200) == "http://127.0.0.3:8200"
    assert worker_url("fd00::1", 8200) == "http://[fd00::1]:8200"
