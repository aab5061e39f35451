"""`--discover k8s://NAMESPACE/SERVICE[:PORT]`: the real kubernetes-asyncio client against a
fake API server (tests/support/fake_k8s.py) that speaks list + watch for EndpointSlices.

Pods are fake workers on their own loopback addresses (one port per Service, as pods share a
container port). Ready endpoints become workers after their health check; an endpoint that
turns not ready, or a slice that is deleted, drains its workers out; bookmarks, watch time-outs
and 410 Expired are ridden through by listing again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import DiscoveryConfig, DiscoveryTarget, Policy, RouterConfig
from services.router.state import STATE_KEY
from tests.support.fake_k8s import Endpoint, FakeKubeApi
from tests.support.fake_worker import MODEL, FakeWorker, expected_text
from tests.support.net import free_port_on
from tests.support.real_mesh import until

NS = "pdmesh"
PREFILL = ["127.0.0.2"]
DECODE = ["127.0.0.4", "127.0.0.5", "127.0.0.6"]


@dataclass
class Cluster:
    api: FakeKubeApi
    router: TestClient
    workers: dict[str, FakeWorker]  # by address
    prefill_port: int
    decode_port: int

    def urls(self) -> set[str]:
        return {w.url for w in self.router.app[STATE_KEY].registry.all()}

    def usable(self) -> set[str]:
        return {w.url for w in self.router.app[STATE_KEY].registry.usable()}

    def url(self, addr: str) -> str:
        return self.workers[addr].url

    async def settle(self, urls: set[str], usable: set[str] | None = None) -> None:
        """Until the registry holds exactly `urls`, `usable` (default: all) of them usable."""
        want = urls if usable is None else usable
        await until(lambda: asyncio.sleep(0, self.urls() == urls and self.usable() == want), 10,
                    f"registry never became {sorted(urls)}: {sorted(self.urls())}")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    api = await FakeKubeApi().start()
    pp, dp = free_port_on(PREFILL), free_port_on(DECODE)
    workers = {a: FakeWorker("prefill") for a in PREFILL} | {a: FakeWorker("decode")
                                                              for a in DECODE}
    for addr, w in workers.items():
        await w.start(addr, pp if addr in PREFILL else dp)
    targets = (DiscoveryTarget.parse(f"k8s://{NS}/prefill"),  # the slice's only port
               DiscoveryTarget.parse(f"k8s://{NS}/decode:http"))  # a named port
    config = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0,
                          prefill_policy=Policy.ROUND_ROBIN, decode_policy=Policy.ROUND_ROBIN,
                          discovery=DiscoveryConfig(
                              targets=targets,
                              kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig"))))
    router = TestClient(TestServer(create_app(config), host="127.0.0.1"))
    await router.start_server()
    yield Cluster(api, router, workers, pp, dp)
    await router.close()
    await api.close()
    for w in workers.values():
        await w.close()


async def _metadata(c: Cluster) -> dict[str, Any]:
    resp = await c.router.get("/v1/router/metadata")
    assert resp.status == 200
    return await resp.json()


async def _complete(c: Cluster, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    resp = await c.router.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["text"] == expected_text(body)


async def test_endpoint_slices_drive_the_workers(cluster: Cluster):
    c, api = cluster, cluster.api
    # No slice yet: both targets are watched, with zero addresses.
    await until(lambda: asyncio.sleep(0, api.open_watches == 2), 10, "never watched")
    assert all(q.get("labelSelector", "").startswith("kubernetes.io/service-name=")
               for q in api.requests)
    doc = await _metadata(c)
    assert {d["target"]: d["addresses"] for d in doc["discovery"]} == {
        f"k8s://{NS}/prefill": [], f"k8s://{NS}/decode:http": []}
    # Pods appear; the not-ready one does not join; another Service's slice is not ours.
    await api.put(NS, "prefill-abc", "prefill", [Endpoint("127.0.0.2")], c.prefill_port,
                  port_name=None)
    await api.put(NS, "decode-abc", "decode", [Endpoint("127.0.0.4"),
                                               Endpoint("127.0.0.5", ready=False)],
                  c.decode_port)
    await api.put(NS, "other-abc", "other", [Endpoint("127.0.0.6")], c.decode_port)
    await api.put("elsewhere", "decode-abc", "decode", [Endpoint("127.0.0.6")], c.decode_port)
    await c.settle({c.url("127.0.0.2"), c.url("127.0.0.4")})
    workers = (await (await c.router.get("/workers")).json())["workers"]
    assert {(w["url"], w["source"], w["discovered_by"]) for w in workers} == {
        (c.url("127.0.0.2"), "k8s", f"k8s://{NS}/prefill"),
        (c.url("127.0.0.4"), "k8s", f"k8s://{NS}/decode:http")}
    await _complete(c, "served through the discovered pair")
    # The pod turns ready (unset condition counts as ready), in a second slice too.
    await api.bookmark()
    await api.put(NS, "decode-abc", "decode", [Endpoint("127.0.0.4"), Endpoint("127.0.0.5")],
                  c.decode_port)
    await api.put(NS, "decode-def", "decode", [Endpoint("127.0.0.6", ready=None)],
                  c.decode_port)
    await c.settle({c.url(a) for a in ["127.0.0.2", *DECODE]})
    for i in range(6):
        await _complete(c, f"spread {i}")
    assert all(c.workers[a].calls for a in DECODE)
    # Not ready any more: drained out, never sent another request.
    await api.put(NS, "decode-abc", "decode", [Endpoint("127.0.0.4", ready=False),
                                               Endpoint("127.0.0.5")], c.decode_port)
    await c.settle({c.url(a) for a in ["127.0.0.2", "127.0.0.5", "127.0.0.6"]})
    served = len(c.workers["127.0.0.4"].calls)
    for i in range(4):
        await _complete(c, f"after the drain {i}")
    assert len(c.workers["127.0.0.4"].calls) == served
    # The watch ends (the server's timeout), and one new watch is refused as too old (410):
    # the client lists again each time, and a change made meanwhile is not lost.
    lists = sum(1 for q in api.requests if "watch" not in q)
    api.expire_next_watch()
    await api.end_watches()
    await api.delete(NS, "decode-def")
    await until(lambda: asyncio.sleep(0, sum(1 for q in api.requests if "watch" not in q)
                                      >= lists + 3 and api.open_watches == 2), 10, "no relist")
    assert api.expired == 1
    await c.settle({c.url(a) for a in ["127.0.0.2", "127.0.0.5"]})
    # A slice deleted: its workers leave; the router says why it cannot serve.
    await api.delete(NS, "decode-abc")
    await c.settle({c.url("127.0.0.2")})
    doc = await _metadata(c)
    decode = next(d for d in doc["discovery"] if d["target"].endswith("decode:http"))
    assert decode["addresses"] == [] and "no EndpointSlice" in decode["note"]
    assert (await c.router.get("/health")).status == 503


async def test_a_wrong_token_is_reported_not_fatal(tmp_path: Path):
    api = await FakeKubeApi().start()
    path = api.kubeconfig(tmp_path / "kubeconfig")
    api.token = "rotated"  # the kubeconfig's token is no longer accepted
    config = RouterConfig(discovery=DiscoveryConfig(
        targets=(DiscoveryTarget.parse(f"k8s://{NS}/decode"),), kubeconfig=str(path)))
    router = TestClient(TestServer(create_app(config), host="127.0.0.1"))
    await router.start_server()
    try:
        async def error() -> str | None:
            doc = await (await router.get("/v1/router/metadata")).json()
            return doc["discovery"][0]["error"]

        message = await until(error, 10, "the failure was never shown")
        assert "401" in message
        assert (await router.get("/live")).status == 200
    finally:
        await router.close()
        await api.close()


def test_ready_urls_pick_the_port_and_skip_unready_endpoints():
    from kubernetes_asyncio.client import (
        DiscoveryV1EndpointPort,
        V1Endpoint,
        V1EndpointConditions,
        V1EndpointSlice,
        V1ObjectMeta,
    )

    from services.router.k8s_discovery import ready_urls

    def endpoint(address: str, ready: bool | None) -> V1Endpoint:
        return V1Endpoint(addresses=[address], conditions=V1EndpointConditions(ready=ready))

    two_ports = V1EndpointSlice(
        address_type="IPv6", metadata=V1ObjectMeta(name="s"),
        endpoints=[endpoint("fd00::1", None), endpoint("fd00::2", False),
                   endpoint("fd00::3", True)],
        ports=[DiscoveryV1EndpointPort(name="http", port=8200),
               DiscoveryV1EndpointPort(name="kv", port=14580)])
    want = {"http://[fd00::1]:8200", "http://[fd00::3]:8200"}
    assert ready_urls([two_ports], DiscoveryTarget.parse("k8s://ns/svc:http")) == want
    assert ready_urls([two_ports], DiscoveryTarget.parse("k8s://ns/svc:8200")) == want
    assert ready_urls([two_ports], DiscoveryTarget.parse("k8s://ns/svc")) == set()  # ambiguous
    assert ready_urls([two_ports], DiscoveryTarget.parse("k8s://ns/svc:grpc")) == set()
