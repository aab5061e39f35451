"""End to end with a real worker process (SmolLM2, mixed role) behind the router."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.first_token import ApiKind
from services.router.state import STATE_KEY

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker_url():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", MODEL, "--port", str(port),
         "--threads", "1", "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    async def wait() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                assert proc.poll() is None, proc.stderr.read().decode()
                try:
                    async with session.get(url + "/health") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise AssertionError("worker never became healthy")

    try:
        asyncio.run(wait())
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


async def test_router_in_front_of_a_real_worker(worker_url):
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
