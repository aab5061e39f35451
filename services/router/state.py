"""The router app's state: what `create_app` builds, and what the cleanup contexts add.

`RouterState` is created with the app (registry, pairing, admission, metrics: no event loop
needed). `Runtime` holds what needs the running loop (client sessions and what uses them); the
`sessions` cleanup context sets it before the first request and clears it at shutdown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.health import HealthChecker, Jobs
from services.router.leases import LeaseReleaser
from services.router.metrics import RouterMetrics
from services.router.orchestrator import Orchestrator
from services.router.pairing import Pairing
from services.router.registry import WorkerRegistry
from services.router.tokens import PromptTokenizer
from services.router.upstream import Upstream


@dataclass(frozen=True)
class Runtime:
    """Loop-bound resources: `upstream` for request legs, `control` for metadata and admin."""

    upstream: Upstream
    control: Upstream
    orchestrator: Orchestrator
    checker: HealthChecker
    jobs: Jobs
    tokenizer: PromptTokenizer
    leases: LeaseReleaser


@dataclass
class RouterState:
    """Everything the handlers reach through `request.app[STATE_KEY]`."""

    config: RouterConfig
    registry: WorkerRegistry
    pairing: Pairing
    admission: Admission
    metrics: RouterMetrics
    started_at: float = field(default_factory=time.time)
    started_monotonic: float = field(default_factory=time.monotonic)
    runtime: Runtime | None = None

    @property
    def rt(self) -> Runtime:
        assert self.runtime is not None, "requests are served only between startup and cleanup"
        return self.runtime


STATE_KEY = web.AppKey("router_state", RouterState)
