"""Ending a pull prefill's KV lease when its decode leg will never read it.

In pull mode the prefill answers with `kv_transfer_params` naming blocks it now holds under a
lease; only the decode that pulls them releases the lease. When the decode leg ends without
having done so (the client left between the legs or during the decode's connect, or the decode
failed and the attempt is retried with a fresh prefill), those blocks would stay held until the
lease expires. The router then calls the prefill's `POST /v1/kv_transfer/abort` with the params
it returned, verbatim. A decode that did pull makes the call a no-op (`{"released": false}`).

The call is fire-and-forget: the request's own task is usually being cancelled, so it runs in
a task of its own, tracked here (strong references) and awaited briefly at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.router.metrics import RouterMetrics
from services.router.upstream import Upstream, UpstreamFailure
from services.router.workers import Worker

log = logging.getLogger(__name__)

ABORT_PATH = "/v1/kv_transfer/abort"


class LeaseReleaser:
    """Background `kv_transfer/abort` calls to prefill workers, counted by outcome."""

    def __init__(self, upstream: Upstream, metrics: RouterMetrics) -> None:
        # `upstream` is the control session: its total timeout bounds every call.
        self._upstream = upstream
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, prefill: Worker, params: dict[str, Any], request_id: str) -> None:
        """Schedule the abort of the lease `params` (what `prefill` returned) describes."""
        task = asyncio.get_running_loop().create_task(self._abort(prefill, params, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, prefill: Worker, params: dict[str, Any], request_id: str) -> None:
        try:
            doc, _ = await self._upstream.post_json(prefill.id, prefill.url + ABORT_PATH,
                                                    {"kv_transfer_params": params}, request_id)
        except UpstreamFailure as failure:  # the prefill is gone or refused: expiry reclaims it
            log.info("lease release for %s failed: %s", request_id, failure)
            self._metrics.lease_releases.labels("failed").inc()
            return
        released = bool(doc.get("released"))
        self._metrics.lease_releases.labels("released" if released else "already_gone").inc()

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def close(self, timeout_s: float = 1.0) -> None:
        """Let calls in flight finish (they are short), then cancel what is left."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
