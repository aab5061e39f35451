"""Incompatible pairs with real workers: a push prefill and a pull decode are never paired.

Their compat_hash differs (transfer_mode is a compatibility factor the workers report), so the
router puts them in two groups, neither servable: /health is 503, requests get a fast 503 that
names what is missing, and the metadata shows why. Registering the push decode through
`POST /workers` (admin token) completes the push group, which then serves, through the new pair
only (the pull decode still gets nothing).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.support.pd import post
from tests.support.real_mesh import (
    ADMIN_TOKEN,
    MODEL,
    Fleet,
    Service,
    get_json,
    running_router,
    until,
)

# Generous: the first test of a session also waits for the shared fleet to load (see conftest).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

BODY = {"model": MODEL, "prompt": "Pairs of socks are", "max_tokens": 8, "temperature": 0,
        "return_token_ids": True}


@pytest.fixture(scope="module")
def router(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_router("router-mismatch", tmp_path_factory.mktemp("router-pairing"),
                        "--prefill", fleet.push_prefill.url, "--decode", fleet.decode.url,
                        servable=False) as router:
        yield router


async def _all_healthy(session: aiohttp.ClientSession, router: Service) -> dict | None:
    doc = await get_json(session, router.url + "/v1/router/metadata")
    return doc if all(w["health"] == "healthy" for w in doc["workers"]) else None


async def test_push_prefill_and_pull_decode_are_never_paired(fleet, router):
    async with aiohttp.ClientSession() as s:
        # Both workers answer their health checks: what keeps the group unservable is pairing.
        doc = await until(lambda: _all_healthy(s, router), 60.0, "workers never became healthy")
        own = {w.url: await get_json(s, w.url + "/v1/metadata")
               for w in (fleet.push_prefill, fleet.decode)}
        assert doc["servable"] is False
        groups = {g["transfer_mode"]: g for g in doc["groups"]}
        assert set(groups) == {"push", "pull"}
        push, pull = groups["push"], groups["pull"]
        assert push["compat_hash"] == own[fleet.push_prefill.url]["compat_hash"]
        assert pull["compat_hash"] == own[fleet.decode.url]["compat_hash"]
        assert (push["prefill"], push["decode"]) == (["prefill-0"], [])
        assert (pull["prefill"], pull["decode"]) == ([], ["decode-0"])
        assert not push["servable"] and "no decode worker" in push["reason"]
        assert not pull["servable"] and "no prefill worker" in pull["reason"]
        factors = {w["url"]: w["compat_factors"] for w in doc["workers"]}
        assert factors[fleet.push_prefill.url]["transfer_mode"] == "push"
        assert factors[fleet.decode.url]["transfer_mode"] == "pull"

        async with s.get(router.url + "/health") as resp:
            assert resp.status == 503
        start = time.monotonic()
        answer = await post(s, router.url + "/v1/completions", BODY)
        assert time.monotonic() - start < 5.0  # at once, not after a timeout
        assert answer.status == 503
        assert answer.error["code"] == "no_servable_group"
        assert "no decode worker" in answer.error["message"]
        assert "no prefill worker" in answer.error["message"]


async def test_a_compatible_decode_added_later_makes_it_servable(fleet, router):
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession() as s:
        await until(lambda: _all_healthy(s, router), 60.0, "workers never became healthy")
        request = {"url": fleet.push_decode.url, "role": "decode"}
        async with s.post(router.url + "/workers", json=request) as resp:
            assert resp.status == 401  # the admin token is required
        async with s.post(router.url + "/workers", json=request, headers=headers) as resp:
            assert resp.status == 202
            job = await resp.json()

        async def finished() -> dict | None:
            doc = await get_json(s, f"{router.url}/workers/jobs/{job['job_id']}")
            return doc if doc["state"] != "pending" else None

        done = await until(finished, 30.0, "the registration job never finished")
        assert done["state"] == "succeeded", done
        await router.wait_healthy(s, 10.0)

        doc = await get_json(s, router.url + "/v1/router/metadata")
        groups = {g["transfer_mode"]: g for g in doc["groups"]}
        assert groups["push"]["servable"] and groups["push"]["decode"] == [done["worker_id"]]
        assert not groups["pull"]["servable"]  # the pull decode is still alone
        got = await post(s, router.url + "/v1/completions", BODY)
        ref = await post(s, fleet.mixed.url + "/v1/completions", BODY)
    assert got.status == 200, got.body
    assert got.token_ids == ref.token_ids
    assert (got.phases["prefill_worker"], got.phases["decode_worker"]) == (
        "prefill-0", done["worker_id"])
