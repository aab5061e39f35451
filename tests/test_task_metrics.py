"""`pdmesh:asyncio_tasks` (services/common/task_metrics.py): the running loop's task count at
scrape time, on the worker's and the router's /metrics alike."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from services.common.task_metrics import NAME, AsyncioTaskCollector
from services.router.metrics import RouterMetrics


def _sample(registry: CollectorRegistry) -> float | None:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(NAME + " "):
            return float(line.split()[1])
    return None


async def test_counts_the_running_loops_tasks() -> None:
    registry = CollectorRegistry()
    registry.register(AsyncioTaskCollector())
    idle = _sample(registry)
    assert idle == len(asyncio.all_tasks())
    sleepers = [asyncio.ensure_future(asyncio.sleep(10)) for _ in range(5)]
    try:
        assert _sample(registry) == idle + 5
    finally:
        for task in sleepers:
            task.cancel()
        await asyncio.gather(*sleepers, return_exceptions=True)
    assert _sample(registry) == idle


def test_no_sample_without_a_running_loop() -> None:
    registry = CollectorRegistry()
    registry.register(AsyncioTaskCollector())
    assert _sample(registry) is None


async def test_the_router_exposes_it() -> None:
    assert _sample(RouterMetrics().registry) == len(asyncio.all_tasks())
