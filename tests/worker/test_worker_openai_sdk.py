"""The official openai SDK (sync and async) against the worker (fake engine, real port)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from shared.config import EngineConfig
from tests.support.fake_engine import BOS, FakeEngine, fake_completion_text
from tests.support.worker import API_KEY, MODEL, WorkerThread, factory_for, worker_config

Threaded = tuple[WorkerThread, FakeEngine]


def sync_client(server: WorkerThread, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_models_and_completions(threaded_fake: Threaded) -> None:
    server, _ = threaded_fake
    client = sync_client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert comp.choices[0].text == fake_completion_text([BOS, *b"hi"], 4)
    assert comp.usage.completion_tokens == 4


def test_chat_plain_n2_and_stop(threaded_fake: Threaded) -> None:
    server, _ = threaded_fake
    client = sync_client(server)
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.role == "assistant"
    full = chat.choices[0].message.content
    assert len(full) == 6 and chat.choices[0].finish_reason == "length"
    stopped = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stop=[full[3:5]])
    assert stopped.choices[0].message.content == full[:full.find(full[3:5])]
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_stream_with_usage(threaded_fake: Threaded) -> None:
    server, _ = threaded_fake
    client = sync_client(server)
    msgs = [{"role": "user", "content": "hello"}]
    expected = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5).choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_errors_map_to_sdk_classes(threaded_fake: Threaded) -> None:
    server, _ = threaded_fake
    client = sync_client(server)
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="nope", prompt="x")
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       stream_options={"include_usage": True})
    assert br.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError) as ctx:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert ctx.value.param == "max_tokens"
    with pytest.raises(openai.AuthenticationError):
        sync_client(server, key="wrong").models.list()


def test_mid_stream_error_raises_api_error(threaded_fake: Threaded) -> None:
    server, _ = threaded_fake
    stream = sync_client(server).completions.create(model=MODEL, prompt="FAIL", max_tokens=10, stream=True)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


async def test_async_client_stream_and_rate_limit() -> None:
    engine = FakeEngine(gate=asyncio.Event())
    config = worker_config(engine=EngineConfig(model=MODEL, max_num_seqs=1), max_queue=0, api_keys=(API_KEY,))
    server = WorkerThread(config, factory_for(engine)).start(ready_timeout=120)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                timeout=30)
    try:
        first = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True)
        consume = asyncio.create_task(_collect_text(first))
        await asyncio.sleep(0.2)  # the first request now holds the only slot
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        server.call(engine.gate.set)
        assert await consume == fake_completion_text([BOS, *b"hi"], 3)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2)
        assert len(chat.choices[0].message.content) == 2
    finally:
        await client.close()
        server.stop()


async def _collect_text(stream: openai.AsyncStream) -> str:
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
