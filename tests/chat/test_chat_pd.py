"""Parsed chat output through P/D behind the real router: the decode parses (reasoning, tool
calls) exactly as a mixed worker does, and the router streams none of the prefill's raw first
token ahead of it, for a reasoning parser (the prefill's answer says the output is parsed) as
for tools (the request says so).

Workers: a tiny random model (fp32, greedy: P/D gives the mixed worker's tokens) with hermes +
qwen3; a user message holding `<think>` makes the generation start inside reasoning, so the
whole random output is reasoning. Chunks the router makes up itself (the early first token)
carry no `system_fingerprint`: that is how the tests see whether it sent any.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import Policy, RouterConfig
from services.worker.parsers_config import ParsersConfig
from tests.support.pd import Answer, post, settle_to_zero
from tests.support.pd_mesh import MODEL, make_model, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all

PARSERS = ParsersConfig("hermes", "qwen3", enable_auto_tool_choice=True)
THINKING = [{"role": "user", "content": "<think> Think it over."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerThread]]:
    model = make_model(tmp_path_factory.mktemp("chat-pd") / "tiny", seed=0)
    configs = {role: dataclasses.replace(worker_config(model, role), parsers=PARSERS)
               for role in ("mixed", "prefill", "decode")}
    workers = start_workers(configs)
    try:
        yield workers
    finally:
        stop_all(workers)


@pytest.fixture
async def router(pd: dict[str, WorkerThread]) -> AsyncIterator[str]:
    config = RouterConfig(prefill_urls=(pd["prefill"].url,), decode_urls=(pd["decode"].url,),
                          prefill_policy=Policy.LEAST_LOADED, health_interval_s=0.05,
                          health_timeout_s=2.0)
    assert config.early_first_token
    client = TestClient(TestServer(create_app(config), host="127.0.0.1"))
    await client.start_server()
    try:
        while (await client.get("/health")).status != 200:
            await asyncio.sleep(0.02)
        yield str(client.make_url("")).rstrip("/")
    finally:
        await client.close()


def joined(answer: Answer, key: str) -> str:
    return "".join((c["choices"][0].get("delta") or {}).get(key) or ""
                   for c in answer.chunks if c.get("choices"))


def made_by_router(answer: Answer) -> list[dict[str, Any]]:
    return [c for c in answer.chunks if c.get("choices") and "system_fingerprint" not in c]


async def test_reasoning_through_pd_is_the_mixed_answer_with_nothing_sent_early(
        pd: dict[str, WorkerThread], router: str) -> None:
    body = {"model": MODEL, "messages": THINKING, "max_tokens": 12, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, pd["mixed"].url + "/v1/chat/completions", body)
        message = ref.body["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        whole = await post(s, router + "/v1/chat/completions", body)
        assert whole.body["choices"][0]["message"] == message
        streamed = await post(s, router + "/v1/chat/completions", {
            **body, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status == 200 and not made_by_router(streamed), streamed.chunks[:2]
        assert joined(streamed, "reasoning_content") == message["reasoning_content"]
        assert joined(streamed, "content") == ""
        usage = streamed.chunks[-1]["usage"]
        assert usage["completion_tokens_details"] == ref.body["usage"][
            "completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]}
        # The early first token is on in this router: an unparsed request gets it.
        plain = await post(s, router + "/v1/completions", {
            "model": MODEL, "prompt": "Once upon", "max_tokens": 4, "stream": True})
        assert made_by_router(plain)
        await settle_to_zero(s, pd["prefill"].url, pd["decode"].url)


async def test_tools_through_pd_send_nothing_early(pd: dict[str, WorkerThread],
                                                  router: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}],
            "tools": [TOOL], "max_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, pd["mixed"].url + "/v1/chat/completions", body)
        assert ref.status == 200, ref.body
        streamed = await post(s, router + "/v1/chat/completions", {**body, "stream": True})
        assert streamed.status == 200 and not made_by_router(streamed), streamed.chunks[:2]
        assert (joined(streamed, "content") or None) == ref.body["choices"][0]["message"]["content"]
        await settle_to_zero(s, pd["prefill"].url, pd["decode"].url)
