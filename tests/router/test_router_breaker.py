"""The per-worker circuit breaker, driven by a fake clock."""

from __future__ import annotations

from services.router.breaker import BreakerState, CircuitBreaker
from services.router.config import BreakerConfig
from tests.support.clock import FakeClock


def _breaker(clock, **kw) -> CircuitBreaker:
    cfg = BreakerConfig(**{"failures": 3, "window_s": 10.0, "cooldown_s": 5.0, "successes": 2, **kw})
    return CircuitBreaker(cfg, clock)


def test_opens_after_n_failures_within_the_window():
    clock = FakeClock(0.0)
    b = _breaker(clock)
    for _ in range(2):
        b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allow() and not b.available()


def test_failures_outside_the_window_do_not_count():
    clock = FakeClock(0.0)
    b = _breaker(clock)
    b.record_failure()
    b.record_failure()
    clock.now = 11.0
    b.record_failure()
    assert b.state is BreakerState.CLOSED


def test_half_open_after_cooldown_allows_one_probe_then_closes_after_m_successes():
    clock = FakeClock(0.0)
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 4.9
    assert b.state is BreakerState.OPEN
    clock.now = 5.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # one probe at a time
    b.record_success()
    assert b.state is BreakerState.HALF_OPEN and b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_failure_in_half_open_reopens_and_restarts_the_cooldown():
    clock = FakeClock(0.0)
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 6.0
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    clock.now = 10.0
    assert b.state is BreakerState.OPEN
    clock.now = 11.0
    assert b.state is BreakerState.HALF_OPEN


def test_release_gives_the_probe_back_without_a_verdict():
    clock = FakeClock(0.0)
    b = _breaker(clock, failures=1)
    b.record_failure()
    clock.now = 5.0
    assert b.allow() and not b.available()
    b.release()
    assert b.available() and b.state is BreakerState.HALF_OPEN
