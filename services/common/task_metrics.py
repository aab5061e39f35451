"""`pdmesh:asyncio_tasks`: how many asyncio tasks a service's event loop holds right now.

A soak (benchmarks/soak.py) watches it stay flat: a count that only grows is a task leak (a
handler that spawned work nobody awaits or cancels). The count is taken at scrape time on the
scraping thread's running loop, which is the service's loop: /metrics handlers run on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

NAME = "pdmesh:asyncio_tasks"


class AsyncioTaskCollector(Collector):
    """One gauge sample per scrape: `len(asyncio.all_tasks())` of the running loop. Scraped
    with no loop running (a test calling generate_latest directly) it yields nothing."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            count = len(asyncio.all_tasks())
        except RuntimeError:  # no running loop in this thread
            return
        yield GaugeMetricFamily(NAME, "asyncio tasks alive in this service's event loop",
                                value=count)
