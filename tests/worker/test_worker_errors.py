"""Every failure is an OpenAI error envelope with the right status and param; never a 500."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient

from services.worker.app import create_app
from shared.config import EngineConfig
from tests.support.fake_engine import FakeEngine
from tests.support.worker import MODEL, start_client, worker_config

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "x"}]


async def expect_error(resp, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_malformed_and_non_object_bodies(client: TestClient) -> None:
    for raw in (b"{", b"", b"[1, 2]", b"\"text\"", b"null", b"\xff\xfe", b'{"prompt": NaN}'):
        for path in (COMP, CHAT, "/tokenize", "/detokenize"):
            await expect_error(await client.post(path, data=raw), 400)


@pytest.mark.parametrize("path,body,param", [
    (COMP, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMP, {"prompt": "x", "temperature": -1}, "temperature"),
    (COMP, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMP, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMP, {"prompt": "x", "top_k": -2}, "top_k"),
    (COMP, {"prompt": "x", "min_p": 2}, "min_p"),
    (COMP, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMP, {"prompt": "x", "n": 0}, "n"),
    (COMP, {"prompt": "x", "n": 1000}, "n"),
    (COMP, {"prompt": "x", "logprobs": 6}, "logprobs"),
    (COMP, {"prompt": "x", "logprobs": True}, "logprobs"),
    (COMP, {"prompt": "x", "seed": 2**64}, "seed"),
    (COMP, {"prompt": "x", "stop": 5}, "stop"),
    (COMP, {"prompt": "x", "stop_token_ids": [1, "a"]}, "stop_token_ids"),
    (COMP, {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    (COMP, {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMP, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (COMP, {"prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": "yes"}}, "stream_options.continuous_usage_stats"),
    # Checked even where it would be ignored (no include_usage).
    (CHAT, {"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    (COMP, {"prompt": "x", "stream": "yes"}, "stream"),
    (COMP, {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    (COMP, {"prompt": "x", "suffix": "y"}, "suffix"),
    (COMP, {"prompt": "x", "best_of": 2}, "best_of"),  # ranking > n candidates: not supported
    (COMP, {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    (COMP, {"prompt": "x", "best_of": 0}, "best_of"),
    (COMP, {"prompt": "x", "best_of": "2"}, "best_of"),
    (COMP, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"messages": MSG, "prompt_logprobs": 0}, "prompt_logprobs"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, "continue_final_message"),
    (CHAT, {"messages": MSG, "continue_final_message": "yes", "add_generation_prompt": False},
     "continue_final_message"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": MSG, "continue_final_message": True}, "continue_final_message"),
    (COMP, {"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"1": 100.5}}, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"1": "5"}}, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"1": True}}, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"1": 1, "01": 2}}, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"258": 1}}, "logit_bias"),  # past the vocabulary
    (COMP, {"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    (CHAT, {"messages": MSG, "logit_bias": {"1": -101}}, "logit_bias"),
    (COMP, {"prompt": "x", "model": 5}, "model"),
    (COMP, {"prompt": "x", "user": 5}, "user"),
    (CHAT, {"messages": MSG, "user": ["u"]}, "user"),
    (COMP, {}, "prompt"),
    (COMP, {"prompt": []}, "prompt"),
    (COMP, {"prompt": [[]]}, "prompt"),
    (COMP, {"prompt": [1, "a"]}, "prompt"),
    (COMP, {"prompt": [-1]}, "prompt"),
    (COMP, {"prompt": [10**9]}, "prompt"),
    (COMP, {"prompt": {"text": "x"}}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "RAISE"}]}, "messages"),
    (CHAT, {"messages": MSG, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": "many", "max_completion_tokens": 4}, "max_tokens"),
    (CHAT, {"messages": MSG, "tools": []}, "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
async def test_bad_fields_are_400_with_param(client: TestClient, path: str, body: dict, param: str) -> None:
    await expect_error(await client.post(path, json=body), 400, param=param)


async def test_best_of_equal_to_n_and_null_prompt_logprobs_change_nothing(
        client: TestClient) -> None:
    """best_of = n asks for no ranking, and prompt_logprobs: null for none: both are served,
    with the answer the request without them gets (seeded)."""
    base = {"prompt": "x", "max_tokens": 3, "n": 2, "seed": 5, "temperature": 0.8}
    plain = await client.post(COMP, json=base)
    same = await client.post(COMP, json={**base, "best_of": 2, "prompt_logprobs": None})
    assert plain.status == same.status == 200
    texts = [[c["text"] for c in (await r.json())["choices"]] for r in (plain, same)]
    assert texts[0] == texts[1] and len(texts[0]) == 2


async def test_context_length(client: TestClient, fake_engine: FakeEngine) -> None:
    limit = fake_engine.max_model_len
    err = await expect_error(await client.post(COMP, json={"prompt": "x", "max_tokens": limit}), 400,
                             param="max_tokens", code="context_length_exceeded")
    assert str(limit) in err["message"]
    await expect_error(await client.post(COMP, json={"prompt": "x" * limit}), 400, param="prompt")
    await expect_error(await client.post(CHAT, json={"messages": MSG, "max_completion_tokens": limit}),
                       400, param="max_completion_tokens")
    await expect_error(await client.post(CHAT, json={"messages": [{"role": "user", "content": "x" * limit}]}),
                       400, param="messages")
    ok = await client.post(COMP, json={"prompt": [1], "max_tokens": limit - 1})
    assert ok.status == 200


async def test_unknown_model_404(client: TestClient) -> None:
    for path, body in ((COMP, {"prompt": "x"}), (CHAT, {"messages": MSG}), ("/tokenize", {"prompt": "x"})):
        await expect_error(await client.post(path, json={**body, "model": "nope"}), 404,
                           param="model", code="model_not_found")


async def test_unknown_route_and_method(client: TestClient) -> None:
    await expect_error(await client.get("/v1/nothing"), 404)
    await expect_error(await client.get(COMP), 405)


async def test_api_keys() -> None:
    client = await start_client(worker_config(api_keys=("k1", "k2")), FakeEngine())
    try:
        body = {"prompt": "x", "max_tokens": 1}
        await expect_error(await client.post(COMP, json=body), 401, code="invalid_api_key")
        await expect_error(await client.post(COMP, json=body, headers={"Authorization": "Bearer nope"}), 401)
        await expect_error(await client.post(COMP, json=body, headers={"Authorization": "Basic k1"}), 401)
        await expect_error(await client.get("/v1/models"), 401)
        await expect_error(await client.post("/tokenize", json={"prompt": "x"}), 401)
        await expect_error(await client.post("/detokenize", json={"tokens": [1]}), 401)
        for key in ("k1", "k2"):
            resp = await client.post(COMP, json=body, headers={"Authorization": f"Bearer {key}"})
            assert resp.status == 200
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()


async def test_body_too_large_413() -> None:
    client = await start_client(worker_config(max_body_size=2048), FakeEngine())
    try:
        await expect_error(await client.post(COMP, json={"prompt": "x" * 4096}), 413)
    finally:
        await client.close()


async def test_admission_full_429() -> None:
    engine = FakeEngine(gate=asyncio.Event())
    config = worker_config(engine=EngineConfig(model=MODEL, max_num_seqs=2), max_queue=1)
    client = await start_client(config, engine)
    try:
        first = asyncio.create_task(client.post(COMP, json={"prompt": "x", "max_tokens": 1, "n": 2}))
        await asyncio.sleep(0.1)
        await expect_error(await client.post(COMP, json={"prompt": "x", "max_tokens": 1, "n": 2}), 429)
        resp = await client.post(COMP, json={"prompt": "x", "max_tokens": 1, "n": 3})
        await expect_error(resp, 429, code="rate_limit_exceeded")
        assert resp.headers["Retry-After"] == "1"
        engine.gate.set()
        assert (await first).status == 200
        ok = await client.post(COMP, json={"prompt": "x", "max_tokens": 1, "n": 3})
        assert ok.status == 200
    finally:
        await client.close()


class SlowStartEngine(FakeEngine):
    async def start(self) -> None:
        await asyncio.sleep(3600)


async def test_503_until_ready() -> None:
    from aiohttp.test_utils import TestServer

    from tests.support.worker import factory_for

    app = create_app(worker_config(), factory_for(SlowStartEngine()))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        health = await client.get("/health")
        await expect_error(health, 503, code="not_ready")
        await expect_error(await client.post(COMP, json={"prompt": "x"}), 503, code="not_ready")
        await expect_error(await client.get("/v1/models"), 503)
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()


async def test_live_is_independent_of_readiness_and_keys() -> None:
    """/live is the liveness probe: 200 while loading (when /health says 503) and without an API
    key, so a kubelet never restarts a worker that is only slow to load."""
    from aiohttp.test_utils import TestServer

    from tests.support.worker import factory_for

    app = create_app(worker_config(api_keys=("k1",)), factory_for(SlowStartEngine()))
    loading = TestClient(TestServer(app))
    ready = await start_client(worker_config(), FakeEngine())
    await loading.start_server()
    try:
        await expect_error(await loading.get("/health"), 503, code="not_ready")
        for client in (loading, ready):
            resp = await client.get("/live")
            assert resp.status == 200 and await resp.json() == {"status": "alive"}
        assert (await ready.get("/health")).status == 200
    finally:
        await loading.close()
        await ready.close()


async def test_lone_surrogates_are_400_but_escaped_pairs_work(client: TestClient) -> None:
    for raw in (b'{"prompt": "a\\ud800b"}', b'{"prompt": "x", "model": "\\udfff"}',
                b'{"messages": [{"role": "user", "content": "\\ud800"}]}'):
        for path in (COMP, CHAT, "/tokenize"):
            resp = await client.post(path, data=raw)
            assert resp.status == 400, (path, raw, await resp.text())
    emoji = await client.post(COMP, data=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert emoji.status == 200, await emoji.text()
    assert (await emoji.json())["usage"]["prompt_tokens"] == 5  # BOS + 4 UTF-8 bytes
