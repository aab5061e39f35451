"""An in-process router app in front of the shared real mixed worker (SmolLM2): the openai SDK
streams a chat through it, and the router's own tokenizer agrees with the worker's /tokenize."""

from __future__ import annotations

import asyncio

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.state import STATE_KEY
from shared.protocol.pd import ApiKind
from tests.support.real_mesh import MODEL

# Generous: the first test of a session also waits for the shared fleet to load (see conftest).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


async def test_router_in_front_of_a_real_worker(fleet):
    worker_url = fleet.mixed.url
    config = RouterConfig(mixed_urls=(worker_url,), disagg_min_tokens=4, health_interval_s=0.2)
    async with TestClient(TestServer(create_app(config), host="127.0.0.1")) as client:
        base = str(client.make_url("")).rstrip("/")
        for _ in range(100):
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as sdk, \
                openai.AsyncOpenAI(base_url=worker_url + "/v1", api_key="x", max_retries=0) as direct:
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            ref = await direct.chat.completions.create(model=MODEL, messages=messages,
                                                       max_tokens=10, temperature=0)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.choices[0].message.content and text
        usage = chunks[-1].usage
        assert usage.completion_tokens == ref.usage.completion_tokens
        assert usage.model_extra["pdmesh"]["decision"] == "mixed"

        # The router's own tokenizer (loaded in the background after the first health round)
        # agrees with the worker's /tokenize on the chat prompt.
        resp = await client.post("/tokenize", json={"model": MODEL, "messages": messages})
        worker_ids = (await resp.json())["tokens"]
        tokenizer = client.app[STATE_KEY].rt.tokenizer
        for _ in range(100):
            if tokenizer.local_loaded:
                break
            await asyncio.sleep(0.1)
        assert tokenizer.local_loaded
        assert await tokenizer.token_ids(ApiKind.CHAT, {"messages": messages}, "t") == worker_ids
