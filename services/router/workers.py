"""What the router knows about one worker: its role, its last `/v1/metadata`, health and breaker.

`WorkerMetadata.parse` is the single place that reads a worker's metadata document; it is
lenient about nesting (`model` as a string or `{id, fingerprint}`, `kv` / `load` sub-objects or
flat keys) so the router keeps working while the worker's document grows.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.router.breaker import CircuitBreaker
from shared.protocol.pd import Role


class Health(StrEnum):
    """Result of the latest health check; UNKNOWN until the first one answers."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


class WorkerSource(StrEnum):
    """How a worker came to be registered; only its source may remove a discovered one."""

    STATIC = "static"  # --prefill / --decode / --worker
    ADMIN = "admin"  # POST /workers
    DNS = "dns"  # --discover dns://...
    K8S = "k8s"  # --discover k8s://...


class Membership(StrEnum):
    """Whether new requests may go to the worker. DRAINING (its address left discovery): none
    are routed to it; it leaves the registry once no attempt holds it."""

    ACTIVE = "active"
    DRAINING = "draining"


class MetadataError(ValueError):
    """A worker's /v1/metadata document lacks a field the router cannot work without."""


def _get(doc: Mapping[str, Any], *paths: str, default: Any = None) -> Any:
    """First present value among dotted paths ("kv.usage", "kv_cache_usage"...)."""
    for path in paths:
        node: Any = doc
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                node = None
                break
            node = node[part]
        if node is not None:
            return node
    return default


@dataclass(frozen=True)
class WorkerMetadata:
    """The fields of a worker's /v1/metadata the router routes and pairs on."""

    role: Role
    model: str
    compat_hash: str
    transfer_mode: str | None = None
    engine_id: str | None = None
    model_fingerprint: str | None = None
    model_source: str | None = None  # what the worker loaded (a known name or a directory)
    dtype: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    compat_factors: dict[str, Any] = field(default_factory=dict)
    kv_host: str | None = None
    kv_port: int | None = None
    kv_tls: bool = False  # the KV listener serves TLS
    kv_capacity_blocks: int | None = None
    kv_usage: float = 0.0  # fraction 0..1
    running: int = 0
    waiting: int = 0
    kernels: dict[str, Any] = field(default_factory=dict)  # relayed as reported, never routed on
    # The reasoning parser its chat output is read with (None: plain text). A decode that parses
    # may hold the prefill's first token back, so the router sends nothing early to it.
    reasoning_parser: str | None = None
    # Why the worker says it should get no traffic now (its `health.status`, e.g.
    # "model_degraded" after NaN logits), or None while it is ok.
    not_serving: str | None = None

    @staticmethod
    def parse(doc: Mapping[str, Any]) -> WorkerMetadata:
        """Raises MetadataError for a document the router cannot use (never anything else)."""
        if not isinstance(doc, Mapping):
            raise MetadataError("metadata is not a JSON object")
        try:
            return WorkerMetadata._parse(doc)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, MetadataError):
                raise
            raise MetadataError(f"malformed metadata: {exc}") from exc

    @staticmethod
    def _parse(doc: Mapping[str, Any]) -> WorkerMetadata:
        role = _get(doc, "role")
        model = _get(doc, "model.id", "model_id", "model")
        if role not in {r.value for r in Role}:
            raise MetadataError(f"metadata has no valid role (got {role!r})")
        if not isinstance(model, str) or not model:
            raise MetadataError("metadata has no model id")
        fingerprint = _get(doc, "model.fingerprint", "model_fingerprint")
        compat_hash = _get(doc, "compat_hash", "kv_transfer.compat_hash")
        if not isinstance(compat_hash, str) or not compat_hash:
            if role != Role.MIXED.value:
                raise MetadataError(f"a {role} worker must report a compat_hash")
            # A mixed worker never exchanges KV; group it by what it serves.
            compat_hash = "mixed-" + hashlib.sha256(f"{model}|{fingerprint}".encode()).hexdigest()
        capacity = _get(doc, "kv_cache.num_total_blocks", "kv.capacity_blocks")
        used = _get(doc, "kv_cache.num_used_blocks", "kv.used_blocks")
        usage = _get(doc, "kv_cache.usage", "kv.usage", "kv_cache_usage")
        if usage is None and capacity and used is not None:
            usage = used / capacity
        port = _get(doc, "kv_endpoint.port", "kv_transfer.port", "kv_port")
        host = _get(doc, "kv_endpoint.host", "kv_transfer.host", "kv_host")
        transfer_mode = _get(doc, "transfer_mode", "kv_transfer.mode", "compat_factors.transfer_mode")
        if role == Role.PREFILL.value and transfer_mode == "push" and (host is None or port is None):
            # The router hands this address to the decode leg; without it no push can pair.
            raise MetadataError("a push-mode prefill worker must report its KV endpoint "
                                "(kv_endpoint.host and kv_endpoint.port)")
        return WorkerMetadata(
            role=Role(role), model=model, compat_hash=compat_hash,
            transfer_mode=transfer_mode,
            engine_id=_get(doc, "engine_id"), model_fingerprint=fingerprint,
            model_source=_get(doc, "model.source"),
            dtype=_get(doc, "dtype"), max_model_len=_get(doc, "max_model_len"),
            block_size=_get(doc, "block_size"),
            compat_factors=dict(_get(doc, "compat_factors", "kv_transfer.compat_factors",
                                     default={})),
            kv_host=host,
            kv_port=int(port) if port is not None else None,
            kv_tls=_get(doc, "kv_endpoint.tls", default=False) is True,
            kv_capacity_blocks=capacity, kv_usage=float(usage or 0.0),
            running=int(_get(doc, "load.num_running", "load.running", default=0)),
            waiting=int(_get(doc, "load.num_waiting", "load.waiting", default=0)),
            kernels=dict(_get(doc, "kernels", default={})),
            reasoning_parser=_get(doc, "parsers.reasoning_parser") or None,
            not_serving=_not_serving(_get(doc, "health.status"), _get(doc, "health.reason")),
        )


