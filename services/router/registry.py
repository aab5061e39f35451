"""The worker registry and its compatibility groups.

Workers are grouped by the `compat_hash` of their latest metadata; a prefill and a decode are
paired only inside one group, so two workers whose KV bytes are not interchangeable never meet.
Groups are derived on demand from the workers (never stored), so a worker whose hash changed
moves group as soon as its next health check stores the new metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.router.breaker import CircuitBreaker
from services.router.config import BreakerConfig
from services.router.workers import Worker, WorkerSource
from shared.protocol.pd import Role


@dataclass(frozen=True)
class Group:
    """Workers sharing one compat_hash. Member ids list every member; `usable_*` only those that
    are healthy with a closed (or probing) breaker, which decide servability."""

    compat_hash: str
    transfer_mode: str | None
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    mixed: tuple[str, ...]
    usable_prefill: tuple[Worker, ...]
    usable_decode: tuple[Worker, ...]
    usable_mixed: tuple[Worker, ...]

    @property
    def pd_servable(self) -> bool:
        return bool(self.usable_prefill and self.usable_decode)

    @property
    def servable(self) -> bool:
        return self.pd_servable or bool(self.usable_mixed)

    @property
    def reason(self) -> str | None:
        """Why the group cannot serve, naming what is missing; None when servable."""
        if self.servable:
            return None
        tag = f"group {self.compat_hash[:12]} ({self.transfer_mode or 'unknown'} mode)"
        if self.prefill and not self.decode:
            return f"{tag}: prefill {', '.join(self.prefill)} but no decode worker"
        if self.decode and not self.prefill:
            return f"{tag}: decode {', '.join(self.decode)} but no prefill worker"
        missing = [name for name, usable, members in (
            ("prefill", self.usable_prefill, self.prefill), ("decode", self.usable_decode, self.decode),
            ("mixed", self.usable_mixed, self.mixed)) if members and not usable]
        return (f"{tag}: no healthy {' or '.join(missing)} worker "
                "(unhealthy, draining or circuit open)")

    def describe(self) -> dict[str, Any]:
        return {"compat_hash": self.compat_hash, "transfer_mode": self.transfer_mode,
                "prefill": list(self.prefill), "decode": list(self.decode),
                "mixed": list(self.mixed), "servable": self.servable, "reason": self.reason}


class WorkerRegistry:
    """Registered workers by id, in registration order; the single owner of `Worker` objects."""

    def __init__(self, breaker: BreakerConfig, model: str | None = None) -> None:
        self._breaker_cfg = breaker
        self._workers: dict[str, Worker] = {}
        self._counters: dict[str, int] = {}
        self._model = model

    @property
    def model(self) -> str | None:
        """The served model: the configured one, else the first reporting worker's."""
        return self.reference_model()

    def reference_model(self, exclude_url: str | None = None) -> str | None:
        """The model a worker at `exclude_url` must serve: it cannot be its own reference."""
        if self._model:
            return self._model
        for w in self._workers.values():
            if w.metadata is not None and w.url != exclude_url:
                return w.metadata.model
        return None

    def add(self, url: str, role: Role | None, source: WorkerSource = WorkerSource.STATIC,
            discovered_by: str | None = None) -> Worker:
        url = url.rstrip("/")
        if self.find(url) is not None:
            raise ValueError(f"worker {url} is already registered")
        prefix = role.value if role else "worker"
        n = self._counters.get(prefix, 0)
        self._counters[prefix] = n + 1
        worker = Worker(id=f"{prefix}-{n}", url=url, breaker=CircuitBreaker(self._breaker_cfg),
                        declared_role=role, source=source, discovered_by=discovered_by)
        self._workers[worker.id] = worker
        return worker

    def remove(self, key: str) -> Worker:
        worker = self.find(key)
        if worker is None:
            raise KeyError(key)
        return self._workers.pop(worker.id)

    def find(self, key: str) -> Worker | None:
        """By id, or by URL (trailing slash ignored)."""
        if key in self._workers:
            return self._workers[key]
        url = key.rstrip("/")
        return next((w for w in self._workers.values() if w.url == url), None)

    def get(self, worker_id: str) -> Worker:
        return self._workers[worker_id]

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def usable(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.usable()]

    def groups(self) -> list[Group]:
        """Current groups, one per compat_hash among workers that have reported metadata."""
        by_hash: dict[str, list[Worker]] = {}
        for w in self._workers.values():
            if w.compat_hash is not None:
                by_hash.setdefault(w.compat_hash, []).append(w)
        return [_group(h, members) for h, members in by_hash.items()]

    def servable_groups(self) -> list[Group]:
        return [g for g in self.groups() if g.servable]

    def unservable_reason(self) -> str:
        """Why no group can serve, for the 503 body and /health."""
        groups = self.groups()
        if not self._workers:
            return "no workers registered"
        if not groups:
            return "no worker has answered its metadata yet (" + ", ".join(
                f"{w.id}: {w.reason or w.health.value}" for w in self._workers.values()) + ")"
        return "no servable worker group: " + "; ".join(g.reason or "" for g in groups)


def _group(compat_hash: str, members: Iterable[Worker]) -> Group:
    members = list(members)
    by_role = {r: [w for w in members if w.role is r] for r in Role}
    modes = {w.metadata.transfer_mode for w in members if w.metadata}
    # The transfer mode is part of the hash, so one group has one mode.
    mode = modes.pop() if len(modes) == 1 else None
    return Group(
        compat_hash=compat_hash, transfer_mode=mode,
        prefill=tuple(w.id for w in by_role[Role.PREFILL]),
        decode=tuple(w.id for w in by_role[Role.DECODE]),
        mixed=tuple(w.id for w in by_role[Role.MIXED]),
        usable_prefill=tuple(w for w in by_role[Role.PREFILL] if w.usable()),
        usable_decode=tuple(w for w in by_role[Role.DECODE] if w.usable()),
        usable_mixed=tuple(w for w in by_role[Role.MIXED] if w.usable()),
    )
