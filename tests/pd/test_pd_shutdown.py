"""A stopped worker lets its engine go: once its app has been cleaned up, nothing in the
process still reaches the engine (and so its weights and KV cache) from the app.

The app itself can outlive its cleanup: aiohttp caches each (handler, apps) pair it has built
middleware for at module level, and a caller may keep the app. The prefill and decode workers'
KV services once left their Prometheus gauges bound to the live transfer, which kept every
stopped worker's model in memory (~600 MB per SmolLM2 worker in one process).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import aiohttp
import pytest

from services.worker.routes import RUNTIME_KEY
from tests.support.pd_mesh import MODEL, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all


async def serve_some(workers: dict[str, WorkerThread]) -> None:
    """Traffic through each worker's middleware chain and its KV gauges, as in service."""
    async with aiohttp.ClientSession() as s:
        for w in workers.values():
            async with s.post(w.url + "/v1/completions",
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200, await r.text()
            async with s.get(w.url + "/metrics") as r:
                assert "pdmesh:kv_held_blocks" in await r.text()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_stopped_pair_leaves_its_engines_unreachable(tiny_model: Path, mode: str) -> None:
    workers = start_workers({role: worker_config(tiny_model, role, mode)
                             for role in ("prefill", "decode")})
    try:
        asyncio.run(serve_some(workers))
        engines = {role: weakref.ref(w.app[RUNTIME_KEY].engine) for role, w in workers.items()}
    finally:
        stop_all(workers)
    assert all(w.app is not None for w in workers.values())  # the apps themselves stay
    gc.collect()
    assert {role: ref() is None for role, ref in engines.items()} == {
        "prefill": True, "decode": True}
