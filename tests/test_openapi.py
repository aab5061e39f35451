"""The OpenAPI documents of the worker and the router: valid OpenAPI 3.1, served at
/openapi.json, covering every route of each app (and nothing else), each operation's declared
credential matching what the app enforces, and every bounded number in the field tables
enforced by the worker's validator at exactly the documented bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate

from services.common.openai_fields import CHAT, COMPLETION, SAMPLING
from services.common.openapi import Credential, Operation
from services.common.schema import Field, Kind
from services.router import openapi as router_openapi
from services.router.app import create_app as create_router
from services.router.config import RouterConfig
from services.worker import openapi as worker_openapi
from services.worker.app import create_app as create_worker
from tests.support.fake_engine import FakeEngine
from tests.support.worker import API_KEY, start_client, worker_config

ADMIN = "admin-token"
BASE = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}}


def _routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD" and r.resource is not None}


def _documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}


@pytest.mark.parametrize("doc", [worker_openapi.worker_document(),
                                 router_openapi.router_document()], ids=["worker", "router"])
def test_documents_are_valid_openapi_31(doc: dict[str, Any]) -> None:
    validate(doc)  # raises on any violation of the 3.1 meta-schema
    assert doc["openapi"].startswith("3.1")
    schemes = doc["components"]["securitySchemes"]
    assert {"apiKey", "adminToken"} <= set(schemes)


def test_every_route_is_documented() -> None:
    worker = create_worker(worker_config(), lambda _cfg: FakeEngine())
    router = create_router(RouterConfig())
    assert _routes(worker) == _documented(worker_openapi.worker_document())
    assert _routes(router) == _documented(router_openapi.router_document())


@pytest.fixture
async def secured_worker() -> AsyncIterator[TestClient]:
    client = await start_client(worker_config(api_keys=(API_KEY,)), FakeEngine(step_delay=0.0))
    yield client
    await client.close()


@pytest.fixture
async def secured_router() -> AsyncIterator[TestClient]:
    app = create_router(RouterConfig(api_keys=(API_KEY,), admin_token=ADMIN))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


def _concrete(path: str) -> str:
    return path.replace("{job_id}", "nope").replace("{worker_id}", "nope").replace(
        "{model}", "nope")


async def _check_credentials(client: TestClient, operations: tuple[Operation, ...]) -> None:
    """Without a credential, guarded operations answer 401 and open ones do not; the admin
    token is not an API key and vice versa."""
    for op in operations:
        resp = await client.request(op.method, _concrete(op.path), json={})
        guarded = op.credential is not Credential.OPEN
        assert (resp.status == 401) == guarded, (op.method, op.path, resp.status)
        if op.credential is Credential.ADMIN:
            with_key = await client.request(op.method, _concrete(op.path), json={},
                                            headers={"Authorization": f"Bearer {API_KEY}"})
            assert with_key.status == 401, op.path
            with_admin = await client.request(op.method, _concrete(op.path), json={},
                                              headers={"Authorization": f"Bearer {ADMIN}"})
            assert with_admin.status != 401, op.path


async def test_worker_serves_its_document_and_enforces_its_credentials(
        secured_worker: TestClient) -> None:
    resp = await secured_worker.get("/openapi.json")
    assert resp.status == 200 and await resp.json() == worker_openapi.worker_document()
    await _check_credentials(secured_worker, worker_openapi.OPERATIONS)


async def test_router_serves_its_document_and_enforces_its_credentials(
        secured_router: TestClient) -> None:
    resp = await secured_router.get("/openapi.json")
    assert resp.status == 200 and await resp.json() == router_openapi.router_document()
    await _check_credentials(secured_router, router_openapi.OPERATIONS)


def _bounded(fields: list[Field]) -> list[tuple[Field, float, bool]]:
    """(field, value, accepted) at each side of each documented numeric bound."""
    cases: list[tuple[Field, float, bool]] = []
    for f in fields:
        if f.kind not in (Kind.INTEGER, Kind.NUMBER):
            continue
        step = 1 if f.kind is Kind.INTEGER else 0.5
        if f.lo is not None:
            cases += [(f, f.lo, True), (f, f.lo - step, False)]
        if f.hi is not None and f.hi < 2**62:
            cases += [(f, f.hi, True), (f, f.hi + step, False)]
    return cases


@pytest.fixture
async def fake_worker() -> AsyncIterator[TestClient]:
    client = await start_client(worker_config(), FakeEngine(step_delay=0.0, max_model_len=4096))
    yield client
    await client.close()


async def test_documented_bounds_are_the_enforced_bounds(fake_worker: TestClient) -> None:
    for path, fields in (("/v1/completions", list(COMPLETION)), ("/v1/chat/completions",
                                                                   list(CHAT))):
        for field, value, accepted in _bounded(fields):
            body = {**BASE[path], field.name: value}
            if field.name == "top_logprobs":
                body["logprobs"] = True
            if field.name == "n":
                body["max_tokens"] = 1
            if field.name == "best_of":  # only equal to n: bounded as n is
                body.update(n=min(max(value, 1), field.hi or 1), max_tokens=1)
            resp = await fake_worker.post(path, json=body)
            text = await resp.text()
            if accepted:
                assert resp.status == 200, (path, field.name, value, text)
            else:
                assert resp.status == 400, (path, field.name, value, text)
                assert (await resp.json())["error"]["param"] == field.name
    assert {f.name for f in SAMPLING} <= {f.name for f in COMPLETION}
