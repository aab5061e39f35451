"""Leases on a prefill's finished KV blocks (pull mode).

A lease is created when a prompt's blocks are offered, extended by decode heartbeats, and ends
exactly once: RELEASED (the decode is done, or the request was aborted) or EXPIRED (reaped).
The table is synchronous and owned by the event loop; the caller frees blocks for every lease
a transition returns, *after* the state changed, so a read that starts later always sees the
lease gone (410) instead of stale bytes. Ended leases leave a bounded tombstone so a late read
gets 410 rather than 404.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from services.common.errors import BadRequestError, GoneError, NotFoundError
from shared.protocol.messages import LeaseRef, LeaseStatus


class LeaseState(StrEnum):
    HELD = "held"  # blocks readable until `expires`
    RELEASED = "released"  # the decode released it, or the request was aborted
    EXPIRED = "expired"  # no heartbeat in time; reaped


@dataclass
class Lease:
    """Mutable lease record; `created`/`expires` are monotonic seconds."""

    request_id: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int
    digests: list[str]
    created: float
    expires: float
    state: LeaseState = LeaseState.HELD

    def status(self, now: float) -> LeaseStatus:
        left = max(0.0, self.expires - now) if self.state is LeaseState.HELD else 0.0
        return LeaseStatus(self.request_id, self.state.value, left)


class LeaseTable:
    """Active leases by request id, plus tombstones of ended ones (see module doc)."""

    def __init__(self, lease_seconds: float, extension_seconds: float,
                 clock: Callable[[], float] = time.monotonic, tombstones: int = 4096) -> None:
        self.lease_seconds = lease_seconds
        self.extension_seconds = extension_seconds
        self.clock = clock
        self._active: dict[str, Lease] = {}
        self._ended: OrderedDict[str, Lease] = OrderedDict()
        self._max_tombstones = tombstones

    def create(self, request_id: str, block_ids: list[int], num_tokens: int,
               digests: list[str]) -> Lease:
        if request_id in self._active:
            raise BadRequestError(f"request {request_id!r} already holds a KV lease",
                                  code="kv_lease_exists")
        now = self.clock()
        lease = Lease(request_id, secrets.token_hex(8), list(block_ids), num_tokens,
                      list(digests), now, now + self.lease_seconds)
        self._active[request_id] = lease
        self._ended.pop(request_id, None)
        return lease

    def readable(self, request_id: str, lease_id: str) -> Lease:
        """The lease if it may be read now; 404 unknown, 410 ended/expired/stale lease id."""
        lease = self._active.get(request_id)
        if lease is not None and lease.lease_id == lease_id:
            if lease.expires <= self.clock():
                raise GoneError(f"KV lease of request {request_id!r} expired",
                                code="kv_lease_expired")
            return lease
        ended = self._ended.get(request_id)
        if lease is not None or (ended is not None and ended.lease_id != lease_id):
            raise GoneError(f"stale KV transfer params for request {request_id!r} "
                            "(lease id does not match the current lease)", code="kv_lease_stale")
        if ended is not None:
            raise GoneError(f"KV lease of request {request_id!r} is {ended.state.value}",
                            code=f"kv_lease_{ended.state.value}")
        raise NotFoundError(f"no KV lease for request {request_id!r}", code="kv_lease_unknown")

    def end(self, request_id: str, state: LeaseState, lease_id: str | None = None) -> Lease | None:
        """HELD -> `state`. Returns the lease if this call ended it (the caller frees blocks);
        None when it was unknown, already ended, or `lease_id` names another lease."""
        assert state is not LeaseState.HELD
        lease = self._active.get(request_id)
        if lease is None or (lease_id is not None and lease.lease_id != lease_id):
            return None
        del self._active[request_id]
        lease.state = state
        self._ended[request_id] = lease
        while len(self._ended) > self._max_tombstones:
            self._ended.popitem(last=False)
        return lease

    def status(self, request_id: str) -> LeaseStatus:
        lease = self._active.get(request_id) or self._ended.get(request_id)
        if lease is None:
            return LeaseStatus(request_id, "unknown", 0.0)
        return lease.status(self.clock())

    def heartbeat(self, refs: list[LeaseRef]) -> list[LeaseStatus]:
        """Extend each named held lease to max(expires, now + extension)."""
        now = self.clock()
        out = []
        for ref in refs:
            lease = self._active.get(ref.remote_request_id)
            if lease is not None and lease.lease_id == ref.lease_id and lease.expires > now:
                lease.expires = max(lease.expires, now + self.extension_seconds)
                out.append(lease.status(now))
            else:
                out.append(self.status(ref.remote_request_id))
        return out

    def reap(self) -> list[Lease]:
        """End every lease past its expiry; returns them (the caller frees their blocks)."""
        now = self.clock()
        due = [rid for rid, lease in self._active.items() if lease.expires <= now]
        return [lease for rid in due if (lease := self.end(rid, LeaseState.EXPIRED))]

    def active_ids(self) -> list[str]:
        return list(self._active)

    @property
    def held_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._active.values())

    def oldest_age(self) -> float:
        now = self.clock()
        return max((now - lease.created for lease in self._active.values()), default=0.0)

    def __len__(self) -> int:
        return len(self._active)
