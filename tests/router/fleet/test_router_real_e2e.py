"""End to end through a real `pdmesh router` process in front of real SmolLM2 workers.

Three routers share the session's worker fleet (tests/support/real_mesh.py): P/D in pull mode, P/D in push
mode, and one mixed worker. Greedy answers through each must equal the mixed worker's answer to
the same request sent to it directly (the independent reference), token for token. Also: the
openai SDK streaming a chat through the router, the metadata document, and cancellation (a
client that leaves frees the blocks on both workers; in pull mode one that leaves between the
legs gets the prefill's lease aborted at once, long before its 30 s expiry).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import aiohttp
import openai
import pytest

from tests.support.pd import Answer, blocks_in_use, post, settle_to_zero
from tests.support.real_mesh import MODEL, Fleet, Service, get_json, metric, running_router, until

# Generous: the first test of a session also waits for the shared fleet to load (see conftest).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

MODES = ("pull", "push", "mixed")
COMPLETION = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12,
              "temperature": 0, "return_token_ids": True}
MESSAGES = [{"role": "user", "content": "Name a large city in Europe."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
# Long enough that the decode is still generating when the client leaves.
LONG = {"model": MODEL, "prompt": "Count slowly from one to one hundred:", "max_tokens": 96,
        "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def routers(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("router-e2e")
    with ExitStack() as stack:
        yield {
            # A long health timeout: a decode frozen by a test stays "healthy" meanwhile.
            "pull": stack.enter_context(running_router(
                "router-pull", logs, "--prefill", fleet.prefill.url, "--decode", fleet.decode.url,
                "--health-timeout", "15")),
            "push": stack.enter_context(running_router(
                "router-push", logs, "--prefill", fleet.push_prefill.url,
                "--decode", fleet.push_decode.url)),
            "mixed": stack.enter_context(running_router(
                "router-mixed", logs, "--worker", fleet.mixed.url)),
        }


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> dict[str, Answer]:
    """The mixed worker's own answers, asked directly (no router)."""
    async def ask() -> dict[str, Answer]:
        async with aiohttp.ClientSession() as s:
            return {"completion": await post(s, fleet.mixed.url + "/v1/completions", COMPLETION),
                    "chat": await post(s, fleet.mixed.url + "/v1/chat/completions", CHAT)}

    answers = asyncio.run(ask())
    assert all(a.status == 200 and a.text for a in answers.values()), answers
    return answers


async def _ready(session: aiohttp.ClientSession, router: Service) -> None:
    """Servable again (an earlier test may have frozen a worker for a while)."""
    await router.wait_healthy(session, 60.0)


@pytest.mark.parametrize("mode", MODES)
async def test_greedy_output_equals_a_mixed_worker(routers, reference, mode):
    router = routers[mode]
    async with aiohttp.ClientSession() as s:
        await _ready(s, router)
        got = await post(s, router.url + "/v1/completions", COMPLETION)
        streamed = await post(s, router.url + "/v1/completions", {**COMPLETION, "stream": True})
        chat = await post(s, router.url + "/v1/chat/completions", CHAT)
    ref = reference["completion"]
    assert got.status == 200, got.body
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert streamed.status == 200 and streamed.text == ref.text
    assert chat.status == 200 and chat.text == reference["chat"].text
    phases = got.phases
    if mode == "mixed":
        assert phases["decision"] == "mixed" and phases["prefill_worker"] is None
    else:
        assert phases["decision"] == "prefill_decode"
        assert (phases["prefill_worker"], phases["decode_worker"]) == ("prefill-0", "decode-0")
        assert "kv_transfer_ms" in phases  # reported by the decode worker, merged by the router
        cached = got.body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(cached, int) and 0 <= cached <= got.body["usage"]["prompt_tokens"]


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_openai_sdk_streams_a_chat_through_the_router(routers, reference, mode):
    router = routers[mode]
    async with aiohttp.ClientSession() as s:
        await _ready(s, router)
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "sdk-e2e-1"})
        chunks = [c async for c in stream]
    assert len({c.id for c in chunks}) == 1  # the prefill's early token and the decode's: one id
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"].text
    usage = chunks[-1].usage
    assert usage.completion_tokens == reference["chat"].body["usage"]["completion_tokens"]
    assert usage.model_extra["pdmesh"]["decision"] == "prefill_decode"
    assert usage.prompt_tokens_details.cached_tokens is not None


