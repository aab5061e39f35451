"""Operator handlers: worker registry changes, the metadata query, liveness and readiness.

POST/DELETE /workers need the admin token (a separate secret from the client API keys) and fail
closed: a router started without one refuses changes. /live is always 200; /health is 200 only
while at least one compatibility group can serve a request.
"""

from __future__ import annotations

import time
from importlib import metadata as importlib_metadata
from typing import Any

from aiohttp import web

from services.common.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    ServiceUnavailableError,
)
from services.common.json_body import json_response, read_json_object
from services.common.middleware import ApiKeyAuth
from services.router.discovery import DISCOVERY_KEY
from services.router.errors import AdminDisabledError
from services.router.state import STATE_KEY, RouterState
from shared.protocol.pd import Role


def _version() -> str:
    try:
        return importlib_metadata.version("pdmesh")
    except importlib_metadata.PackageNotFoundError:
        return "0.0.0"


def _require_admin(request: web.Request) -> RouterState:
    state = request.app[STATE_KEY]
    token = state.config.admin_token
    if not token:
        raise AdminDisabledError("Worker changes are disabled: start the router with "
                                 "--admin-token (or PDMESH_ADMIN_TOKEN)")
    if not ApiKeyAuth((token,), lambda _: True).check(request.headers.get("Authorization")):
        raise AuthenticationError("Invalid or missing admin token", code="invalid_admin_token",
                                  headers={"WWW-Authenticate": "Bearer"})
    return state


async def add_worker(request: web.Request) -> web.Response:
    """202 with a job id; the job validates the worker through its /v1/metadata first."""
    state = _require_admin(request)
    body = await read_json_object(request)
    url = body.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadRequestError("'url' must be an http(s) URL", param="url")
    role = body.get("role")
    if role is not None and role not in {r.value for r in Role}:
        raise BadRequestError("'role' must be prefill, decode or mixed", param="role")
    job = state.rt.jobs.submit(url, Role(role) if role else None)
    return json_response(job.describe(), status=202,
                             headers={"Location": f"/workers/jobs/{job.id}"})


async def get_job(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    job = state.rt.jobs.get(request.match_info["job_id"])
    if job is None:
        raise NotFoundError(f"No job {request.match_info['job_id']!r}", code="job_not_found")
    return json_response(job.describe())


async def delete_worker(request: web.Request) -> web.Response:
    """By id, or by URL (percent-encoded in the path)."""
    state = _require_admin(request)
    key = request.match_info["worker_id"]
    found = state.registry.find(key)
    if found is None:
        raise NotFoundError(f"No worker {key!r}", code="worker_not_found")
    if found.discovered_by is not None:
        # Discovery would add it back at its next round; its address leaving removes it.
        raise ConflictError(f"Worker {found.id} was found by {found.discovered_by}; it leaves "
                            "when its address does", code="worker_discovered")
    worker = state.registry.remove(found.id)
    state.pairing.prefix.forget(worker.id)
    state.metrics.observe_registry(state.registry)
    return json_response({"id": worker.id, "url": worker.url, "removed": True})


async def list_workers(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    workers = [w.describe() for w in state.registry.all()]
    counts = {r.value: sum(1 for w in state.registry.all() if w.role is r) for r in Role}
    return json_response({"workers": workers, "counts": counts})


def describe_router(state: RouterState) -> dict[str, Any]:
    cfg = state.config
    return {
        "version": _version(), "model": state.registry.model,
        "started_at": state.started_at,
        "uptime_s": round(time.monotonic() - state.started_monotonic, 3),
        "policies": {"prefill": cfg.prefill_policy.value, "decode": cfg.decode_policy.value},
        "disagg_min_tokens": state.pairing.threshold.tokens,
        "disagg_threshold": state.pairing.threshold.estimate.describe(),
        "early_first_token": cfg.early_first_token,
        "admission": {"max_inflight": cfg.admission.max_inflight,
                      "max_queue": cfg.admission.max_queue,
                      "inflight": state.admission.inflight, "queued": state.admission.depth},
        "retry": {"max_attempts": cfg.retry.max_attempts, "budget_s": cfg.retry.budget_s},
    }


async def router_metadata(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    groups = state.registry.groups()
    servable = any(g.servable for g in groups)
    return json_response({
        "router": describe_router(state),
        "workers": [w.describe() for w in state.registry.all()],
        "groups": [g.describe() for g in groups],
        "discovery": request.app[DISCOVERY_KEY].describe(state.registry),
        "servable": servable,
        "reason": None if servable else state.registry.unservable_reason(),
    })


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    servable = state.registry.servable_groups()
    if not servable:
        raise ServiceUnavailableError(state.registry.unservable_reason(),
                                      code="no_servable_group")
    return json_response({"status": "ok", "servable_groups": len(servable)})


async def live(request: web.Request) -> web.Response:
    return json_response({"status": "alive"})


def routes() -> list[web.AbstractRouteDef]:
    return [
        web.get("/v1/router/metadata", router_metadata),
        web.get("/workers", list_workers),
        web.post("/workers", add_worker),
        web.get("/workers/jobs/{job_id}", get_job),
        web.delete("/workers/{worker_id}", delete_worker),
        web.get("/health", health),
        web.get("/live", live),
    ]
