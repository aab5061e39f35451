"""Every listener (router, worker HTTP, KV service) bounds what a client may hold: a request
head that never completes, a body that trickles in, and a body too large, refused from its
headers. Regression tests for "No header or body read timeout": partial requests and a huge
Content-Length held connections open indefinitely, with no 413 up front.

Each check speaks raw HTTP over asyncio streams (no client library that would complete a
request for us) to the app run with the production runner settings, with tiny timeouts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from services.common.limits import runner_options
from services.router.app import create_app as router_app
from services.router.config import RouterConfig
from services.worker.app import create_app as worker_app
from tests.support.fake_engine import FakeEngine
from tests.support.kv import start_node
from tests.support.worker import factory_for, worker_config

TIMEOUT_S = 0.3  # the servers' header and body timeouts here
LIMIT = 4096  # the servers' body limit here
WAIT_S = 30.0  # how long a test waits for the server to act: a hang, not a speed, fails it


@asynccontextmanager
async def listening(service: str, header_s: float = TIMEOUT_S, body_s: float = TIMEOUT_S
                    ) -> AsyncIterator[tuple[int, str]]:
    """(port, a POST path) of `service` run as in production, with tiny limits."""
    limits = {"header_timeout_s": header_s, "body_timeout_s": body_s}
    if service == "kv":
        node = await start_node("prefill", **limits)
        try:
            yield node.service.identity.node.kv_port, "/kv/v1/handshake"
        finally:
            await node.runner.cleanup()
        return
    if service == "router":
        app = router_app(RouterConfig(max_body_bytes=LIMIT, **limits))
    else:
        app = worker_app(worker_config(max_body_size=LIMIT, **limits), factory_for(FakeEngine()))
    runner = web.AppRunner(app, handler_cancellation=True, **runner_options(app))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], "/v1/completions"
    finally:
        await runner.cleanup()


async def closed_without_answer(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection having sent nothing."""
    return await asyncio.wait_for(reader.read(), WAIT_S) == b""


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), WAIT_S)
    return int(lines[0].split()[1]), json.loads(body)


SERVICES = ["router", "worker", "kv"]


@pytest.mark.parametrize("service", SERVICES)
async def test_a_request_head_never_completed_is_cut_off(service) -> None:
    async with listening(service, body_s=WAIT_S * 10) as (port, path):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: app".encode())
        await writer.drain()
        assert await closed_without_answer(reader)
        writer.close()
        # An idle connection (no byte at all) is closed the same way.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_without_answer(reader)
        writer.close()


@pytest.mark.parametrize("service", SERVICES)
async def test_a_huge_content_length_gets_413_before_any_body_byte(service) -> None:
    async with listening(service) as (port, path):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {10**12}\r\n\r\n".encode())  # and never a body byte
        await writer.drain()
        status, body = await answer(reader)
        assert status == 413, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "request_too_large"
        writer.close()


@pytest.mark.parametrize("service", SERVICES)
async def test_a_body_slower_than_the_deadline_is_cut_off(service) -> None:
    async with listening(service, header_s=WAIT_S * 10) as (port, path):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 100\r\n\r\n{{\"a\": ".encode())  # 6 of 100 bytes
        await writer.drain()
        assert await closed_without_answer(reader)
        writer.close()


@pytest.mark.parametrize("service", ["router", "worker"])
async def test_a_chunked_body_is_bounded_too(service) -> None:
    """No Content-Length to refuse from: the body is bounded as it is read (413)."""
    async with listening(service) as (port, path):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        chunk = b"x" * 1024
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(LIMIT // len(chunk) + 2):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        status, body = await answer(reader)
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        writer.close()
