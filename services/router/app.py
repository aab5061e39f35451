"""`create_app(config)`: the router's aiohttp application.

Same skeleton as every pdmesh service: typed `web.AppKey` state, one route table, resources
owned by `cleanup_ctx` (pooled client sessions, the health loop), middlewares (request id,
error envelope, size and time limits, auth, readiness gate).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from services.common.errors import AuthenticationError, error_middleware
from services.common.lifecycle import LIFECYCLE_KEY, Lifecycle, readiness_middleware
from services.common.limits import install_limits, limits_middleware
from services.common.middleware import ApiKeyAuth, api_prefix_predicate, install_request_id
from services.common.openapi import openapi_route
from services.router import admin, api
from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.cors import install_cors
from services.router.discovery import DISCOVERY_KEY, DiscoveredWorkers, Discovery, Resolver
from services.router.health import HealthChecker, Jobs
from services.router.leases import LeaseReleaser
from services.router.metrics import RouterMetrics
from services.router.migration import Migrator
from services.router.openapi import router_document
from services.router.orchestrator import Orchestrator
from services.router.pairing import Pairing
from services.router.registry import WorkerRegistry
from services.router.state import STATE_KEY, RouterState, Runtime
from services.router.tokens import PromptTokenizer
from services.router.upstream import Upstream
from shared.protocol.pd import Role

CONFIG_KEY = web.AppKey("router_config", RouterConfig)
# Client endpoints: API key, readiness gate. /health, /live, /metrics and /workers stay open
# to probes; /workers changes check the admin token in their handlers.
API_PATHS = ("/v1", "/tokenize", "/detokenize")


def _session(config: RouterConfig, *, total: float | None) -> aiohttp.ClientSession:
    # No total timeout on legs (a long generation is fine); a read gap past request_timeout_s
    # or a slow connect fails the leg. limit=0: the admission queue bounds concurrency.
    timeout = aiohttp.ClientTimeout(total=total, connect=config.connect_timeout_s,
                                    sock_read=None if total else config.request_timeout_s)
    # https:// workers are verified against --tls-ca (hostname checks on); http:// ignore it.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=config.upstream_keepalive_s,
                                     ssl=config.tls.client_context())
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


async def sessions_context(app: web.Application) -> AsyncIterator[None]:
    """Open the pooled sessions, build the loop-bound runtime; close everything at exit."""
    state = app[STATE_KEY]
    cfg = state.config
    legs = Upstream(_session(cfg, total=None), cfg.worker_api_key, cfg.kv_secret)
    control = Upstream(_session(cfg, total=cfg.health_timeout_s * 2), cfg.worker_api_key,
                       cfg.kv_secret)
    tokenizer = PromptTokenizer(cfg.tokenizer, state.registry, control)
    checker = HealthChecker(state.registry, control, cfg, state.metrics, state.pairing.prefix)
    leases = LeaseReleaser(control, state.metrics)
    state.runtime = Runtime(
        upstream=legs, control=control,
        orchestrator=Orchestrator(cfg, state.pairing, legs, tokenizer, state.metrics, leases,
                                  Migrator(cfg.migration, state.registry, state.metrics)),
        checker=checker, jobs=Jobs(state.registry, checker, state.metrics), tokenizer=tokenizer,
        leases=leases)
    try:
        yield
    finally:
        await state.rt.jobs.close()
        await leases.close()
        await tokenizer.close()
        state.runtime = None
        await legs.session.close()
        await control.session.close()


async def health_context(app: web.Application) -> AsyncIterator[None]:
    """Health-check every worker at once and then every interval; ready to serve at once."""
    state = app[STATE_KEY]
    warm = state.rt.tokenizer.warm if state.pairing.needs_tokens() else None
    task = asyncio.create_task(state.rt.checker.run_forever(after_round=warm))
    app[LIFECYCLE_KEY].mark_ready()
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def discovery_context(app: web.Application) -> AsyncIterator[None]:
    """Start finding workers (--discover) once health checks run; stop before the sessions
    close."""
    state, discovery = app[STATE_KEY], app[DISCOVERY_KEY]
    targets = state.config.discovery.targets
    if targets:
        discovery.start(DiscoveredWorkers(state.registry, state.rt.checker,
                                          state.pairing.prefix, state.metrics, targets))
    try:
        yield
    finally:
        await discovery.close()


def _auth_middleware(config: RouterConfig) -> Any:
    """The client API key on API paths and on reads of the worker list."""
    api_paths = api_prefix_predicate(API_PATHS)
    auth = ApiKeyAuth(config.api_keys, lambda path: True)

    @web.middleware
    async def router_auth(request: web.Request, handler: Any) -> web.StreamResponse:
        guarded = api_paths(request.path) or (
            request.method == "GET" and request.path.startswith("/workers"))
        if auth.enabled and guarded and not auth.check(request.headers.get("Authorization")):
            raise AuthenticationError(
                "Invalid or missing API key (send 'Authorization: Bearer <key>')",
                headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return router_auth


def create_app(config: RouterConfig, resolver: Resolver | None = None) -> web.Application:
    """The router app; workers from the config are registered now and checked at startup,
    discovered ones as they are found (`resolver`: DNS for dns:// targets, tests inject one)."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[error_middleware, limits_middleware(config.limits),
                     _auth_middleware(config),
                     readiness_middleware(api_prefix_predicate(API_PATHS))],
    )
    install_request_id(app)
    install_cors(app, config.cors_allow_origins)
    install_limits(app, config.limits)
    registry = WorkerRegistry(config.breaker, config.model)
    for urls, role in ((config.prefill_urls, Role.PREFILL), (config.decode_urls, Role.DECODE),
                       (config.mixed_urls, Role.MIXED)):
        for url in urls:
            registry.add(url, role)
    metrics = RouterMetrics()
    app[CONFIG_KEY] = config
    app[LIFECYCLE_KEY] = Lifecycle()
    app[DISCOVERY_KEY] = Discovery(config.discovery, resolver)
    pairing = Pairing(registry, config)
    metrics.watch_threshold(pairing.threshold)
    app[STATE_KEY] = RouterState(config=config, registry=registry, pairing=pairing,
                                 admission=Admission(config.admission), metrics=metrics)
    app.add_routes([*api.routes(), *admin.routes(),
                    web.get("/metrics", make_aiohttp_handler(metrics.registry)),
                    openapi_route(router_document())])
    app.cleanup_ctx.extend([sessions_context, health_context, discovery_context])
    return app