async def test_metadata_document_describes_workers_and_groups(fleet, routers):
    router = routers["pull"]
    async with aiohttp.ClientSession() as s:
        await _ready(s, router)
        doc = await get_json(s, router.url + "/v1/router/metadata")
        listed = await get_json(s, router.url + "/workers")
        own = {w.url: await get_json(s, w.url + "/v1/metadata")
               for w in (fleet.prefill, fleet.decode)}
    info = doc["router"]
    assert info["version"] and info["model"] == MODEL and info["uptime_s"] > 0
    assert info["policies"] == {"prefill": "prefix_aware", "decode": "least_loaded"}
    assert doc["servable"] is True and doc["reason"] is None

    workers = {w["url"]: w for w in doc["workers"]}
    assert set(workers) == set(own)
    for url, w in workers.items():
        md = own[url]  # what the worker says about itself, relayed unchanged
        assert (w["role"], w["model"], w["engine_id"]) == (md["role"], MODEL, md["engine_id"])
        assert w["compat_hash"] == md["compat_hash"]
        assert w["compat_factors"] == md["compat_factors"]
        assert w["transfer_mode"] == md["transfer_mode"] == "pull"
        assert w["kv_endpoint"] == md["kv_endpoint"]
        assert w["kernels"] == md["kernels"] and md["kernels"]["cpu_tier"]
        assert (w["health"], w["circuit_breaker"], w["reason"]) == ("healthy", "closed", None)
        assert set(w["load"]) >= {"running", "waiting", "kv_usage"}
        assert 0.0 <= w["load"]["kv_usage"] <= 1.0
        assert time.time() - w["last_seen"] < 30
    assert [w["url"] for w in listed["workers"]] == [w["url"] for w in doc["workers"]]

    (group,) = doc["groups"]
    assert group["compat_hash"] == own[fleet.prefill.url]["compat_hash"]
    assert (group["transfer_mode"], group["servable"], group["reason"]) == ("pull", True, None)
    by_url = {w["url"]: w["id"] for w in doc["workers"]}
    assert group["prefill"] == [by_url[fleet.prefill.url]]
    assert group["decode"] == [by_url[fleet.decode.url]] and group["mixed"] == []


async def _first_event(resp: aiohttp.ClientResponse) -> dict:
    async for line in resp.content:
        if line.startswith(b"data: {"):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without an event")


async def test_client_gone_between_the_legs_releases_the_prefill_lease(fleet, routers):
    """Pull: the decode is frozen, so the client holds the prefill's early first token and
    nothing else; when it leaves, the router must abort the prefill's lease at once."""
    router = routers["pull"]
    body = {**CHAT, "stream": True}
    async with aiohttp.ClientSession() as s:
        await _ready(s, router)
        released = await metric(s, router.url, "pdmesh:router_lease_releases_total",
                                '{result="released"}')
        fleet.decode.freeze()
        try:
            resp = await s.post(router.url + "/v1/chat/completions", json=body)
            assert resp.status == 200
            assert (await _first_event(resp))["choices"]  # the prefill's token: it answered
            assert (await blocks_in_use(s, fleet.prefill.url))[2] > 0  # its lease holds blocks
            resp.close()  # the client leaves while the decode leg is still connecting
            # Well within the 30 s lease: only the router's abort can free the blocks this soon.
            await settle_to_zero(s, fleet.prefill.url, timeout=10.0)
            await until(lambda: _released(s, router, released), 10.0,
                        "the router never counted the lease release")
        finally:
            fleet.decode.thaw()
        await settle_to_zero(s, fleet.prefill.url, fleet.decode.url, timeout=30.0)


async def _released(session: aiohttp.ClientSession, router: Service, before: float) -> bool:
    count = await metric(session, router.url, "pdmesh:router_lease_releases_total",
                         '{result="released"}')
    return count == before + 1


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_client_disconnect_mid_decode_frees_blocks_on_both_workers(fleet, routers, mode):
    router = routers[mode]
    prefill, decode = ((fleet.prefill, fleet.decode) if mode == "pull"
                       else (fleet.push_prefill, fleet.push_decode))
    aborted = f'{{finished_reason="abort",model_name="{MODEL}"}}'  # labels sorted
    async with aiohttp.ClientSession() as s:
        await _ready(s, router)
        before = await metric(s, decode.url, "pdmesh:request_success_total", aborted)
        resp = await s.post(router.url + "/v1/completions", json=LONG)
        assert resp.status == 200
        await _first_event(resp)
        await _first_event(resp)  # the decode is generating
        assert (await blocks_in_use(s, decode.url))[0] > 0
        resp.close()
        await settle_to_zero(s, prefill.url, decode.url, timeout=20.0)
        await until(lambda: _more(s, decode.url, aborted, before), 10.0,
                    "the decode worker never counted the request as aborted")


async def _more(session: aiohttp.ClientSession, url: str, labels: str, before: float) -> bool:
    return await metric(session, url, "pdmesh:request_success_total", labels) > before

