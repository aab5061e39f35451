"""Worker discovery: `--discover dns://NAME:PORT` and `k8s://NAMESPACE/SERVICE[:PORT]`.

A discovery target yields a set of worker URLs, one per address; `DiscoveredWorkers` keeps the
registry equal to it. A new URL is registered with no metadata (so it belongs to no group) and
health-checked at once: it joins its compatibility group when its /v1/metadata passes, as any
worker does. A URL that leaves the set is DRAINING: no new request is routed to it, the
attempts that already hold it finish (or fail over), and it leaves the registry once idle. An
address that comes back while draining is simply active again.

`DnsDiscovery` re-resolves a name every interval with the event loop's resolver (injectable
for tests). A name that does not resolve (NXDOMAIN: no replica running yet) is zero addresses,
not an error; a resolver failure (timeout, SERVFAIL) keeps the last answer. The Kubernetes
watcher lives in `k8s_discovery.py`, imported only when a k8s:// target is configured.
`Discovery` owns the tasks; the app's `discovery_context` starts and stops it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.router.config import DiscoveryConfig, DiscoveryScheme, DiscoveryTarget
from services.router.health import HealthChecker
from services.router.metrics import RouterMetrics
from services.router.policies import PrefixIndex
from services.router.registry import WorkerRegistry
from services.router.workers import Membership, Worker, WorkerSource

log = logging.getLogger(__name__)

# (host, port) -> the addresses the name has now; raises socket.gaierror like getaddrinfo.
Resolver = Callable[[str, int], Awaitable[list[str]]]

DRAIN_POLL_S = 0.05  # how often a draining worker is looked at (a counter read: cheap)
# getaddrinfo's answers for "this name has no address": no replica exists (yet). Anything
# else (EAI_AGAIN...) is a resolver failure that must not drain the workers we have.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of `host` through the event loop's resolver (getaddrinfo, in a thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def worker_url(address: str, port: int) -> str:
    """http://ADDRESS:PORT, with an IPv6 address in brackets."""
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


@dataclass
class TargetStatus:
    """What one target sees now, as /v1/router/metadata shows it under `discovery`."""

    target: DiscoveryTarget
    urls: tuple[str, ...] = ()
    updated_at: float | None = None  # wall clock of the last answer (addresses or none)
    error: str | None = None  # the last failure, until an answer comes
    note: str | None = None  # e.g. "the name does not resolve": zero addresses, no error

    def describe(self, registry: WorkerRegistry) -> dict[str, Any]:
        return {"target": self.target.uri, "scheme": self.target.scheme.value,
                "addresses": list(self.urls),
                "workers": [w.id for w in registry.all() if w.discovered_by == self.target.uri],
                "updated_at": self.updated_at, "error": self.error, "note": self.note}


