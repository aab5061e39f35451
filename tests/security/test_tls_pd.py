"""P/D over TLS on every hop, and mTLS on the KV hop, with a CA the test makes.

client -(https)-> router -(https)-> prefill and decode APIs, decode <-(TLS)-> prefill KV
services, in pull and push mode: the answer is the mixed (plain, non-P/D) worker's greedy
output, token for token. With `require_client_cert` on the prefill's KV listener a decode
without a client certificate is refused at the TLS handshake: the client gets an OpenAI error
envelope naming TLS, and neither worker keeps a block; a decode with a certificate from the
CA gets the mixed answer. Plain HTTP to a TLS listener fails at once, and the listener goes
on serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from services.common.tls import TLSFiles, client_context
from services.router.app import create_app
from services.router.config import RetryConfig, RouterConfig
from services.worker.config import WorkerConfig
from tests.support.certs import TestCA
from tests.support.pd import Answer, metadata, post, settle_to_zero
from tests.support.pd_mesh import MODEL, make_model, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all

COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog " * 6,
        "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@dataclasses.dataclass
class TLSMesh:
    ca: TestCA
    workers: dict[str, WorkerThread]

    def __getitem__(self, name: str) -> WorkerThread:
        return self.workers[name]

    def client_ssl(self) -> ssl.SSLContext:
        return client_context(str(self.ca.ca))


def _with_tls(config: WorkerConfig, files: TLSFiles, require_client_cert: bool = False
              ) -> WorkerConfig:
    assert config.kv is not None
    kv = dataclasses.replace(config.kv, tls=files, require_client_cert=require_client_cert)
    return dataclasses.replace(config, tls=files, kv=kv)


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSMesh]:
    root = tmp_path_factory.mktemp("tls")
    model = make_model(root / "tiny", seed=0)
    ca = TestCA(root / "pki")
    no_cert = TLSFiles(ca=str(ca.ca))  # trusts the CA, has no certificate of its own
    configs = {
        "mixed": worker_config(model, "mixed"),  # the plain reference
        "prefill": _with_tls(worker_config(model, "prefill"), ca.files("prefill")),
        "decode": _with_tls(worker_config(model, "decode"), ca.files("decode")),
        "push_prefill": _with_tls(worker_config(model, "prefill", "push"),
                                  ca.files("push-prefill")),
        "push_decode": _with_tls(worker_config(model, "decode", "push"),
                                 ca.files("push-decode")),
        "mtls_prefill": _with_tls(worker_config(model, "prefill"), ca.files("mtls-prefill"),
                                  require_client_cert=True),
        # A decode that reaches TLS peers but has no client certificate (plain listeners).
        "nocert_decode": dataclasses.replace(
            worker_config(model, "decode"), tls=no_cert,
            kv=dataclasses.replace(worker_config(model, "decode").kv, tls=no_cert)),
    }
    workers = start_workers(configs)
    try:
        yield TLSMesh(ca, workers)
    finally:
        stop_all(workers)


@asynccontextmanager
async def tls_router(mesh: TLSMesh, prefill: str, decode: str) -> AsyncIterator[str]:
    """An HTTPS router in front of `prefill` and `decode`; yields its URL once servable."""
    files = mesh.ca.files("router")
    config = RouterConfig(prefill_urls=(mesh[prefill].url,), decode_urls=(mesh[decode].url,),
                          health_interval_s=0.05, health_timeout_s=2.0, tls=files,
                          retry=RetryConfig(max_attempts=1))
    server = TestServer(create_app(config), host="127.0.0.1")
    await server.start_server(ssl=files.server_context())
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=mesh.client_ssl())) as s:
            for _ in range(200):
                async with s.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the TLS router never became servable")
        yield url
    finally:
        await server.close()


@asynccontextmanager
async def https_session(mesh: TLSMesh) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=mesh.client_ssl())) as session:
        yield session


async def reference(s: aiohttp.ClientSession, mesh: TLSMesh) -> Answer:
    ref = await post(s, mesh["mixed"].url + COMPLETIONS, BODY)
    assert ref.status == 200, ref.body
    assert len(set(ref.token_ids)) > 3  # the output depends on the (transferred) KV
    return ref


def assert_transferred(got: Answer, ref: Answer) -> None:
    assert got.status == 200, got.body or got.chunks
    assert got.token_ids == ref.token_ids
    assert got.phases["decision"] == "prefill_decode"
    assert got.phases["kv_recomputed"] is False and got.phases["kv_bytes"] > 0


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_pd_over_tls_on_every_hop_equals_mixed(tls_mesh: TLSMesh, mode: str) -> None:
    prefill, decode = ("prefill", "decode") if mode == "pull" else ("push_prefill",
                                                                    "push_decode")
    assert tls_mesh[prefill].url.startswith("https://")
    async with https_session(tls_mesh) as s, tls_router(tls_mesh, prefill, decode) as router:
        assert router.startswith("https://")
        md = await metadata(s, tls_mesh[prefill].url)
        assert md["kv_endpoint"]["tls"] is True  # how a router tells push decodes to use TLS
        ref = await reference(s, tls_mesh)
        got = await post(s, router + COMPLETIONS, BODY)
        assert_transferred(got, ref)
        streamed = await post(s, router + COMPLETIONS, {**BODY, "stream": True})
        assert streamed.status == 200 and streamed.token_ids == ref.token_ids
        await settle_to_zero(s, tls_mesh[prefill].url, tls_mesh[decode].url)


async def test_mtls_kv_refuses_a_decode_without_client_cert(
        tls_mesh: TLSMesh, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pdmesh.kv_transfer")
    async with https_session(tls_mesh) as s, \
            tls_router(tls_mesh, "mtls_prefill", "nocert_decode") as router:
        got = await post(s, router + COMPLETIONS, BODY)
        assert got.status == 502, got.body
        error = got.error
        assert error is not None and error["code"] == "kv_peer_tls", error
        assert "TLS" in error["message"] and "--tls-cert" in error["message"]
        assert any(r.getMessage() == error["message"] for r in caplog.records)  # decode's log
        # The prefill's lease was released (by the router) and the decode freed its slot.
        await settle_to_zero(s, tls_mesh["mtls_prefill"].url, tls_mesh["nocert_decode"].url)


async def test_mtls_kv_serves_a_decode_with_client_cert(tls_mesh: TLSMesh) -> None:
    async with https_session(tls_mesh) as s, \
            tls_router(tls_mesh, "mtls_prefill", "decode") as router:
        ref = await reference(s, tls_mesh)
        assert_transferred(await post(s, router + COMPLETIONS, BODY), ref)
        await settle_to_zero(s, tls_mesh["mtls_prefill"].url, tls_mesh["decode"].url)


async def test_plain_http_to_a_tls_listener_fails_cleanly(tls_mesh: TLSMesh) -> None:
    prefill = tls_mesh["prefill"]
    async with https_session(tls_mesh) as s, tls_router(tls_mesh, "prefill", "decode") as router:
        md = await metadata(s, prefill.url)
        plain_targets = [router.replace("https://", "http://"),
                         prefill.url.replace("https://", "http://"),
                         f"http://{md['kv_endpoint']['host']}:{md['kv_endpoint']['port']}"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as plain:
            for url in plain_targets:
                with pytest.raises(aiohttp.ClientConnectionError):
                    async with plain.get(url + "/health") as resp:
                        await resp.read()
            # A client that does not trust the CA is refused by its own certificate check.
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with plain.get(router + "/health") as resp:
                    await resp.read()
        # The listeners go on serving TLS clients.
        async with s.get(router + "/health") as resp:
            assert resp.status == 200
        async with s.get(prefill.url + "/health") as resp:
            assert resp.status == 200

