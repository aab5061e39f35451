"""The resources one worker app owns: the engine (loaded in the background), metrics, admission.

The app starts listening before the model is loaded so `/health` can answer 503 while it
loads; `load` runs as a background task owned by the app's `cleanup_ctx`, and flips the
lifecycle to READY once the engine has loaded and warmed up (`AsyncEngine.start` does both,
off the event loop) and, on a prefill or decode worker, its KV-transfer service listens.
`close` stops the KV service first: closing it releases held leases through the engine.

An engine failure is final for the process: the lifecycle turns FAILED at once (/health and
every API path answer 503 `engine_failed`; the engine has already failed the requests it ran),
in-flight handlers get `engine_failure_drain_seconds` to send their errors, and then the
runner exits non-zero so that docker compose, Kubernetes or `pdmesh up` start a fresh process.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from services.common.lifecycle import Lifecycle
from services.worker.admission import AdmissionControl
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient, EngineFactory
from services.worker.generation import ENGINE_FAILED
from services.worker.metrics import WorkerMetrics
from services.worker.pd_legs import PDLegs
from services.worker.serving import GenerationService

if TYPE_CHECKING:
    from services.worker.kv_link import KVLink

log = logging.getLogger(__name__)


class WorkerRuntime:
    """Engine, generation service, metrics and admission of one worker app.

    `engine` and `service` are None until loading finished; the readiness middleware keeps
    requests that need them away until then.
    """

    def __init__(self, config: WorkerConfig, engine_factory: EngineFactory) -> None:
        self.config = config
        self._factory = engine_factory
        self._owned: EngineClient | None = None  # set as soon as built, for shutdown
        self.engine: EngineClient | None = None
        self.service: GenerationService | None = None
        self.kv_link: KVLink | None = None
        self.metrics = WorkerMetrics(config.served_model_name, lambda: self.engine)
        self.admission = AdmissionControl(config.admission_capacity)
        self._exit_task: asyncio.Task[None] | None = None  # drain, then exit (engine failed)

    async def load(self, lifecycle: Lifecycle) -> None:
        log.info("loading model %s", self.config.engine.model)
        engine = self._factory(self.config.engine)  # cheap: start() does the loading
        self._owned = engine
        await engine.start()  # loads off the event loop and runs the engine's warm-up step
        engine.add_failure_listener(lambda reason: self._engine_failed(lifecycle, reason))
        pd_legs = None
        if self.config.kv is not None:
            from services.worker.kv_link import KVLink  # torch: prefill/decode workers only

            self.kv_link = await KVLink.start(self.config, engine, self.metrics.registry)
            pd_legs = PDLegs(engine, self.kv_link, self.config)
        self.engine = engine
        self.service = GenerationService(engine, self.config, self.metrics, self.admission, pd_legs)
        lifecycle.mark_ready()
        log.info("model %s ready (max_model_len %d)", self.config.engine.model, engine.max_model_len)

    def _engine_failed(self, lifecycle: Lifecycle, reason: str) -> None:
        """Engine failure listener (event loop): refuse work now, exit after the drain."""
        if self._exit_task is not None:
            return
        lifecycle.fail(f"the engine failed: {reason}", ENGINE_FAILED)
        drain = self.config.engine_failure_drain_seconds
        log.error("the engine failed; /health answers 503 and the worker exits with status 1 "
                  "after at most %.1fs of drain", drain)
        self._exit_task = asyncio.create_task(self._exit_after_drain(lifecycle, drain))

    @staticmethod
    async def _exit_after_drain(lifecycle: Lifecycle, drain: float) -> None:
        try:
            if not await lifecycle.wait_idle(drain):
                log.warning("exiting with %d request(s) still in flight", lifecycle.in_flight)
        finally:  # even if cancelled: the process must not outlive its engine
            lifecycle.finish()

    async def close(self) -> None:
        if self._exit_task is not None:
            self._exit_task.cancel()
        engine, self._owned, self.engine, self.service = self._owned, None, None, None
        link, self.kv_link = self.kv_link, None
        if link is not None:
            await link.close()
        if engine is not None:
            await engine.shutdown()
