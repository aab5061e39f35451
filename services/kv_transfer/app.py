"""The KV-transfer aiohttp app, run on its own port inside every prefill/decode worker.

Same skeleton as the other services: `create_app(config, service)` builds the app with one
route table (/kv/v1/), typed AppKey state, middlewares (OpenAI error envelope outermost, then
size and time limits, then authentication: services.kv_transfer.auth), and a cleanup context that owns the service's runtime resources (HTTP client session,
heartbeat and reaper tasks). `start_server` binds the socket first so an ephemeral port is
known to the service (it goes into kv_transfer_params) before anything starts.

Dispatch is by route; each handler names its message class. Every POST body is an envelope
(shared.protocol.codec.seal): `_open` compares the compat hash first, then decodes the message;
every route but the handshake and the release also requires the caller's engine id to have
completed a handshake. Replies are msgpack messages; errors are the OpenAI envelope
(services.common.errors.error_middleware).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from aiohttp import web

from services.common.errors import BadRequestError, error_middleware
from services.common.limits import install_limits, limits_middleware, runner_options
from services.common.tls import exposure_warning
from services.kv_transfer.auth import kv_auth_middleware
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.handshake import check_hash, negotiate
from services.kv_transfer.service import KVTransferService
from shared.protocol.codec import EnvelopeReader, Message, ProtocolError, encode
from shared.protocol.messages import (
    HandshakeAccepted,
    HeartbeatRequest,
    NodeInfo,
    PullRequest,
    PushAbort,
    PushComplete,
    PushKeepalive,
    PushRegister,
    PushWrite,
    ReleaseRequest,
    ServiceInfo,
)

SERVICE_KEY = web.AppKey("kv_service", KVTransferService)
M = TypeVar("M", bound=Message)
# Messages sent by a peer engine after its handshake: all carry the sender's engine_id.
P = TypeVar("P", PullRequest, ReleaseRequest, HeartbeatRequest, PushRegister, PushWrite,
            PushComplete, PushKeepalive, PushAbort)
routes = web.RouteTableDef()


def reply(msg: Message) -> web.Response:
    return web.Response(body=encode(msg), content_type="application/msgpack")


class BodyBuffers:
    """Reused receive buffers for push-write bodies (an envelope plus one chunk of <= 4 MiB).

    aiohttp's `request.read()` joins the received pieces, grows a bytearray and copies it into
    fresh bytes: three copies, the last ones into fresh 4 MiB allocations that page-fault on
    every write. Copying each piece straight into a reused buffer is one copy. A buffer is lent
    to one handler at a time, which has scattered the chunk into the cache before it returns;
    up to `keep` buffers are kept for the next writes (concurrent writes allocate more).
    """

    def __init__(self, limit: int, keep: int = 2) -> None:
        self._limit, self._keep = limit, keep
        self._free: list[bytearray] = []

    @asynccontextmanager
    async def body(self, request: web.Request) -> AsyncIterator[bytes | memoryview]:
        n = request.content_length
        if n is None or n > self._limit or request.content.at_eof():
            # Chunked or oversized (aiohttp answers 413), or already read (HMAC middleware).
            yield await request.read()
            return
        buf = self._free.pop() if self._free else bytearray(self._limit)
        try:
            view, pos = memoryview(buf), 0
            while pos < n:
                piece, _ = await request.content.readchunk()  # as received, no join
                if not piece or pos + len(piece) > n:
                    raise BadRequestError("request body does not match its Content-Length",
                                          code="kv_bad_envelope")
                view[pos:pos + len(piece)] = piece
                pos += len(piece)
            yield view[:n]
        finally:
            if len(self._free) < self._keep:
                self._free.append(buf)


async def _envelope(request: web.Request,
                    body: bytes | memoryview | None = None) -> EnvelopeReader:
    try:
        return EnvelopeReader(await request.read() if body is None else body)
    except ProtocolError as exc:
        raise BadRequestError(f"not a KV envelope: {exc}", code="kv_bad_envelope") from None


def _message(reader: EnvelopeReader, cls: type[M]) -> M:
    try:
        return reader.message(cls)
    except ProtocolError as exc:
        raise BadRequestError(f"bad {cls.TAG} message: {exc}", code="kv_bad_message") from None


async def _open(request: web.Request, cls: type[M], handshake: bool,
                body: bytes | memoryview | None = None) -> tuple[KVTransferService, M,
                                                                  EnvelopeReader]:
    service = request.app[SERVICE_KEY]
    reader = await _envelope(request, body)
    check_hash(service.identity, reader, service.config.allow_incompatible, handshake)
    return service, _message(reader, cls), reader


async def _open_peer(request: web.Request, cls: type[P], body: bytes | memoryview | None = None
                     ) -> tuple[KVTransferService, P, EnvelopeReader]:
    """As `_open`, and the sender must have completed a handshake (409 otherwise)."""
    service, msg, reader = await _open(request, cls, handshake=False, body=body)
    service.ctx.registry.require(msg.engine_id)
    return service, msg, reader


@routes.get("/kv/v1/info")
async def info(request: web.Request) -> web.Response:
    ident = request.app[SERVICE_KEY].identity
    return reply(ServiceInfo(ident.node, ident.compat_hash, ident.factors.to_wire()))


@routes.post("/kv/v1/handshake")
async def handshake(request: web.Request) -> web.Response:
    service, peer, _ = await _open(request, NodeInfo, handshake=True)
    negotiate(service.identity.node, peer)
    service.ctx.registry.admit(peer)
    ident = service.identity
    return reply(HandshakeAccepted(ident.node, ident.compat_hash, ident.factors.to_wire()))


@routes.post("/kv/v1/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    service, msg, _ = await _open_peer(request, PullRequest)
    source = service.pull.prefill
    lease = source.open(msg)
    return await source.stream(request, lease)


@routes.post("/kv/v1/release")
async def release(request: web.Request) -> web.Response:
    """Needs neither a handshake nor a matching hash: a release only frees blocks, and the
    lease id it names is the capability. So a decode that refused (or was refused by) this
    prefill as incompatible still frees the blocks at once instead of waiting out the lease."""
    service = request.app[SERVICE_KEY]
    msg = _message(await _envelope(request), ReleaseRequest)
    return reply(service.pull.prefill.release(msg))


@routes.post("/kv/v1/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    service, msg, _ = await _open_peer(request, HeartbeatRequest)
    return reply(service.pull.prefill.heartbeat(msg))


@routes.post("/kv/v1/push/register")
async def push_register(request: web.Request) -> web.Response:
    service, msg, _ = await _open_peer(request, PushRegister)
    return reply(service.push.prefill.register(msg))


@routes.post("/kv/v1/push/write")
async def push_write(request: web.Request) -> web.Response:
    async with request.app[BODY_BUFFERS_KEY].body(request) as body:
        service, msg, reader = await _open_peer(request, PushWrite, body)
        # Synchronous: the chunk is in the cache before the buffer goes back to the pool.
        return reply(service.push.decode.write(msg, reader.trailing()))


@routes.post("/kv/v1/push/complete")
async def push_complete(request: web.Request) -> web.Response:
    service, msg, _ = await _open_peer(request, PushComplete)
    return reply(service.push.decode.complete(msg))


@routes.post("/kv/v1/push/keepalive")
async def push_keepalive(request: web.Request) -> web.Response:
    service, msg, _ = await _open_peer(request, PushKeepalive)
    return reply(service.push.decode.keepalive(msg))


@routes.post("/kv/v1/push/abort")
async def push_abort(request: web.Request) -> web.Response:
    service, msg, _ = await _open_peer(request, PushAbort)
    return reply(service.push.on_abort(msg))


CONFIG_KEY = web.AppKey("kv_config", KVTransferConfig)
BODY_BUFFERS_KEY = web.AppKey("kv_body_buffers", BodyBuffers)


async def _service_lifetime(app: web.Application) -> AsyncIterator[None]:
    service = app[SERVICE_KEY]
    await service.start()
    try:
        yield
    finally:
        await service.close()


def create_app(config: KVTransferConfig, service: KVTransferService) -> web.Application:
    """The KV app; `service` is built by the worker (it also calls offer/fetch/send/receive)."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[error_middleware, limits_middleware(config.limits),
                     kv_auth_middleware(config.secret, config.signature_window)],
    )
    install_limits(app, config.limits)
    app[CONFIG_KEY] = config
    app[SERVICE_KEY] = service
    app[BODY_BUFFERS_KEY] = BodyBuffers(config.max_body_bytes)
    app.cleanup_ctx.append(_service_lifetime)
    app.add_routes(routes)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), reuse_port=False)
    sock.setblocking(False)
    return sock


async def start_server(config: KVTransferConfig, service: KVTransferService) -> web.AppRunner:
    """Bind, record the port in the service, start the app; `await runner.cleanup()` stops it."""
    sock = bind_socket(config.host, config.port)
    service.set_port(config.advertise_port or sock.getsockname()[1])
    exposure_warning("the KV-transfer service", config.host, sock.getsockname()[1],
                     config.tls.enabled, kv_secret=config.secret is not None)
    app = create_app(config, service)
    runner = web.AppRunner(app, handle_signals=False,
                           handler_cancellation=True, shutdown_timeout=2.0,
                           read_bufsize=config.max_chunk_bytes,  # push writes: one chunk
                           **runner_options(app))
    await runner.setup()
    ssl_context = config.tls.server_context(config.require_client_cert)
    await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    return runner
