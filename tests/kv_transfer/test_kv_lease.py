"""LeaseTable: one end per lease, 404 vs 410, heartbeats, reaping (fake clock)."""

from __future__ import annotations

import pytest

from services.common.errors import GoneError, NotFoundError
from services.kv_transfer.lease import LeaseState, LeaseTable
from shared.protocol.messages import LeaseRef
from tests.support.clock import FakeClock


def table() -> tuple[LeaseTable, FakeClock]:
    clock = FakeClock()
    return LeaseTable(30.0, 20.0, clock), clock


def test_lifecycle_release_then_reads_are_gone() -> None:
    t, _ = table()
    lease = t.create("r", [1, 2], 20, ["a", "b"])
    assert t.readable("r", lease.lease_id) is lease and t.held_blocks == 2
    assert t.end("r", LeaseState.RELEASED, lease.lease_id) is lease
    assert t.end("r", LeaseState.RELEASED) is None  # exactly once: abort after release is a no-op
    with pytest.raises(GoneError) as err:
        t.readable("r", lease.lease_id)
    assert err.value.code == "kv_lease_released" and t.held_blocks == 0


def test_unknown_is_404_and_stale_lease_id_is_410() -> None:
    t, _ = table()
    with pytest.raises(NotFoundError):
        t.readable("nope", "x")
    old = t.create("r", [1], 4, ["a"])
    t.end("r", LeaseState.RELEASED)
    new = t.create("r", [5], 4, ["b"])  # the request id is reused by a new lease
    with pytest.raises(GoneError) as err:
        t.readable("r", old.lease_id)
    assert err.value.code == "kv_lease_stale"
    assert t.readable("r", new.lease_id) is new
    assert t.end("r", LeaseState.RELEASED, old.lease_id) is None  # a stale release is ignored


def test_expiry_heartbeat_and_reap() -> None:
    t, clock = table()
    lease = t.create("r", [1, 2, 3], 10, ["a", "b", "c"])
    clock.now += 25
    [status] = t.heartbeat([LeaseRef("r", lease.lease_id)])
    assert status.state == "held" and lease.expires == pytest.approx(clock.now + 20)
    clock.now += 10  # within the extension, past the original 30 s
    assert t.reap() == [] and t.readable("r", lease.lease_id)
    assert t.oldest_age() == pytest.approx(35)
    clock.now += 11
    with pytest.raises(GoneError) as err:  # expired before the reaper ran: still never readable
        t.readable("r", lease.lease_id)
    assert err.value.code == "kv_lease_expired"
    assert t.heartbeat([LeaseRef("r", lease.lease_id)])[0].state == "held"  # not extended...
    assert lease.expires < clock.now
    assert t.reap() == [lease] and lease.state is LeaseState.EXPIRED
    assert t.held_blocks == 0 and t.oldest_age() == 0.0
    assert t.status("r").state == "expired"


def test_tombstones_are_bounded() -> None:
    t = LeaseTable(30.0, 20.0, FakeClock(), tombstones=2)
    for i in range(4):
        t.create(f"r{i}", [i], 1, ["a"])
        t.end(f"r{i}", LeaseState.RELEASED)
    assert t.status("r0").state == "unknown" and t.status("r3").state == "released"
