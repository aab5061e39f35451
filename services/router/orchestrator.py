"""Serving one client request across workers: plan, run the legs, retry, relay.

One attempt runs a `Route`: pull (prefill, then decode with the prefill's params), push (both
legs at once, matched on a router-minted transfer_id) or local (one decode/mixed worker gets
the client's body: short prompts, and requests no P/D leg serves, e.g. n>1). An attempt that
fails before the first byte reached the client is retried on other workers with backoff and
jitter inside the request's budget; a failed decode re-runs the prefill too, since its KV may
be gone. After the first byte, a streamed request moves to another decode (`migration.py`)
or, when it cannot, the failure becomes an SSE error event. A leg whose worker goes silent
and then fails a health probe fails like a dead worker (`stall.py`). A pull decode
leg that ends without success (client gone, decode failed) has the prefill's lease ended at
once (`leases.py`) rather than at its expiry.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from services.common.errors import ApiError
from services.common.json_body import json_response
from services.common.stream_usage import StreamUsage
from services.router.client_stream import ClientStream, relay
from services.router.config import RetryConfig, RouterConfig
from services.router.errors import NoServableGroupError
from services.router.first_token import FirstTokenSkipper, early_chunks
from services.router.leases import LeaseReleaser
from services.router.legs import (
    can_stream_first_token_early,
    decode_body,
    needs_single_worker,
    new_transfer_id,
    prefill_body,
    pull_prefill_params,
    push_params,
)
from services.router.metrics import RouterMetrics
from services.router.migration import Migrator, StreamTracker, not_migratable
from services.router.pairing import Pairing, Route
from services.router.phases import Phases, cached_tokens_of, patch_usage
from services.router.stall import StallPolicy, Watchdog
from services.router.tokens import PromptTokenizer
from services.router.upstream import Upstream, UpstreamFailure
from services.router.workers import Worker
from shared.protocol.pd import PHASES_HEADER, ApiKind

log = logging.getLogger(__name__)

Prefill = dict[str, Any] | asyncio.Task[dict[str, Any]] | None


@dataclass
class ClientRequest:
    """A parsed client request: endpoint kind and path, body, request id, timings."""

    kind: ApiKind
    path: str
    body: dict[str, Any]
    request_id: str
    http: web.Request
    phases: Phases
    tracker: StreamTracker | None = None  # a migratable stream: what the client got
    prompt_tokens: int | None = None  # as the prefill leg's usage counts them

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def backoff_delay(cfg: RetryConfig, attempt: int, rng: random.Random) -> float:
    """Exponential backoff for retry number `attempt` (1-based), with +-jitter."""
    base = min(cfg.max_backoff_s, cfg.initial_backoff_s * cfg.multiplier ** (attempt - 1))
    return base * (1 + rng.uniform(-cfg.jitter, cfg.jitter))


_T = TypeVar("_T")


async def _race(main: Awaitable[_T], guard: asyncio.Task[Any]) -> _T:
    """Await `main`, unless `guard` fails first: then cancel `main` and raise guard's error."""
    task = asyncio.ensure_future(main)
    try:
        await asyncio.wait({task, guard}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and guard.done():
            error = guard.exception()
            if error is not None:
                raise error
        return await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Orchestrator:
    """Runs requests; shares the pairing, the upstream session and the metrics of one app."""

    def __init__(self, config: RouterConfig, pairing: Pairing, upstream: Upstream,
                 tokenizer: PromptTokenizer, metrics: RouterMetrics,
                 leases: LeaseReleaser, migrator: Migrator) -> None:
        self._cfg = config
        self._pairing = pairing
        self._upstream = upstream
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._leases = leases
        self._migrator = migrator
        self._rng = random.Random()
        self._stall = StallPolicy(config.migration.stall_timeout_s,
                                  config.migration.stall_limit_s)

    def _watchdog(self, worker: Worker) -> Watchdog:
        async def probe() -> bool:
            try:
                await self._upstream.get_json(worker.id, worker.url + "/health",
                                              self._cfg.health_timeout_s)
            except UpstreamFailure:
                return False
            return True

        return Watchdog(self._stall, worker.id, probe)

    def _track(self, req: ClientRequest) -> None:
        """Follow a migratable stream's output (the legs are asked for token ids)."""
        if self._cfg.migration.max_migrations < 1 or not_migratable(req.kind, req.body):
            return
        req.tracker = StreamTracker(req.kind, req.body.get("return_token_ids") is True)
        req.body = {**req.body, "return_token_ids": True}

    async def serve(self, req: ClientRequest) -> web.StreamResponse:
        out = ClientStream(req.http, req.phases) if req.stream else None
        self._track(req)
        try:
            return await self._with_retries(req, out)
        except ApiError as err:
            if out is None or not out.started:
                raise
            await out.send_error(err)
            return out.response
        except asyncio.CancelledError:
            self._metrics.disconnects.inc()  # leaving the legs' blocks closed their connections
            raise
        except ConnectionResetError:  # a write to the departed client failed: same cleanup
            self._metrics.disconnects.inc()
            if out is not None and out.started:
                return out.response
            raise

    async def _with_retries(self, req: ClientRequest, out: ClientStream | None) -> web.StreamResponse:
        whole = needs_single_worker(req.kind, req.body)
        ids = None
        if self._pairing.needs_tokens(whole is not None):
            ids = await self._tokenizer.token_ids(req.kind, req.body, req.request_id)
        deadline = time.monotonic() + self._cfg.retry.budget_s
        avoid: set[str] = set()
        last: UpstreamFailure | None = None
        for attempt in range(1, self._cfg.retry.max_attempts + 1):
            try:
                route = self._pairing.plan(ids, avoid, whole is not None)
            except NoServableGroupError:
                if last is None:
                    raise
                raise last.to_api_error() from None
            req.phases.attempts = attempt
            if attempt == 1:
                role = self._metrics.observe_decision(route.decision, whole, route.target.role)
                if whole is not None:
                    log.info("%s is served whole on %s worker %s: no P/D leg serves it (%s)",
                             req.request_id, role, route.target.id, whole)
            req.phases.decision = route.decision.value
            try:
                with route.hold():  # no await since plan(): a drain cannot slip in between
                    response = await self._attempt(route, req, out)
                self._learn_transfer(route, req)
                return response
            except UpstreamFailure as failure:
                last = failure
                self._metrics.upstream_failures.labels(failure.leg, str(failure.status)).inc()
                if out is not None and out.started and req.tracker is not None:
                    return await self._migrator.resume(
                        req.kind, req.body, req.tracker, failure, req.request_id,
                        lambda worker, body: self._continue(worker, req, out, body))
                delay = backoff_delay(self._cfg.retry, attempt, self._rng)
                if ((out is not None and out.started) or not failure.retryable
                        or attempt == self._cfg.retry.max_attempts
                        or time.monotonic() + delay > deadline):
                    raise failure.to_api_error() from None
                log.info("retrying %s after %s", req.request_id, failure)
                self._metrics.retries.labels(failure.leg).inc()
                avoid.add(failure.worker_id)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last attempt raises")

    def _learn_transfer(self, route: Route, req: ClientRequest) -> None:
        """Tell the threshold how long the decode said the prompt's KV took to arrive."""
        ms = req.phases.reported.get("kv_transfer_ms")
        if (route.prefill is None or req.prompt_tokens is None
                or req.phases.reported.get("kv_recomputed") is True
                or not isinstance(ms, int | float)):
            return
        self._pairing.threshold.observe_transfer(req.prompt_tokens, ms / 1000.0)

    async def _attempt(self, route: Route, req: ClientRequest,
                       out: ClientStream | None) -> web.StreamResponse:
        req.phases.decode_worker = route.target.id
        req.phases.prefill_worker = route.prefill.id if route.prefill else None
        if req.tracker is not None:
            req.tracker.compat_hash = route.group.compat_hash
        if route.prefill is None:
            return await self._decode(route, req, out, req.body, None)
        if not route.push:
            return await self._pull(route, req, out)
        assert route.prefill.metadata is not None, "usable workers have metadata"
        to_p, to_d = push_params(new_transfer_id(), route.prefill.metadata)
        task = asyncio.create_task(self._prefill(route.prefill, req, to_p))
        try:
            return await self._decode(route, req, out, decode_body(req.body, to_d), task)
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _pull(self, route: Route, req: ClientRequest,
                    out: ClientStream | None) -> web.StreamResponse:
        """Prefill, then decode with its params; a decode leg that does not succeed (failed,
        or cancelled because the client left) leaves a lease behind: end it now."""
        assert route.prefill is not None
        pre = await self._prefill(route.prefill, req, pull_prefill_params())
        params = pre.get("kv_transfer_params")
        if not isinstance(params, dict):
            log.warning("%s returned no kv_transfer_params: the decode recomputes the prompt",
                        route.prefill.id)
            return await self._decode(route, req, out, decode_body(req.body, None), pre)
        try:
            return await self._decode(route, req, out, decode_body(req.body, params), pre)
        except BaseException:
            self._leases.release(route.prefill, params, req.request_id)
            raise

    @asynccontextmanager
    async def _on(self, worker: Worker, leg: str) -> AsyncIterator[None]:
        """Count the call in the worker's in-flight load and feed its circuit breaker (whose
        half-open probe slot is reserved here, when the leg really starts, and always given back
        or judged on the way out)."""
        worker.breaker.allow()
        worker.inflight += 1
        try:
            yield
        except UpstreamFailure as failure:
            if failure.worker_id != worker.id:  # the other leg failed; no verdict on this one
                worker.breaker.release()
            elif failure.counts_against_worker:
                failure.leg = leg
                worker.breaker.record_failure()
            else:
                failure.leg = leg
                worker.breaker.record_success()  # it answered: busy or a bad request
            raise
        except BaseException:
            worker.breaker.release()
            raise
        else:
            worker.breaker.record_success()
        finally:
            worker.inflight -= 1

    async def _prefill(self, worker: Worker, req: ClientRequest,
                       params: dict[str, Any]) -> dict[str, Any]:
        start = time.monotonic()
        async with self._on(worker, "prefill"):
            doc, _ = await self._watchdog(worker).watch(self._upstream.post_json(
                worker.id, worker.url + req.path, prefill_body(req.body, params), req.request_id))
        elapsed = time.monotonic() - start
        req.phases.prefill_ms = elapsed * 1000.0
        self._metrics.prefill_time.observe(elapsed)
        usage = doc.get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, int):
            req.prompt_tokens = tokens
            self._pairing.threshold.observe_prefill(tokens - (cached_tokens_of(doc) or 0),
                                                    elapsed)
        if not req.stream:
            req.phases.mark_first_token()
        return doc

    async def _decode(self, route: Route, req: ClientRequest, out: ClientStream | None,
                      body: dict[str, Any], prefill: Prefill) -> web.StreamResponse:
        leg = "decode" if route.prefill else "local"
        start = time.monotonic()
        if out is None:
            call = self._json_leg(route.target, leg, req, body)
            doc, headers = await (_race(call, prefill) if isinstance(prefill, asyncio.Task)
                                  else call)
            pre = await prefill if isinstance(prefill, asyncio.Task) else prefill
            req.phases.decode_ms = (time.monotonic() - start) * 1000.0
            return self._json_response(req, doc, headers, pre)
        return await self._stream_leg(route.target, leg, req, out, body, prefill, start)

    async def _json_leg(self, worker: Worker, leg: str, req: ClientRequest,
                        body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        async with self._on(worker, leg):
            return await self._watchdog(worker).watch(self._upstream.post_json(
                worker.id, worker.url + req.path, body, req.request_id))

    def _json_response(self, req: ClientRequest, doc: dict[str, Any], headers: dict[str, str],
                       pre: dict[str, Any] | None) -> web.Response:
        doc.pop("kv_transfer_params", None)
        req.phases.merge_reported(headers.get(PHASES_HEADER))
        req.phases.merge_reported(doc.pop("pdmesh", None))
        req.phases.mark_first_token()
        req.phases.finish()
        if pre is not None and isinstance(doc.get("usage"), dict):
            patch_usage(doc["usage"], cached_tokens_of(pre), None)
        return json_response(doc, headers={PHASES_HEADER: req.phases.header_value()})

    async def _stream_leg(self, worker: Worker, leg: str, req: ClientRequest, out: ClientStream,
                          body: dict[str, Any], prefill: Prefill,
                          start: float) -> web.StreamResponse:
        early: tuple[FirstTokenSkipper, str] | None = None
        if isinstance(prefill, dict):  # pull: the first token goes out before decode starts
            early = await self._send_early(req, out, prefill, worker)
        async with self._on(worker, leg), AsyncExitStack() as stack:
            opening = asyncio.ensure_future(stack.enter_async_context(self._upstream.stream(
                worker.id, worker.url + req.path, body, req.request_id)))
            # Runs last: a decode still connecting when the attempt ends is cancelled.
            stack.push_async_callback(_cancel, opening)
            if isinstance(prefill, asyncio.Task):  # push: both legs run, prefill answers first
                prefill = await _race(asyncio.shield(prefill), opening)
                early = await self._send_early(req, out, prefill, worker)
            watchdog = self._watchdog(worker)
            resp: aiohttp.ClientResponse = await watchdog.watch(opening)
            req.phases.merge_reported(resp.headers.get(PHASES_HEADER))
            cached = cached_tokens_of(prefill) if isinstance(prefill, dict) else None

            def on_usage(usage: dict[str, Any]) -> dict[str, Any]:
                req.phases.decode_ms = (time.monotonic() - start) * 1000.0
                req.phases.finish()
                return patch_usage(usage, cached, req.phases)

            await relay(resp, worker.id, out, early[0] if early else None, on_usage,
                        early[1] if early else None, req.tracker, watchdog)
        req.phases.decode_ms = (time.monotonic() - start) * 1000.0
        return await out.finish()

    async def _continue(self, worker: Worker, req: ClientRequest, out: ClientStream,
                        body: dict[str, Any]) -> web.StreamResponse:
        """A migrated stream's continuation: the whole request on `worker` (migration.py)."""
        req.phases.decode_worker = worker.id
        return await self._stream_leg(worker, "decode", req, out, body, None, time.monotonic())

    async def _send_early(self, req: ClientRequest, out: ClientStream, prefill: dict[str, Any],
                          decode: Worker) -> tuple[FirstTokenSkipper, str] | None:
        if not (self._cfg.early_first_token and can_stream_first_token_early(req.body)):
            return None
        if req.kind is ApiKind.CHAT and decode.metadata and decode.metadata.reasoning_parser:
            # The decode reads reasoning out of its chat output and may hold the first token
            # back: it is the decode's parser that decides, whatever the prefill says.
            return None
        usage = StreamUsage.from_body(req.body)
        if usage.continuous and req.prompt_tokens is None:
            # Early chunks would report usage without the prompt's count (a prefill that gave
            # none): the decode's stream, which has it, carries the first token instead.
            return None
        sent = 0
        for chunk in early_chunks(req.kind, prefill, usage, req.prompt_tokens or 0):
            kept = req.tracker.outgoing(chunk) if req.tracker is not None else chunk
            if kept is not None:
                await out.send(kept)
                sent += 1
        if sent:
            self._metrics.early_first_tokens.inc()
        return FirstTokenSkipper(req.kind, prefill), str(prefill.get("id"))
