"""Every route of every app, and the credential it needs. A route added without a decision
here fails `test_every_route_has_a_credential_decision`; each decision is then checked by
calling the route without the credential (and, where one applies, with it).

Credentials: `none` (probes: health, liveness, metrics); `api_key` (client endpoints, when
keys are configured); `admin_token` (registry changes: 403 while no token is configured, 401
without the right one); `kv_signature` (KV requests between workers: HMAC with the mesh's
secret). A worker's completion routes also need the KV signature for prefill legs when the
worker has a KV secret (services/worker/leg_auth.py; tested in tests/pd/test_pd_handshake.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.signing import sign
from services.router.app import create_app as router_app
from services.router.config import RouterConfig
from services.worker.app import create_app as worker_app
from tests.support.fake_engine import FakeEngine
from tests.support.kv import SECRET, start_node
from tests.support.worker import factory_for, wait_healthy, worker_config

API_KEY, ADMIN_TOKEN = "client-key-0123456789", "admin-token-0123456789"

REQUIRED: dict[str, dict[tuple[str, str], str]] = {
    "router": {
        ("POST", "/v1/completions"): "api_key",
        ("POST", "/v1/chat/completions"): "api_key",
        ("GET", "/v1/models"): "api_key",
        ("GET", "/v1/models/{model}"): "api_key",
        ("POST", "/tokenize"): "api_key",
        ("POST", "/detokenize"): "api_key",
        ("GET", "/v1/router/metadata"): "api_key",
        ("GET", "/workers"): "api_key",
        ("GET", "/workers/jobs/{job_id}"): "api_key",
        ("POST", "/workers"): "admin_token",
        ("DELETE", "/workers/{worker_id}"): "admin_token",
        ("GET", "/health"): "none",
        ("GET", "/live"): "none",
        ("GET", "/metrics"): "none",
        ("GET", "/openapi.json"): "none",
    },
    "worker": {
        ("POST", "/v1/completions"): "api_key",
        ("POST", "/v1/chat/completions"): "api_key",
        ("POST", "/v1/kv_transfer/abort"): "api_key",
        ("GET", "/v1/models"): "api_key",
        ("GET", "/v1/models/{model}"): "api_key",
        ("GET", "/v1/metadata"): "api_key",
        ("POST", "/tokenize"): "api_key",
        ("POST", "/detokenize"): "api_key",
        ("GET", "/health"): "none",
        ("GET", "/live"): "none",
        ("GET", "/metrics"): "none",
        ("GET", "/openapi.json"): "none",
    },
    "kv": {
        ("GET", "/kv/v1/info"): "none",
        ("POST", "/kv/v1/handshake"): "kv_signature",
        ("POST", "/kv/v1/pull"): "kv_signature",
        ("POST", "/kv/v1/release"): "kv_signature",
        ("POST", "/kv/v1/heartbeat"): "kv_signature",
        ("POST", "/kv/v1/push/register"): "kv_signature",
        ("POST", "/kv/v1/push/write"): "kv_signature",
        ("POST", "/kv/v1/push/complete"): "kv_signature",
        ("POST", "/kv/v1/push/keepalive"): "kv_signature",
        ("POST", "/kv/v1/push/abort"): "kv_signature",
    },
}


def routes_of(app: web.Application) -> set[tuple[str, str]]:
    """(method, path template) of every route; the HEAD twin aiohttp adds to a GET is the
    GET's."""
    found = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else "?"
        if route.method == "HEAD":
            continue
        found.add((route.method, path))
    return found


def _kv_app_routes() -> set[tuple[str, str]]:
    from services.kv_transfer.app import routes

    return {(r.method, r.path) for r in routes if isinstance(r, web.RouteDef)}


@pytest.fixture
async def clients() -> AsyncIterator[dict[str, TestClient]]:
    """Each app with every credential configured."""
    router = TestClient(TestServer(router_app(RouterConfig(api_keys=(API_KEY,),
                                                           admin_token=ADMIN_TOKEN))))
    worker = TestClient(TestServer(worker_app(worker_config(api_keys=(API_KEY,)),
                                              factory_for(FakeEngine()))))
    for client in (router, worker):
        await client.start_server()
    await wait_healthy(worker)
    kv = await start_node("prefill", secret=SECRET)
    kv_client = TestClient(TestServer(web.Application()))  # only for its session
    await kv_client.start_server()
    try:
        yield {"router": router, "worker": worker, "kv": kv_client,
               "kv_url": f"http://{kv.address}"}  # type: ignore[dict-item]
    finally:
        await kv.runner.cleanup()
        for client in (router, worker, kv_client):
            await client.close()


async def test_every_route_has_a_credential_decision(clients) -> None:
    apps = {"router": clients["router"].app, "worker": clients["worker"].app}
    found = {name: routes_of(app) for name, app in apps.items()}
    found["kv"] = _kv_app_routes()
    for name, routes in found.items():
        unknown = routes - set(REQUIRED[name])
        assert not unknown, (f"{name} routes without a credential decision: {sorted(unknown)}; "
                             "add each to REQUIRED with the credential it needs")
        assert set(REQUIRED[name]) <= routes, f"{name}: stale entries in REQUIRED"


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


async def _status(client: TestClient, url: str, method: str, headers: dict[str, str]) -> int:
    async with client.session.request(method, url, data=b"{}", headers=headers) as resp:
        return resp.status


@pytest.mark.parametrize("name", ["router", "worker", "kv"])
async def test_each_route_refuses_a_caller_without_its_credential(clients, name) -> None:
    client = clients[name]
    base = clients["kv_url"] if name == "kv" else str(client.make_url("")).rstrip("/")
    for (method, template), needed in REQUIRED[name].items():
        url, path = base + _concrete(template), _concrete(template)
        plain = {"Content-Type": "application/json"}
        without = await _status(client, url, method, plain)
        if needed == "none":
            assert without not in (401, 403), (name, method, template, without)
            continue
        assert without == 401, (name, method, template, without)
        good = {"api_key": {"Authorization": f"Bearer {API_KEY}"},
                "admin_token": {"Authorization": f"Bearer {ADMIN_TOKEN}"},
                "kv_signature": sign(SECRET, method, path, [b"{}"])}[needed]
        with_it = await _status(client, url, method, {**plain, **good})
        assert with_it not in (401, 403), (name, method, template, with_it)
        if needed != "kv_signature":  # the other credential is no substitute
            other = ADMIN_TOKEN if needed == "api_key" else API_KEY
            swapped = await _status(client, url, method,
                                    {**plain, "Authorization": f"Bearer {other}"})
            assert swapped == 401, (name, method, template, swapped)


async def test_admin_routes_are_disabled_without_an_admin_token() -> None:
    client = TestClient(TestServer(router_app(RouterConfig(api_keys=(API_KEY,)))))
    await client.start_server()
    try:
        for method, path in (("POST", "/workers"), ("DELETE", "/workers/x")):
            async with client.session.request(method, client.make_url(path), json={},
                                              headers={"Authorization": f"Bearer {API_KEY}"}
                                              ) as resp:
                body = await resp.json()
            assert resp.status == 403 and body["error"]["code"] == "admin_disabled"
            assert "--admin-token" in body["error"]["message"]
    finally:
        await client.close()