def _not_serving(status: Any, reason: Any) -> str | None:
    if status in (None, "ok"):
        return None
    return f"{status}: {reason}" if reason else str(status)


@dataclass
class Worker:
    """One registered worker: configuration, the latest metadata and the live counters.

    `declared_role` comes from the flag or the POST /workers body (None: trust the metadata);
    `inflight` counts requests this router has on the worker right now, which moves between two
    health checks while the worker's own load figures do not; `attempts` counts request attempts
    whose route names the worker, from planning to their end (a pull decode is held while its
    prefill leg runs), which is what a drain waits for.
    """

    id: str
    url: str
    breaker: CircuitBreaker
    declared_role: Role | None = None
    metadata: WorkerMetadata | None = None
    health: Health = Health.UNKNOWN
    reason: str | None = None  # why it is unhealthy
    last_seen: float | None = None  # wall clock of the last good metadata
    inflight: int = 0
    attempts: int = 0
    source: WorkerSource = WorkerSource.STATIC
    discovered_by: str | None = None  # the --discover URI that found it
    membership: Membership = Membership.ACTIVE

    @property
    def role(self) -> Role | None:
        return self.metadata.role if self.metadata else self.declared_role

    @property
    def compat_hash(self) -> str | None:
        return self.metadata.compat_hash if self.metadata else None

    def usable(self) -> bool:
        """Healthy, not draining, and its breaker lets traffic through."""
        return (self.health is Health.HEALTHY and self.membership is Membership.ACTIVE
                and self.breaker.available())

    @property
    def idle(self) -> bool:
        """No request attempt of this router holds it (a draining worker may leave)."""
        return self.attempts == 0 and self.inflight == 0

    def mark_healthy(self, metadata: WorkerMetadata) -> None:
        if self.health is Health.UNHEALTHY:  # back (restarted): its breaker may probe now
            self.breaker.recovered()
        self.metadata = metadata
        self.health = Health.HEALTHY
        self.reason = None
        self.last_seen = time.time()

    def mark_unhealthy(self, reason: str) -> None:
        self.health = Health.UNHEALTHY
        self.reason = reason

    def describe(self) -> dict[str, Any]:
        """The worker as GET /workers and /v1/router/metadata show it."""
        md = self.metadata
        return {
            "id": self.id, "url": self.url, "role": self.role.value if self.role else None,
            "model": md.model if md else None, "engine_id": md.engine_id if md else None,
            "model_fingerprint": md.model_fingerprint if md else None,
            "compat_hash": md.compat_hash if md else None,
            "compat_factors": md.compat_factors if md else {},
            "transfer_mode": md.transfer_mode if md else None,
            "kernels": md.kernels if md else {},
            "kv_endpoint": ({"host": md.kv_host, "port": md.kv_port, "tls": md.kv_tls}
                            if md else None),
            "health": self.health.value, "reason": self.reason,
            "circuit_breaker": self.breaker.state.value,
            "load": {"running": md.running if md else 0, "waiting": md.waiting if md else 0,
                     "kv_usage": md.kv_usage if md else 0.0, "router_inflight": self.inflight},
            "last_seen": self.last_seen,
            "source": self.source.value, "discovered_by": self.discovered_by,
            "membership": self.membership.value,
        }

