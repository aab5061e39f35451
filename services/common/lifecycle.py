"""Service lifecycle: starting -> ready -> draining -> stopped (or failed), plus in-flight tracking.

The readiness gate answers 503 on guarded paths until the service is ready and again once it
drains (SIGTERM), while requests already admitted run to completion; `wait_idle` lets the
runner wait for them up to a grace period.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

from aiohttp import web

from services.common.errors import ServiceUnavailableError
from services.common.middleware import PathPredicate


class ServiceState(StrEnum):
    STARTING = "starting"  # listening, resources (model) still loading
    READY = "ready"
    DRAINING = "draining"  # SIGTERM received: no new requests, in-flight ones finish
    STOPPED = "stopped"
    FAILED = "failed"  # a resource failed (to load, or later); the runner exits non-zero


class Lifecycle:
    """The state of one service plus the count of in-flight guarded requests.

    Owned by the app (an `AppKey`), mutated only on the event loop thread.
    """

    def __init__(self) -> None:
        self.state = ServiceState.STARTING
        self.failure: str | None = None
        self.failure_code = "startup_failed"  # the 503s' error code once FAILED
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._finished = asyncio.Event()  # failed or stopped: the runner should exit

    @property
    def ready(self) -> bool:
        return self.state is ServiceState.READY

    def mark_ready(self) -> None:
        if self.state is ServiceState.STARTING:
            self.state = ServiceState.READY

    def mark_failed(self, reason: str) -> None:
        """A resource failed to start: refuse everything and let the runner exit now."""
        self.fail(reason, "startup_failed")
        self.finish()

    def fail(self, reason: str, code: str) -> None:
        """A resource failed while serving: from now on guarded paths and /health answer 503
        with `code`; the caller drains what is in flight, then calls `finish`."""
        self.state = ServiceState.FAILED
        self.failure, self.failure_code = reason, code

    def finish(self) -> None:
        """Let the runner exit (non-zero when FAILED)."""
        self._finished.set()

    def begin_drain(self) -> None:
        if self.state in (ServiceState.STARTING, ServiceState.READY):
            self.state = ServiceState.DRAINING

    def mark_stopped(self) -> None:
        if self.state is not ServiceState.FAILED:
            self.state = ServiceState.STOPPED
        self._finished.set()

    async def wait_finished(self) -> None:
        await self._finished.wait()

    @contextmanager
    def track(self) -> Iterator[None]:
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight, False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def unavailable(self) -> ServiceUnavailableError:
        if self.state is ServiceState.STARTING:
            message, code = "The service is starting (model loading)", "not_ready"
        elif self.state is ServiceState.FAILED and self.failure_code == "startup_failed":
            message, code = f"The service failed to start: {self.failure}", "startup_failed"
        elif self.state is ServiceState.FAILED:
            message, code = f"The service failed: {self.failure}", self.failure_code
        else:
            message, code = "The service is shutting down", "draining"
        return ServiceUnavailableError(message, code=code, headers={"Retry-After": "1"})


LIFECYCLE_KEY = web.AppKey("lifecycle", Lifecycle)


def readiness_middleware(guarded: PathPredicate) -> Any:
    """503 on guarded paths unless READY; counts admitted requests for draining."""

    @web.middleware
    async def readiness(request: web.Request, handler: Any) -> web.StreamResponse:
        if not guarded(request.path):
            return await handler(request)
        lifecycle = request.app[LIFECYCLE_KEY]
        if not lifecycle.ready:
            raise lifecycle.unavailable()
        with lifecycle.track():
            return await handler(request)

    return readiness
