"""Per-worker circuit breaker: closed -> open -> half-open -> closed.

Closed: failures are counted in a sliding window; `failures` of them within `window_s` open the
breaker. Open: the worker gets no traffic until `cooldown_s` has passed, then the breaker is
half-open. Half-open: exactly one probe request at a time; `successes` consecutive successes
close it, any failure re-opens it (and restarts the cool-down).
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

    `allow()` is asked before dispatching; it is side-effect free except in half-open, where it
    reserves the single probe slot, which `record_success` / `record_failure` give back.
    """

    def __init__(self, config: BreakerConfig, clock: Clock = time.monotonic) -> None:
        self._cfg = config
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures: deque[float] = deque()
        self._opened_at = 0.0
        self._successes = 0
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        """The current state, moving open -> half-open once the cool-down has passed."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._cfg.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._successes = 0
            self._probe_in_flight = False
        return self._state

    def available(self) -> bool:
        """Whether a request may be sent now (without reserving the half-open probe)."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probe_in_flight)

    def allow(self) -> bool:
        """Like `available`, and in half-open reserve the probe slot."""
        if not self.available():
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._probe_in_flight = False
            self._successes += 1
            if self._successes >= self._cfg.successes:
                self._state = BreakerState.CLOSED
                self._failures.clear()

    def release(self) -> None:
        """Give back a reserved half-open probe without a verdict (the request was cancelled)."""
        self._probe_in_flight = False

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
        self._probe_in_flight = False
        self._successes = 0
