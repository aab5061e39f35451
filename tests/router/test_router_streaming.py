"""Streaming through the router with the openai SDK, against fake P/D workers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai

from tests.support.fake_worker import (
    FakeWorker,
    Rendezvous,
    expected_text,
    prompt_words,
    token_texts,
)
from tests.support.sse import split_events


def _sdk(mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0)


async def _chat_text(mesh, messages, **kw) -> tuple[str, list]:
    async with _sdk(mesh) as client:
        stream = await client.chat.completions.create(model="fake-model", messages=messages,
                                                      stream=True, **kw)
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


async def test_chat_stream_equals_mixed_worker_and_ends_with_usage(make_mesh):
    pd = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mixed = await make_mesh([FakeWorker("mixed")])
    messages = [{"role": "user", "content": "tell me a story"}]
    opts = {"max_tokens": 7, "stream_options": {"include_usage": True}}
    text, chunks = await _chat_text(pd, messages, **opts)
    ref, _ = await _chat_text(mixed, messages, **opts)
    assert text == ref == expected_text({"messages": messages, "max_tokens": 7})
    assert len({c.id for c in chunks}) == 1  # one completion id across prefill and decode chunks
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]  # the decode's role delta is not repeated
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 7
    assert usage.usage.prompt_tokens_details.cached_tokens == 0  # the prefill's, not the decode's
    phases = usage.usage.model_extra["pdmesh"]
    assert phases["decision"] == "prefill_decode" and phases["kv_transfer_ms"] == 1.5
    assert phases["first_token_ms"] <= phases["total_ms"]


async def test_completions_stream_equals_mixed_worker(make_mesh):
    pd = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mixed = await make_mesh([FakeWorker("mixed")])
    outs = []
    for mesh in (pd, mixed):
        async with _sdk(mesh) as client:
            stream = await client.completions.create(model="fake-model", prompt="once upon",
                                                     max_tokens=5, stream=True)
            outs.append("".join([c.choices[0].text async for c in stream]))
    assert outs[0] == outs[1] == expected_text({"prompt": "once upon", "max_tokens": 5})


async def _chunks(mesh, path: str, body: dict) -> list[dict]:
    resp = await mesh.client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return [json.loads(p) for p in split_events(await resp.read())[:-1]]


async def test_continuous_usage_through_pd_equals_mixed_worker(make_mesh):
    """The router's early chunks (the prefill's first token, and the role for chat) carry the
    usage the mixed worker's chunks carry; the decode's copies of them are dropped, its later
    chunks relayed as they are (no phases or cached tokens on them: those stay on the final
    chunk)."""
    pd = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mixed = await make_mesh([FakeWorker("mixed")])
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}]}),
                       ("/v1/completions", {"prompt": "once upon a time"})):
        request = {**body, "model": "fake-model", "max_tokens": 4, "stream": True,
                   "stream_options": options}
        got, want = await _chunks(pd, path, request), await _chunks(mixed, path, request)
        assert [(c["choices"], c["usage"]) for c in got[:-1]] == [
            (c["choices"], c["usage"]) for c in want[:-1]]
        counts = [c["usage"]["completion_tokens"] for c in got[:-1]]
        assert counts == ([0] if "messages" in body else []) + [1, 2, 3, 4]
        prompt = len(prompt_words(body))
        assert all(c["usage"]["prompt_tokens"] == prompt for c in got)
        assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 4
        assert got[-1]["usage"]["pdmesh"]["decision"] == "prefill_decode"
        # Sent early: the stream has the prefill's id (p<n>) throughout, the decode's renamed.
        assert len({c["id"] for c in got}) == 1 and got[0]["id"].startswith("p")


async def test_first_token_reaches_the_client_before_the_decode_streams(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    gate = asyncio.Event()
    mesh.role("decode")[0].decode_gate = gate
    body = {"model": "fake-model", "prompt": "early bird", "max_tokens": 4, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(mesh.url + "/v1/completions", json=body) as resp:
            first = json.loads((await resp.content.readline())[len(b"data: "):])
            assert first["choices"][0]["text"] == token_texts(body, 1)[0]
            assert json.loads(resp.headers["x-pdmesh-phases"])["prefill_ms"] > 0
            gate.set()  # only now may the decode produce anything
            rest = (await resp.read()).decode()
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in rest.split("\n")
             if line.startswith("data: {")]
    assert first["choices"][0]["text"] + "".join(texts) == expected_text(body)
    assert rest.rstrip().endswith("data: [DONE]")


async def test_push_stream_through_sdk(make_mesh):
    rv = Rendezvous()
    mesh = await make_mesh([
        FakeWorker("prefill", transfer_mode="push", compat_hash="p", rendezvous=rv, prefill_delay=0.05),
        FakeWorker("decode", transfer_mode="push", compat_hash="p", rendezvous=rv)])
    messages = [{"role": "user", "content": "push stream"}]
    text, _ = await _chat_text(mesh, messages, max_tokens=6)
    assert text == expected_text({"messages": messages, "max_tokens": 6})


async def test_stop_strings_disable_the_early_token_but_not_the_result(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    messages = [{"role": "user", "content": "with stops"}]
    text, chunks = await _chat_text(mesh, messages, max_tokens=4, stop=["zzz"])
    assert text == expected_text({"messages": messages, "max_tokens": 4})
    assert chunks[0].id.startswith("cmpl-decode")  # everything came from the decode stream
