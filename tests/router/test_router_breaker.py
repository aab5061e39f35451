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


def test_half_open_after_cooldown_probes_then_closes_after_m_successes():
    clock = FakeClock(0.0)
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 4.9
    assert b.state is BreakerState.OPEN
    clock.now = 5.0
    assert b.state is BreakerState.HALF_OPEN and not b.probing()
    assert b.allow() and b.probing()
    b.record_success()
    assert b.state is BreakerState.HALF_OPEN and not b.probing()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_half_open_admits_concurrent_requests_as_probes():
    """The regression of "after a worker restarts, the half-open breaker turns concurrent
    requests into 503s": every concurrent request is let through as a probe."""
    clock = FakeClock(0.0)
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 5.0
    assert all(b.allow() for _ in range(8)) and b.probing()
    for _ in range(8):
        b.record_success()
    assert b.state is BreakerState.CLOSED and not b.probing()


def test_recovered_worker_is_probed_before_the_cooldown_ends():
    clock = FakeClock(0.0)
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 1.0
    assert not b.available()
    b.recovered()  # a health check found it healthy again (restarted)
    assert b.state is BreakerState.HALF_OPEN and b.available()
    b.record_failure()  # still broken: open again, with a fresh cool-down
    assert b.state is BreakerState.OPEN
    clock.now = 5.9
    assert b.state is BreakerState.OPEN
    b.recovered()
    b.record_success()
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
    assert b.allow() and b.probing()
    b.release()
    assert not b.probing() and b.available() and b.state is BreakerState.HALF_OPEN
