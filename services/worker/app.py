"""`create_app(config)`: the worker's aiohttp application.

Same skeleton as every pdmesh service: typed `web.AppKey` state, one route table, resources
owned by a `cleanup_ctx`, middlewares (request id, error envelope, size and time limits,
API key, prefill-leg signature, readiness gate).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from services.common.errors import error_middleware
from services.common.lifecycle import LIFECYCLE_KEY, Lifecycle, readiness_middleware
from services.common.limits import install_limits, limits_middleware
from services.common.middleware import ApiKeyAuth, api_prefix_predicate, install_request_id
from services.worker.config import WorkerConfig
from services.worker.engine_client import (
    EngineFactory,
    pipeline_engine_factory,
    real_engine_factory,
)
from services.worker.leg_auth import leg_auth_middleware
from services.worker.routes import RUNTIME_KEY, STARTED_AT_KEY, routes
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

CONFIG_KEY = web.AppKey("worker_config", WorkerConfig)
# Paths that need an API key and a loaded engine; /health and /metrics stay open.
API_PATHS = ("/v1", "/tokenize", "/detokenize")


async def engine_context(app: web.Application) -> AsyncIterator[None]:
    """Load the engine in the background (health says 503 meanwhile); shut it down at exit."""
    runtime, lifecycle = app[RUNTIME_KEY], app[LIFECYCLE_KEY]

    def on_loaded(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("model load failed", exc_info=task.exception())
            lifecycle.mark_failed(f"model load failed: {task.exception()}")

    loading = asyncio.create_task(runtime.load(lifecycle))
    loading.add_done_callback(on_loaded)
    yield
    lifecycle.begin_drain()
    loading.cancel()
    await asyncio.gather(loading, return_exceptions=True)
    await runtime.close()


def create_app(config: WorkerConfig, engine_factory: EngineFactory | None = None) -> web.Application:
    """The worker app; `engine_factory` lets tests serve a fake engine through the same stack."""
    guarded = api_prefix_predicate(API_PATHS)
    auth = ApiKeyAuth(config.api_keys, guarded)
    app = web.Application(
        client_max_size=config.max_body_size,
        middlewares=[error_middleware, limits_middleware(config.limits), auth.middleware(),
                     leg_auth_middleware(config.kv), readiness_middleware(guarded)],
    )
    install_request_id(app)
    install_limits(app, config.limits)
    default = (pipeline_engine_factory(config.pipeline) if config.pipeline.enabled
               else real_engine_factory)
    runtime = WorkerRuntime(config, engine_factory or default)
    app[CONFIG_KEY] = config
    app[LIFECYCLE_KEY] = Lifecycle()
    app[RUNTIME_KEY] = runtime
    app[STARTED_AT_KEY] = int(time.time())
    app.add_routes(routes(runtime))
    app.cleanup_ctx.append(engine_context)
    return app
