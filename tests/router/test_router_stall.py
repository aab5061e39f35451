"""The stall watchdog (services/router/stall.py) on its own: a silent leg whose worker fails
its probe fails at once; one whose worker answers is waited on up to the stall limit; a leg
that answers is never judged."""

from __future__ import annotations

import asyncio

import pytest

from services.router.stall import StallPolicy, Watchdog
from services.router.upstream import UpstreamFailure

POLICY = StallPolicy(stall_timeout_s=0.01, stall_limit_s=0.2)


class Probe:
    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        return self.alive


async def test_silent_leg_of_a_dead_worker_fails_after_one_probe():
    probe = Probe(alive=False)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(UpstreamFailure) as info:
        await Watchdog(POLICY, "w-1", probe).watch(never)
    assert info.value.stalled and info.value.worker_id == "w-1" and info.value.status is None
    assert "health check failed" in info.value.detail
    assert probe.calls == 1 and never.cancelled()  # the leg is closed, not left running


async def test_silent_leg_of_a_live_worker_is_waited_on_up_to_the_limit():
    probe = Probe(alive=True)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(UpstreamFailure) as info:
        await Watchdog(POLICY, "w-1", probe).watch(never)
    assert info.value.stalled and "stall limit" in info.value.detail
    assert probe.calls >= 2  # probed every period until the limit


async def test_a_slow_answer_from_a_live_worker_is_returned():
    probe = Probe(alive=True)

    async def slow() -> str:
        await asyncio.sleep(0.05)
        return "answer"

    patient = StallPolicy(stall_timeout_s=0.01, stall_limit_s=60.0)
    assert await Watchdog(patient, "w-1", probe).watch(slow()) == "answer"
    assert probe.calls >= 1
