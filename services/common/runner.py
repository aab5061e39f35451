"""Run an aiohttp app on uvloop with a graceful SIGTERM drain.

We do not use `web.run_app`: its SIGTERM handling closes the listening socket at once, so
late clients see "connection refused" instead of a 503 they (and routers) can act on. Here a
signal flips the app's `Lifecycle` to DRAINING (new requests get 503), in-flight requests get
`grace_seconds` to finish, then the runner cleans up and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl

import uvloop
from aiohttp import web

from services.common.lifecycle import LIFECYCLE_KEY
from services.common.limits import runner_options

log = logging.getLogger(__name__)

# After the drain grace period, aiohttp gets this long to close connections before cancelling.
_SHUTDOWN_TIMEOUT_S = 0.5


async def serve_until_signalled(app: web.Application, host: str, port: int, grace_seconds: float,
                                ssl_context: ssl.SSLContext | None = None) -> int:
    """Serve `app` until SIGTERM/SIGINT (exit 0 after draining) or a startup failure (exit 1);
    HTTPS when `ssl_context` is given."""
    lifecycle = app[LIFECYCLE_KEY]
    runner = web.AppRunner(
        app, handle_signals=False, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        **runner_options(app),  # header timeout (keep-alive), lingering: services.common.limits
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    log.info("listening on %s://%s:%d", "https" if ssl_context else "http", host, port)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(lifecycle.wait_finished())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            lifecycle.begin_drain()
            log.info("draining: %d request(s) in flight, grace %.1fs", lifecycle.in_flight, grace_seconds)
            if not await lifecycle.wait_idle(grace_seconds):
                log.warning("grace period over with %d request(s) in flight", lifecycle.in_flight)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    failed = lifecycle.failure is not None
    lifecycle.mark_stopped()
    return 1 if failed else 0


def run_service(app: web.Application, host: str, port: int, grace_seconds: float,
                ssl_context: ssl.SSLContext | None = None) -> int:
    return uvloop.run(serve_until_signalled(app, host, port, grace_seconds, ssl_context))
