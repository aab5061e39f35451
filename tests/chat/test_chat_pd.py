"""Parsed chat output through P/D behind the real router: the decode parses (reasoning, tool
calls) exactly as a mixed worker does, and the router streams none of the prefill's raw first
token ahead of it, for a reasoning parser (the prefill's answer says the output is parsed) as
for tools (the request says so).

Workers: a tiny random model (fp32, greedy: P/D gives the mixed worker's tokens) with hermes +
qwen3; a user message holding `<think>` makes the generation start inside reasoning, so the
whole random output is reasoning. The router counts the streams it sent an early first token
on (`pdmesh:router_early_first_tokens_total`): that is how the tests see whether it sent any.
A second pair has the reasoning parser on the decode only: the decode's metadata decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

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
    async with _router(pd["prefill"].url, pd["decode"].url) as url:
        yield url


@contextlib.asynccontextmanager
async def _router(prefill_url: str, decode_url: str) -> AsyncIterator[str]:
    config = RouterConfig(prefill_urls=(prefill_url,), decode_urls=(decode_url,),
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


async def early_streams(s: aiohttp.ClientSession, router: str) -> float:
    async with s.get(router + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        if family.name == "pdmesh:router_early_first_tokens":
            return sum(m.value for m in family.samples if m.name.endswith("_total"))
    raise AssertionError("the router exports no early-first-token counter")


async def streamed_early(s: aiohttp.ClientSession, router: str, path: str,
                         body: dict[str, Any]) -> tuple[Answer, bool]:
    """POST a stream through the router; also whether the router sent its first token early."""
    before = await early_streams(s, router)
    answer = await post(s, router + path, body)
    return answer, await early_streams(s, router) > before


async def test_reasoning_through_pd_is_the_mixed_answer_with_nothing_sent_early(
        pd: dict[str, WorkerThread], router: str) -> None:
    body = {"model": MODEL, "messages": THINKING, "max_tokens": 12, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, pd["mixed"].url + "/v1/chat/completions", body)
        message = ref.body["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        whole = await post(s, router + "/v1/chat/completions", body)
        assert whole.body["choices"][0]["message"] == message
        streamed, early = await streamed_early(s, router, "/v1/chat/completions", {
            **body, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status == 200 and not early, streamed.chunks[:2]
        assert joined(streamed, "reasoning_content") == message["reasoning_content"]
        assert joined(streamed, "content") == ""
        usage = streamed.chunks[-1]["usage"]
        assert usage["completion_tokens_details"] == ref.body["usage"][
            "completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]}
        # The early first token is on in this router: an unparsed request gets it.
        plain, early = await streamed_early(s, router, "/v1/completions", {
            "model": MODEL, "prompt": "Once upon", "max_tokens": 4, "stream": True})
        assert plain.status == 200 and early
        # Chunks the router makes up carry the engine fingerprint the decode's chunks carry.
        assert {c.get("system_fingerprint") for c in plain.chunks if c.get("choices")} == {
            ref.body["system_fingerprint"]}
        await settle_to_zero(s, pd["prefill"].url, pd["decode"].url)


async def test_tools_through_pd_send_nothing_early(pd: dict[str, WorkerThread],
                                                  router: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}],
            "tools": [TOOL], "max_tokens": 8, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, pd["mixed"].url + "/v1/chat/completions", body)
        assert ref.status == 200, ref.body
        streamed, early = await streamed_early(s, router, "/v1/chat/completions",
                                               {**body, "stream": True})
        assert streamed.status == 200 and not early, streamed.chunks[:2]
        assert (joined(streamed, "content") or None) == ref.body["choices"][0]["message"]["content"]
        await settle_to_zero(s, pd["prefill"].url, pd["decode"].url)


@pytest.fixture(scope="module")
def decode_parses_only(tmp_path_factory: pytest.TempPathFactory,
                       pd: dict[str, WorkerThread]) -> Iterator[dict[str, WorkerThread]]:
    """A prefill with no parser in front of a decode with the reasoning parser."""
    model = make_model(tmp_path_factory.mktemp("chat-pd-decode") / "tiny", seed=0)
    configs = {"prefill": worker_config(model, "prefill"),
               "decode": dataclasses.replace(worker_config(model, "decode"), parsers=PARSERS)}
    workers = start_workers(configs)
    try:
        yield workers
    finally:
        stop_all(workers)


async def test_the_decodes_reasoning_parser_stops_the_early_token(
        pd: dict[str, WorkerThread], decode_parses_only: dict[str, WorkerThread]) -> None:
    # The prefill's answer does not say "parsed" (it has no parser): only the decode's metadata
    # tells the router that the first token may become reasoning.
    pair = decode_parses_only
    body = {"model": MODEL, "messages": THINKING, "max_tokens": 12, "temperature": 0,
            "stream": True}
    async with aiohttp.ClientSession() as s, _router(pair["prefill"].url,
                                                     pair["decode"].url) as router:
        ref = await post(s, pd["mixed"].url + "/v1/chat/completions", {**body, "stream": False})
        message = ref.body["choices"][0]["message"]
        streamed, early = await streamed_early(s, router, "/v1/chat/completions", body)
        assert streamed.status == 200 and not early, streamed.chunks[:2]
        assert joined(streamed, "reasoning_content") == message["reasoning_content"]
        assert joined(streamed, "content") == ""
        await settle_to_zero(s, pair["prefill"].url, pair["decode"].url)
