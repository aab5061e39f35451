"""Health checks and worker-registration jobs: both read a worker's GET /v1/metadata.

Every `interval` the checker refreshes each worker's metadata; a worker that does not answer,
answers an error, reports another model than the router serves, or another role than it was
registered with, is marked unhealthy with the reason. A changed compat_hash is simply stored:
groups are derived from it, so the worker changes group at that moment.
POST /workers becomes a `Job`: validate the candidate through its metadata first, then add it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from services.router.config import RouterConfig
from services.router.metrics import RouterMetrics
from services.router.policies import PrefixIndex
from services.router.registry import WorkerRegistry
from services.router.upstream import Upstream, UpstreamFailure
from services.router.workers import MetadataError, Worker, WorkerMetadata, WorkerSource
from shared.protocol.pd import Role

log = logging.getLogger(__name__)


def _failure_reason(failure: UpstreamFailure) -> str:
    err = (failure.body or {}).get("error")
    message = err.get("message") if isinstance(err, dict) else None
    return f"metadata: HTTP {failure.status}: {message}" if failure.status else (
        f"metadata: {failure.detail}")


class HealthChecker:
    """Refreshes worker metadata; the only writer of `Worker.health` besides registration."""

    def __init__(self, registry: WorkerRegistry, upstream: Upstream, config: RouterConfig,
                 metrics: RouterMetrics, prefix: PrefixIndex) -> None:
        self._registry = registry
        self._upstream = upstream
        self._cfg = config
        self._metrics = metrics
        self._prefix = prefix

    async def fetch(self, worker_id: str, url: str) -> WorkerMetadata:
        """A worker's parsed metadata; raises UpstreamFailure or MetadataError."""
        doc = await self._upstream.get_json(worker_id, url + "/v1/metadata",
                                            self._cfg.health_timeout_s)
        return WorkerMetadata.parse(doc)

    def problem(self, md: WorkerMetadata, role: Role | None, url: str) -> str | None:
        """Why this metadata cannot join the mesh (model or role mismatch), else None."""
        model = self._registry.reference_model(exclude_url=url)
        if model and md.model != model:
            return f"serves model {md.model!r} but the router serves {model!r}"
        if role is not None and md.role is not role:
            return f"registered as {role.value} but reports role {md.role.value}"
        return None

    async def check(self, worker: Worker) -> None:
        try:
            md = await self.fetch(worker.id, worker.url)
        except UpstreamFailure as failure:
            worker.mark_unhealthy(_failure_reason(failure))
            return
        except MetadataError as exc:
            worker.mark_unhealthy(f"metadata: {exc}")
            return
        problem = self.problem(md, worker.declared_role, worker.url) or md.not_serving
        if problem is not None:
            worker.mark_unhealthy(problem)
            return
        if worker.compat_hash not in (None, md.compat_hash):
            log.warning("%s changed compat_hash %s -> %s: it moves group", worker.id,
                        worker.compat_hash, md.compat_hash)
            self._prefix.forget(worker.id)  # what it cached is not ours to reuse any more
        worker.mark_healthy(md)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self._registry.all()))
        self._metrics.observe_registry(self._registry)

    async def run_forever(self, after_round: Callable[[], None] | None = None) -> None:
        while True:
            try:
                await self.check_all()
                if after_round is not None:
                    after_round()
            except Exception:  # one bad round must not end health checking
                log.exception("health round failed")
            await asyncio.sleep(self._cfg.health_interval_s)


class JobState(StrEnum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class Job:
    """One POST /workers request, as GET /workers/jobs/{id} shows it."""

    id: str
    url: str
    role: Role | None
    state: JobState = JobState.PENDING
    worker_id: str | None = None
    error: str | None = None
    created: float = field(default_factory=time.time)

    def describe(self) -> dict[str, Any]:
        return {"job_id": self.id, "url": self.url, "role": self.role.value if self.role else None,
                "state": self.state.value, "worker_id": self.worker_id, "error": self.error,
                "created": self.created}


class Jobs:
    """Runs registration jobs one at a time (serialised, so two adds of one URL cannot race)."""

    def __init__(self, registry: WorkerRegistry, checker: HealthChecker,
                 metrics: RouterMetrics) -> None:
        self._registry = registry
        self._checker = checker
        self._metrics = metrics
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, url: str, role: Role | None) -> Job:
        job = Job(id=f"job-{next(self._ids)}", url=url.rstrip("/"), role=role)
        self._jobs[job.id] = job
        task = asyncio.create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    async def _run(self, job: Job) -> None:
        async with self._lock:
            try:
                md = await self._checker.fetch("candidate", job.url)
                problem = self._checker.problem(md, job.role, job.url)
                if problem is None and self._registry.find(job.url) is not None:
                    problem = "a worker with this URL is already registered"
            except (UpstreamFailure, MetadataError) as exc:
                problem = f"metadata check failed: {exc}"
            except Exception as exc:  # a job never stays pending
                log.exception("registration job %s failed", job.id)
                problem = f"internal error: {exc}"
            if problem is not None:
                job.state, job.error = JobState.FAILED, problem
                return
            worker = self._registry.add(job.url, job.role or md.role, WorkerSource.ADMIN)
            worker.mark_healthy(md)
            job.state, job.worker_id = JobState.SUCCEEDED, worker.id
            self._metrics.observe_registry(self._registry)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
