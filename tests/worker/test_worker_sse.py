"""Server-sent events, checked byte for byte with the aiohttp client."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient

from services.common.json_body import dumps
from tests.support.fake_engine import BOS, FakeTokenizer, fake_completion_text
from tests.support.sse import split_events

HI = [BOS, *b"hi"]


async def stream(client: TestClient, path: str, body: dict) -> tuple[list[dict], list[bytes]]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.read()
    payloads = split_events(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    # Compact JSON, one line per event: re-serialising gives the same bytes.
    assert [dumps(c).encode() for c in chunks] == payloads[:-1]
    return chunks, payloads


async def test_completion_stream_bytes_and_usage(client: TestClient) -> None:
    chunks, _ = await stream(client, "/v1/completions", {
        "prompt": "hi", "max_tokens": 3, "stream_options": {"include_usage": True}})
    expected = fake_completion_text(HI, 3)
    *body, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert all(c["usage"] is None for c in body)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["text"] for c in body] == [*expected, ""]
    assert [c["choices"][0]["finish_reason"] for c in body] == [None, None, None, "length"]


async def test_stream_without_usage_has_null_usage_everywhere(client: TestClient) -> None:
    chunks, _ = await stream(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def continuous_counts(chunks: list[dict]) -> list[int]:
    """The completion_tokens of every chunk with choices, checked: each carries the usage so
    far, its prompt count the final chunk's, its total the sum; the counts never go down and
    end at the final chunk's."""
    *body, last = chunks
    assert last["choices"] == [] and isinstance(last["usage"], dict)
    assert all(len(c["choices"]) == 1 and isinstance(c["usage"], dict) for c in body)
    usages = [c["usage"] for c in body]
    assert all(set(u) == {"prompt_tokens", "completion_tokens", "total_tokens"} for u in usages)
    assert all(u["prompt_tokens"] == last["usage"]["prompt_tokens"] for u in usages)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"]
    return counts


@pytest.mark.parametrize("n", [1, 2])
async def test_continuous_usage_counts_so_far_on_every_chunk(client: TestClient, n: int) -> None:
    """One token per engine output (the fake engine): n=1 counts each chunk's tokens; n=2 the
    request's, both choices summed. The final chunk stays as without the option."""
    base = {"max_tokens": 3, "n": n, "seed": 1, "stream_options": CONTINUOUS}
    chunks, _ = await stream(client, "/v1/completions", {**base, "prompt": "hi"})
    counts = continuous_counts(chunks)
    plain, _ = await stream(client, "/v1/completions", {
        **base, "prompt": "hi", "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == plain[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3 * n, "total_tokens": 3 + 3 * n}
    chat, _ = await stream(client, "/v1/chat/completions", {
        **base, "messages": [{"role": "user", "content": "x"}]})
    chat_counts = continuous_counts(chat)
    if n == 1:
        assert counts == [1, 2, 3, 3]  # the finish chunk repeats the last count
        assert chat_counts == [0, 1, 2, 3, 3]  # the role chunk counts none (as vLLM)
    else:
        assert len(counts) == len(set(counts)) + 2 and counts[-1] == 6  # 2 finish chunks
        assert chat_counts[0] == 0 and chat_counts[-1] == 6


async def test_continuous_usage_without_include_usage_is_ignored(client: TestClient) -> None:
    """As vLLM: continuous_usage_stats alone changes nothing (no usage anywhere)."""
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        chunks, _ = await stream(client, path, {
            **body, "max_tokens": 2, "stream_options": {"continuous_usage_stats": True}})
        assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
        off, _ = await stream(client, path, {**body, "max_tokens": 2, "stream_options": {
            "include_usage": True, "continuous_usage_stats": False}})
        assert all(c["usage"] is None for c in off[:-1]) and off[-1]["choices"] == []


async def test_chat_stream_n2_role_first_per_index(client: TestClient) -> None:
    messages = [{"role": "user", "content": "x"}]
    chunks, _ = await stream(client, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 3, "n": 2, "seed": 1,
        "stream_options": {"include_usage": True}})
    *body, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    prompt = FakeTokenizer().encode(FakeTokenizer().apply_chat_template(messages), False)
    for index in (0, 1):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["delta"] for c in mine[1:])
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert len(text) == 3
        assert all(c["object"] == "chat.completion.chunk" for c in body)
    texts = {"".join(c["choices"][0]["delta"].get("content", "") for c in body if c["choices"][0]["index"] == i)
             for i in (0, 1)}
    assert len(texts) == 2, "n=2 with a seed: each choice has its own derived seed"
    assert fake_completion_text(prompt, 3, seed=1) in texts


async def test_stream_logprobs_and_token_ids(client: TestClient) -> None:
    chunks, _ = await stream(client, "/v1/completions", {
        "prompt": "hi", "max_tokens": 3, "logprobs": 1, "echo": False, "return_token_ids": True})
    content = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"] is None]
    assert content[0]["prompt_token_ids"] == HI
    assert [c["logprobs"]["text_offset"] for c in content] == [[0], [1], [2]]
    assert [chr(c["token_ids"][0]) for c in content] == list(fake_completion_text(HI, 3))
    chat, _ = await stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1})
    entries = [c["choices"][0]["logprobs"] for c in chat if c["choices"][0]["logprobs"]]
    assert len(entries) == 2 and all(len(e["content"]) == 1 for e in entries)


async def test_stream_echo(client: TestClient) -> None:
    chunks, _ = await stream(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hi" + fake_completion_text(HI, 2)


async def test_error_after_stream_started_is_an_event(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 10, "stream": True})
    assert resp.status == 200
    payloads = split_events(await resp.read())
    assert payloads[-1] == b"[DONE]"
    error = json.loads(payloads[-2])
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert len(payloads) == 4  # two tokens, the error, [DONE]


async def test_engine_error_without_stream_is_a_500_envelope(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 10})
    assert resp.status == 500
    body = await resp.json()
    assert body["error"]["type"] == "server_error" and "Traceback" not in json.dumps(body)
