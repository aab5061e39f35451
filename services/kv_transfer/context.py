"""What every transfer mode shares: the context it runs in, its base class, its result.

Each mode is one `KVTransfer` subclass whose `mode` class attribute is the only source of the
mode in the compat hash (CompatFactors.for_transfer reads it from the class).

Metrics (`KVTransferMetrics`) are created against a registry passed in. Names follow the
project's `pdmesh:` prefix and vLLM's NIXL set (transfer time and bytes histograms, failed
transfers, expired leases), plus two gauges answered live (held blocks, oldest lease age).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.kv_transfer.codec import BufferPool
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.handshake import KVIdentity, PeerClient, PeerRegistry
from services.kv_transfer.store import CacheBlocks, KVBlockStore
from shared.protocol.messages import TokenLogprobWire

log = logging.getLogger("pdmesh.kv_transfer")


@dataclass(frozen=True)
class PulledKV:
    """KV now in local blocks, ready for the engine: `add_request(prefilled=PrefilledKV(
    block_ids, num_computed_tokens=num_tokens, first_token_id=first_token.token_id))`.

    The caller owns `block_ids`: it hands them to the engine, or returns them with
    `store.free(block_ids)` if the request is not admitted.
    """

    block_ids: list[int]
    num_tokens: int
    first_token: TokenLogprobWire
    num_bytes: int
    seconds: float


@dataclass
class KVContext:
    """The service state a transfer class works with; `peers` exists once the service runs."""

    config: KVTransferConfig
    identity: KVIdentity
    store: KVBlockStore
    geometry: CacheBlocks
    metrics: KVTransferMetrics
    registry: PeerRegistry
    clock: Callable[[], float]
    peer_client: PeerClient | None = None
    # Staging buffers reused across transfers (gather slots, receive staging): event loop only.
    buffers: BufferPool = field(default_factory=BufferPool)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def peers(self) -> PeerClient:
        if self.peer_client is None:
            raise RuntimeError("the KV service is not started")
        return self.peer_client

    def detach(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[None]:
        """Run `coro` in the background; failures are logged, `drain` awaits it."""
        task = asyncio.ensure_future(_logged(coro, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Await a cleanup that must finish even if the caller is cancelled meanwhile."""
        await asyncio.shield(self.detach(coro, what))

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def _logged(coro: Coroutine[Any, Any, Any], what: str) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("KV background step %r failed: %s: %s", what, type(exc).__name__, exc)


class KVTransfer:
    """Base of the transfer modes. Subclasses set `mode` and implement their legs."""

    mode: ClassVar[str]

    def __init__(self, ctx: KVContext) -> None:
        self.ctx = ctx

    async def start(self) -> None:
        """Start background work (heartbeats); called once the peer client exists."""

    async def close(self) -> None:
        """Stop background work and release everything still held."""

    def reap(self) -> None:
        """End whatever passed its deadline (called on a timer, or each engine step)."""

    @property
    def held_blocks(self) -> int:
        return 0

    def oldest_age(self) -> float:
        return 0.0


# ---- metrics -------------------------------------------------------------------------


# Seconds: a 2k-token SmolLM2 KV (44 MiB) moves in ~20-50 ms over loopback.
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB


class KVTransferMetrics:
    """The KV service's collectors; `bind` wires the gauges to the live transfer, `unbind`
    lets it go when the service closes.

    Labels: `mode` (pull/push) and `side` (send/receive) on the histograms, `reason` (the
    error code) on failures.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfer_seconds = Histogram(
            "pdmesh:kv_transfer_seconds", "Wall time of one KV transfer (blocks of one request)",
            ["mode", "side"], registry=registry, buckets=_SECONDS_BUCKETS)
        self.transfer_bytes = Histogram(
            "pdmesh:kv_transfer_bytes", "Bytes of KV moved by one transfer",
            ["mode", "side"], registry=registry, buckets=_BYTES_BUCKETS)
        self.failed_transfers = Counter(
            "pdmesh:kv_failed_transfers", "KV transfers that failed, by error code",
            ["mode", "reason"], registry=registry)
        self.expired_leases = Counter(
            "pdmesh:kv_expired_leases", "Prefill KV leases reaped without a release",
            registry=registry)
        self.held_blocks = Gauge(
            "pdmesh:kv_held_blocks", "KV blocks currently held under a lease or push slot",
            registry=registry)
        self.oldest_lease_age = Gauge(
            "pdmesh:kv_oldest_lease_age_seconds", "Age of the oldest held KV lease",
            registry=registry)

    def bind(self, held_blocks: Callable[[], float], oldest_age: Callable[[], float]) -> None:
        self.held_blocks.set_function(held_blocks)
        self.oldest_lease_age.set_function(oldest_age)

    def unbind(self) -> None:
        """Point the gauges at zero (a closed service holds nothing). The registry can outlive
        the service (it is the worker's), and a gauge still bound to the transfer would keep
        the engine and its weights reachable after shutdown."""
        self.held_blocks.set_function(lambda: 0.0)
        self.oldest_lease_age.set_function(lambda: 0.0)

    def observe(self, mode: str, side: str, seconds: float, nbytes: int) -> None:
        self.transfer_seconds.labels(mode, side).observe(seconds)
        self.transfer_bytes.labels(mode, side).observe(nbytes)

    def failed(self, mode: str, reason: str | None) -> None:
        self.failed_transfers.labels(mode, reason or "unknown").inc()
