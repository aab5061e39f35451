"""The leak detector: a burst of mixed P/D traffic with random client aborts, after which every
worker's held, leased and allocated blocks return to zero.

Pull traffic goes to the short-lease prefill: a client that leaves exactly while the prefill's
answer is on the wire leaves a lease nobody can name (no router can release what it never
received), and reclaiming those is what leases are for. Every other abort path frees at once;
the test bounds the leases that had to expire by the number of aborted pull requests.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import aiohttp

from tests.support.pd import Answer, dispatch_pull, dispatch_push, metadata, post, settle_to_zero
from tests.support.pd_mesh import MODEL, SHORT_LEASE_S, Mesh

NUM_REQUESTS = 200
CONCURRENCY = 16


def random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randrange(1, 120)))
    common = {"model": MODEL, "max_tokens": rng.randrange(1, 7),
              "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(100),
              "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": words}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}


async def one(s: aiohttp.ClientSession, mesh: Mesh, push_meta: dict[str, Any],
              rng: random.Random, aborted_pulls: list[int]) -> Answer | None:
    path, body = random_request(rng)
    kind = rng.choice(["pull", "push", "plain-decode", "plain-prefill"])
    if kind == "pull":
        work = dispatch_pull(s, mesh.short_lease_prefill.url, mesh.decode.url, path, body)
    elif kind == "push":
        work = dispatch_push(s, mesh.push_prefill.url, mesh.push_decode.url, path, body, push_meta)
    else:
        work = post(s, (mesh.decode if kind == "plain-decode" else mesh.push_prefill).url + path,
                    body)
    task = asyncio.ensure_future(work)
    if rng.random() < 0.4:  # the client goes away at a random point of either leg
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.12))
        if not done:
            task.cancel()
            aborted_pulls[0] += kind == "pull"
    try:
        return await task
    except asyncio.CancelledError:
        return None


async def expired_leases(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    match = re.search(r"^pdmesh:kv_expired_leases_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_random_aborts_leave_no_block_held(mesh: Mesh) -> None:
    rng = random.Random(4)
    gate = asyncio.Semaphore(CONCURRENCY)
    aborted_pulls = [0]
    workers = (mesh.short_lease_prefill, mesh.decode, mesh.push_prefill, mesh.push_decode)
    async with aiohttp.ClientSession() as s:
        push_meta = await metadata(s, mesh.push_prefill.url)
        expired_before = await expired_leases(s, mesh.short_lease_prefill.url)

        async def bounded(seed: int) -> Answer | None:
            async with gate:
                return await one(s, mesh, push_meta, random.Random(seed), aborted_pulls)

        answers = await asyncio.gather(*(bounded(rng.randrange(1 << 30))
                                         for _ in range(NUM_REQUESTS)))
        finished = [a for a in answers if a is not None]
        assert len(finished) > NUM_REQUESTS // 3
        for answer in finished:  # every answer is a success or a clean error, never a 500
            assert answer.status == 200 or (400 <= answer.status < 600 and answer.status != 500)
            assert answer.status != 200 or answer.error is None, answer.error
        await settle_to_zero(s, *(w.url for w in workers), timeout=SHORT_LEASE_S + 10.0)
        expired = await expired_leases(s, mesh.short_lease_prefill.url) - expired_before
        assert expired <= aborted_pulls[0]
