"""Failures with real processes: a prefill killed mid-load, the only decode killed, then back.

- Two pull prefills (round robin), one decode: the spare prefill is frozen so requests pile up
  on it, then SIGKILLed; every request still succeeds (the router retries on the other prefill)
  and no block is left held.
- The only decode is killed: requests fail fast with an OpenAI error envelope (no hang), the
  prefill's lease for the failed attempt is aborted at once, and /health turns 503 within a few
  health rounds; restarted on the same port, the group heals and serves the mixed worker's
  answer again. (The fleet's decode is restored for the other tests, whatever happens.)
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.pd import Answer, post, settle_to_zero
from tests.support.real_mesh import (
    MODEL,
    Fleet,
    Service,
    get_json,
    has_status,
    metric,
    router_in_test,
    until,
)

# Generous: the first test of a session also waits for the shared fleet to load (see conftest).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

BODY = {"model": MODEL, "prompt": "A short story about a robot:", "max_tokens": 8,
        "temperature": 0, "return_token_ids": True}
LOAD = 8  # concurrent requests while the prefill dies


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-failures")


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> Answer:
    async def ask() -> Answer:
        async with aiohttp.ClientSession() as s:
            return await post(s, fleet.mixed.url + "/v1/completions", BODY)

    answer = asyncio.run(ask())
    assert answer.status == 200 and answer.token_ids
    return answer


async def _inflight_on(session: aiohttp.ClientSession, router: Service, url: str) -> int:
    doc = await get_json(session, router.url + "/v1/router/metadata")
    return next(w["load"]["router_inflight"] for w in doc["workers"] if w["url"] == url)


async def test_killing_one_of_two_prefills_mid_load(fleet, logs, reference):
    victim = fleet.spare_prefill
    async with router_in_test("router-two-prefills", logs, "--prefill", fleet.prefill.url,
                              "--prefill", victim.url, "--decode", fleet.decode.url,
                              "--prefill-policy", "round_robin", "--max-attempts", "4") as router:
        async with aiohttp.ClientSession() as s:
            victim.freeze()  # requests sent to it wait there ...
            load = [asyncio.create_task(post(s, router.url + "/v1/completions", BODY))
                    for _ in range(LOAD)]
            await until(lambda: _inflight_on(s, router, victim.url), 60.0,
                        "no request ever reached the frozen prefill")
            victim.kill()  # ... and it dies under them
            answers = await asyncio.gather(*load)
            for answer in answers:
                assert answer.status == 200, answer.body
                assert answer.token_ids == reference.token_ids
            retries = await metric(s, router.url, "pdmesh:router_retries_total",
                                   '{leg="prefill"}')
            assert retries >= 1
            assert any(a.phases["attempts"] > 1 for a in answers)
            await settle_to_zero(s, fleet.prefill.url, fleet.decode.url, timeout=20.0)


async def _timed(session: aiohttp.ClientSession, url: str) -> tuple[Answer, float]:
    start = time.monotonic()
    answer = await post(session, url + "/v1/completions", BODY)
    return answer, time.monotonic() - start


async def test_killing_the_only_decode_then_restarting_it(fleet, logs, reference):
    decode = fleet.decode
    async with router_in_test("router-one-decode", logs, "--prefill", fleet.prefill.url,
                              "--decode", decode.url) as router:
        async with aiohttp.ClientSession() as s:
            try:
                decode.kill()
                # 502 if the legs ran into the dead decode before a health round noticed it
                # (retries included), 503 after; an OpenAI error envelope either way.
                answer, took = await _timed(s, router.url)
                assert took < 10.0 and answer.status in (502, 503)
                assert set(answer.error) >= {"message", "type", "code"}
                # If a prefill leg ran, its lease was aborted rather than left to its 30 s expiry.
                await settle_to_zero(s, fleet.prefill.url, timeout=10.0)

                await until(lambda: has_status(s, router.url + "/health", 503), 10.0,
                            "/health never turned 503")
                answer, took = await _timed(s, router.url)
                assert took < 2.0 and answer.status == 503
                assert answer.error["code"] == "no_servable_group"
                assert "decode" in answer.error["message"]
                doc = await get_json(s, router.url + "/v1/router/metadata")
                (dead,) = [w for w in doc["workers"] if w["url"] == decode.url]
                assert dead["health"] == "unhealthy" and dead["reason"]
                assert doc["servable"] is False and doc["groups"][0]["servable"] is False

                decode.restart()  # same port, same flags
                await router.wait_healthy(s, 120.0)
                healed = await post(s, router.url + "/v1/completions", BODY)
                assert healed.status == 200, healed.body
                assert healed.token_ids == reference.token_ids
            finally:
                if not decode.alive():
                    decode.start()
                await decode.wait_healthy(s, 120.0)
