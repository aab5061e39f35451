"""Per-worker circuit breaker: closed -> open -> half-open -> closed.

Closed: failures are counted in a sliding window; `failures` of them within `window_s` open the
breaker. Open: the worker gets no traffic until `cooldown_s` has passed, or until a health
check finds it healthy again after it was not (`recovered`: a restarted worker), then the
breaker is half-open. Half-open: every request it gets is a probe; `successes` successes close
it, any failure re-opens it (and restarts the cool-down). Routing prefers workers that are not
probing, but when a half-open worker is the only one left, concurrent requests all go to it
rather than failing with 503: a healthy worker gets back in without failing the requests that
arrive at that moment, and a broken one fails them no worse than a 503 would.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from services.router.config import BreakerConfig

Clock = Callable[[], float]


class BreakerState(StrEnum):
    """The three classic states; the value is what metadata and metrics show."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def gauge(self) -> int:
        """Numeric value for the Prometheus gauge (0 closed, 1 half-open, 2 open)."""
        return {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}[self]


class CircuitBreaker:
    """State machine for one worker; the clock is injectable so tests need no sleeping.

    `allow()` is called when a request is dispatched; in half-open it counts a probe in flight,
    which `record_success` / `record_failure` / `release` end.
    """

    def __init__(self, config: BreakerConfig, clock: Clock = time.monotonic) -> None:
        self._cfg = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures: deque[float] = deque()
        self._opened_at = 0.0
        self._successes = 0
        self._probes = 0  # half-open: probe requests in flight

    @property
    def state(self) -> BreakerState:
        """The current state, moving open -> half-open once the cool-down has passed."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._cfg.cooldown_s:
            self._half_open()
        return self._state

    def _half_open(self) -> None:
        self._state = BreakerState.HALF_OPEN
        self._successes = 0
        self._probes = 0

    def available(self) -> bool:
        """Whether a request may be sent now: closed, or half-open (it is then a probe)."""
        return self.state is not BreakerState.OPEN

    def probing(self) -> bool:
        """Half-open with a probe in flight: routing prefers other workers."""
        return self.state is BreakerState.HALF_OPEN and self._probes > 0

    def allow(self) -> bool:
        """Like `available`, and in half-open count the request as a probe in flight."""
        if not self.available():
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probes += 1
        return True

    def recovered(self) -> None:
        """A health check found the worker healthy after it was not: probe it now rather than
        after the rest of the cool-down."""
        if self.state is BreakerState.OPEN:
            self._half_open()

    def record_success(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)
            self._successes += 1
            if self._successes >= self._cfg.successes:
                self._state = BreakerState.CLOSED
                self._failures.clear()

    def release(self) -> None:
        """End a half-open probe without a verdict (the request was cancelled)."""
        self._probes = max(0, self._probes - 1)

    def record_failure(self) -> None:
        now = self._clock()
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        if state is BreakerState.OPEN:
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self._cfg.window_s:
            self._failures.popleft()
        if len(self._failures) >= self._cfg.failures:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._failures.clear()
        self._probes = 0
        self._successes = 0
