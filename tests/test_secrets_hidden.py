"""Secrets, keys and tokens never show: not in the repr of a config (which ends up in logs
and tracebacks), not in metadata, not in an error body, not in a log line, and they are
compared in constant time (hmac.compare_digest over digests or MACs, checked in the source)."""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.errors import ApiError
from services.common.signing import SignatureVerifier, SignatureWindow, sign
from services.kv_transfer.config import KVTransferConfig
from services.router.app import create_app as router_app
from services.router.config import RouterConfig
from services.worker.app import create_app as worker_app
from services.worker.config import WorkerConfig
from shared.protocol.pd import Role
from tests.support.fake_engine import FakeEngine
from tests.support.worker import factory_for, wait_healthy, worker_config

ROOT = Path(__file__).resolve().parents[1]
API_KEY, ADMIN_TOKEN = "client-key-SECRET-1111", "admin-token-SECRET-2222"
WORKER_KEY, KV_SECRET = "worker-key-SECRET-3333", "kv-secret-SECRET-4444"
SECRETS = (API_KEY, ADMIN_TOKEN, WORKER_KEY, KV_SECRET)


def assert_hidden(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} shows a secret"


def router_config() -> RouterConfig:
    return RouterConfig(api_keys=(API_KEY,), admin_token=ADMIN_TOKEN, worker_api_key=WORKER_KEY,
                        kv_secret=KV_SECRET.encode())


def test_config_reprs_hide_every_secret() -> None:
    kv = KVTransferConfig(role="prefill", secret=KV_SECRET.encode())
    worker = WorkerConfig(role=Role.PREFILL, kv=kv, api_keys=(API_KEY,))
    for config in (router_config(), kv, worker):
        assert_hidden(repr(config), type(config).__name__)
        assert_hidden(str(config), type(config).__name__)
    # And each secret field is declared hidden, so a field added next to it follows suit.
    for cls, names in ((RouterConfig, {"api_keys", "admin_token", "worker_api_key", "kv_secret"}),
                       (WorkerConfig, {"api_keys"}), (KVTransferConfig, {"secret"})):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert all(not fields[n].repr for n in names), cls.__name__


def test_router_from_the_environment_hides_them_too() -> None:
    from services.cli import build_parser

    args = build_parser().parse_args(["router"])
    config = RouterConfig.from_args(args, {
        "PDMESH_API_KEY": API_KEY, "PDMESH_ADMIN_TOKEN": ADMIN_TOKEN,
        "PDMESH_WORKER_API_KEY": WORKER_KEY, "PDMESH_KV_SECRET": KV_SECRET})
    assert config.kv_secret == KV_SECRET.encode() and config.admin_token == ADMIN_TOKEN
    assert_hidden(repr(config), "RouterConfig.from_args")


async def test_router_answers_and_logs_show_no_secret(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    client = TestClient(TestServer(router_app(router_config())))
    await client.start_server()
    try:
        seen = []
        for method, path, token in (
                ("GET", "/v1/router/metadata", API_KEY), ("GET", "/workers", API_KEY),
                ("GET", "/v1/router/metadata", "wrong"), ("POST", "/workers", "wrong"),
                ("POST", "/workers", API_KEY), ("POST", "/v1/completions", ADMIN_TOKEN),
                ("POST", "/v1/completions", API_KEY)):
            async with client.request(method, path, json={"model": "m", "prompt": "x"},
                                      headers={"Authorization": f"Bearer {token}"}) as resp:
                seen.append((resp.status, await resp.text(), json.dumps(dict(resp.headers))))
        assert {s for s, _, _ in seen} >= {200, 401}
        for status, body, headers in seen:
            assert_hidden(body + headers, f"a {status} answer")
    finally:
        await client.close()
    assert_hidden("\n".join(r.getMessage() for r in caplog.records), "the router's log")


async def test_worker_answers_show_no_key(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    client = TestClient(TestServer(worker_app(worker_config(api_keys=(API_KEY,)),
                                              factory_for(FakeEngine()))))
    await client.start_server()
    try:
        await wait_healthy(client)
        bodies = []
        for token in (API_KEY, "wrong", ADMIN_TOKEN):
            async with client.get("/v1/metadata",
                                  headers={"Authorization": f"Bearer {token}"}) as resp:
                bodies.append(await resp.text())
        assert_hidden("\n".join(bodies), "the worker's answers")
    finally:
        await client.close()
    assert_hidden("\n".join(r.getMessage() for r in caplog.records), "the worker's log")


def test_signature_errors_quote_neither_the_secret_nor_the_expected_mac() -> None:
    verifier = SignatureVerifier(KV_SECRET.encode(), SignatureWindow())
    good = sign(KV_SECRET.encode(), "POST", "/kv/v1/pull", [b"body"])
    for headers in ({**good, "X-PDMesh-KV-Signature": "f" * 64}, {}, {**good}):
        body = b"other body"  # the MAC of `good` is over b"body": never valid here
        with pytest.raises(ApiError) as err:
            verifier.verify(headers, "POST", "/kv/v1/pull", body)
        text = json.dumps(err.value.body())
        assert_hidden(text, "a KV auth error")
        assert good["X-PDMesh-KV-Signature"] not in text


def _compares_secrets_with_eq(path: Path) -> list[str]:
    """`==`/`!=` comparisons that involve a name or attribute called like a secret."""
    secretish = {"token", "api_key", "admin_token", "secret", "signature", "sig", "key",
                 "worker_api_key", "kv_secret", "digest", "expected"}
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare) or not any(
                isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
            continue
        for side in (node.left, *node.comparators):
            name = side.id if isinstance(side, ast.Name) else (
                side.attr if isinstance(side, ast.Attribute) else None)
            if name in secretish:
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return hits


def test_auth_code_compares_secrets_in_constant_time_only() -> None:
    files = [ROOT / "services/common/middleware.py", ROOT / "services/common/signing.py",
             ROOT / "services/router/admin.py", ROOT / "services/router/app.py",
             ROOT / "services/kv_transfer/auth.py", ROOT / "services/worker/leg_auth.py"]
    hits = [h for f in files for h in _compares_secrets_with_eq(f)]
    assert not hits, f"secrets compared with ==: {hits}"
    sources = "".join(f.read_text() for f in files)
    assert sources.count("compare_digest") >= 2  # API keys/admin token, and MACs