class DiscoveredWorkers:
    """Keeps the registry's discovered workers equal to what each target sees; the only code
    that adds, drains or removes them (DELETE /workers refuses to)."""

    def __init__(self, registry: WorkerRegistry, checker: HealthChecker, prefix: PrefixIndex,
                 metrics: RouterMetrics, targets: Iterable[DiscoveryTarget]) -> None:
        self._registry = registry
        self._checker = checker
        self._prefix = prefix
        self._metrics = metrics
        self.status = {t.uri: TargetStatus(t) for t in targets}
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def update(self, target: DiscoveryTarget, urls: Iterable[str],
               note: str | None = None) -> None:
        """`urls` is everything the target yields now: add new ones, drain missing ones."""
        wanted = set(urls)
        status = self.status[target.uri]
        if set(status.urls) != wanted or status.note != note:
            log.info("%s: %d address(es)%s", target.uri, len(wanted), f" ({note})" if note else "")
        status.urls, status.updated_at = tuple(sorted(wanted)), time.time()
        status.error, status.note = None, note
        mine = {w.url: w for w in self._registry.all() if w.discovered_by == target.uri}
        for url in sorted(wanted):
            worker = mine.get(url)
            if worker is None:
                self._join(target, url)
            elif worker.membership is Membership.DRAINING:
                log.info("%s (%s) is back in %s: active again", worker.id, url, target.uri)
                worker.membership = Membership.ACTIVE
                drain = self._drains.pop(worker.id, None)
                if drain is not None:
                    drain.cancel()
        for url, worker in mine.items():
            if url not in wanted and worker.membership is Membership.ACTIVE:
                self._drain(worker)
        self._metrics.observe_registry(self._registry)

    def failed(self, target: DiscoveryTarget, error: str) -> None:
        """The target could not be read: keep its workers, say why."""
        status = self.status[target.uri]
        if status.error != error:
            log.warning("%s: %s (keeping its %d worker(s))", target.uri, error, len(status.urls))
        status.error = error

    def _join(self, target: DiscoveryTarget, url: str) -> None:
        other = self._registry.find(url)
        if other is not None:  # registered by a flag, an admin or another target
            log.debug("%s: %s is already registered as %s (%s)", target.uri, url, other.id,
                      other.discovered_by or other.source.value)
            return
        worker = self._registry.add(url, None, WorkerSource(target.scheme.value), target.uri)
        log.info("%s: found %s at %s; it joins its group once its metadata passes", target.uri,
                 worker.id, url)
        self._spawn(self._first_check(worker))

    async def _first_check(self, worker: Worker) -> None:
        await self._checker.check(worker)
        self._metrics.observe_registry(self._registry)
        log.info("%s (%s): %s%s", worker.id, worker.url, worker.health.value,
                 f" ({worker.reason})" if worker.reason else "")

    def _drain(self, worker: Worker) -> None:
        log.info("%s (%s) left %s: draining (%d attempt(s) in flight)", worker.id, worker.url,
                 worker.discovered_by, worker.attempts)
        worker.membership = Membership.DRAINING
        self._drains[worker.id] = asyncio.create_task(self._remove_when_idle(worker))

    async def _remove_when_idle(self, worker: Worker) -> None:
        while not worker.idle:
            await asyncio.sleep(DRAIN_POLL_S)
        self._drains.pop(worker.id, None)  # (a worker back in time had its drain cancelled)
        if self._registry.find(worker.id) is worker:
            self._registry.remove(worker.id)
            self._prefix.forget(worker.id)
            self._metrics.observe_registry(self._registry)
            log.info("%s (%s) drained and removed", worker.id, worker.url)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._drains.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class DnsDiscovery:
    """Re-resolves one dns:// target every `interval_s`: one worker per address."""

    def __init__(self, target: DiscoveryTarget, members: DiscoveredWorkers, resolver: Resolver,
                 interval_s: float) -> None:
        assert target.scheme is DiscoveryScheme.DNS and target.port is not None
        self._target = target
        self._port = target.port
        self._members = members
        self._resolver = resolver
        self._interval_s = interval_s

    async def resolve_once(self) -> None:
        target = self._target
        try:
            addresses = await self._resolver(target.host, self._port)
        except socket.gaierror as exc:
            if exc.errno not in _NO_ADDRESS:
                self._members.failed(target, f"resolving {target.host}: {exc}")
                return
            self._members.update(target, (), note=f"{target.host} does not resolve")
            return
        except OSError as exc:
            self._members.failed(target, f"resolving {target.host}: {exc}")
            return
        self._members.update(target, (worker_url(a, self._port) for a in addresses))

    async def run(self) -> None:
        while True:
            try:
                await self.resolve_once()
            except Exception:  # one bad round must not end discovery
                log.exception("%s: discovery round failed", self._target.uri)
            await asyncio.sleep(self._interval_s)


class Discovery:
    """The discovery component of one router: its targets' status (readable before start, for
    /v1/router/metadata) and, between `start` and `close`, one task per target."""

    def __init__(self, config: DiscoveryConfig, resolver: Resolver | None = None) -> None:
        self._cfg = config
        self._resolver = resolver or system_resolver
        self._members: DiscoveredWorkers | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def members(self) -> DiscoveredWorkers | None:
        return self._members

    def start(self, members: DiscoveredWorkers) -> None:
        self._members = members
        for target in self._cfg.targets:
            self._tasks.append(asyncio.create_task(self._watch(target, members),
                                                   name=f"discover {target.uri}"))

    def _watch(self, target: DiscoveryTarget,
               members: DiscoveredWorkers) -> Coroutine[Any, Any, None]:
        if target.scheme is DiscoveryScheme.DNS:
            return DnsDiscovery(target, members, self._resolver, self._cfg.interval_s).run()
        # Imported here: the router starts without kubernetes-asyncio unless k8s:// is used.
        from services.router.k8s_discovery import EndpointSliceWatcher

        return EndpointSliceWatcher(target, members, self._cfg.kubeconfig).run()

    def describe(self, registry: WorkerRegistry) -> list[dict[str, Any]]:
        if self._members is None:
            return [TargetStatus(t).describe(registry) for t in self._cfg.targets]
        return [s.describe(registry) for s in self._members.status.values()]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._members is not None:
            await self._members.close()


DISCOVERY_KEY = web.AppKey("router_discovery", Discovery)
