"""HTTP behaviour of the worker against the fake engine: request mapping and response shapes."""

from __future__ import annotations

from aiohttp.test_utils import TestClient

from kernels.tier import max_tier
from shared.config import EngineConfig
from shared.kernel_tiers import backend_tier, cpu_tier
from tests.support.fake_engine import BOS, EOS, FakeEngine, FakeTokenizer, fake_completion_text
from tests.support.worker import MODEL, start_client, worker_config

HI = [BOS, *b"hi"]


async def post(client: TestClient, path: str, body: dict) -> dict:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_completion_basic(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "user": "end-user-7"}  # user: unused
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == fake_completion_text(HI, 5)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_completion_max_tokens_defaults_to_16(client: TestClient) -> None:
    body = await post(client, "/v1/completions", {"prompt": "hi"})
    assert body["usage"]["completion_tokens"] == 16
    assert body["model"] == MODEL  # model is optional: the served name is used


async def test_completion_prompt_shapes(client: TestClient) -> None:
    """String list, token ids, token-id lists; n choices per prompt, index = prompt * n + i."""
    two = await post(client, "/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 3, "n": 2})
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in two["choices"]]
    assert texts == [fake_completion_text(HI, 3)] * 2 + [fake_completion_text([BOS, *b"yo"], 3)] * 2
    assert two["usage"]["prompt_tokens"] == 6  # each prompt counted once, not n times
    assert two["usage"]["completion_tokens"] == 12

    ids = await post(client, "/v1/completions", {"prompt": [104, 105], "max_tokens": 3})
    assert ids["choices"][0]["text"] == fake_completion_text([104, 105], 3)
    lists = await post(client, "/v1/completions", {"prompt": [[104], [105, 106]], "max_tokens": 2})
    assert [c["text"] for c in lists["choices"]] == [fake_completion_text([104], 2),
                                                      fake_completion_text([105, 106], 2)]


async def test_completion_echo_and_token_ids(client: TestClient) -> None:
    body = await post(client, "/v1/completions",
                      {"prompt": "hi", "max_tokens": 3, "echo": True, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["text"] == "hi" + fake_completion_text(HI, 3)
    assert choice["prompt_token_ids"] == HI
    assert [chr(t) for t in choice["token_ids"]] == list(fake_completion_text(HI, 3))


async def test_completion_logprobs_format(client: TestClient) -> None:
    body = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    text = body["choices"][0]["text"]
    assert lp["tokens"] == list(text)
    assert lp["token_logprobs"] == [-0.25] * 4
    assert lp["text_offset"] == [0, 1, 2, 3]
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert token in top and len(top) <= 3  # N alternatives plus the sampled token
        assert top["B"] == -2.0


async def test_stop_strings_and_params_mapping(client: TestClient, fake_engine: FakeEngine) -> None:
    full = fake_completion_text(HI, 8, seed=3)
    stop = full[4:6]
    assert full.find(stop) == 4
    body = await post(client, "/v1/completions", {
        "prompt": "hi", "max_tokens": 8, "stop": stop, "temperature": 0, "top_k": -1, "top_p": 0.5,
        "min_p": 0.1, "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "stop_token_ids": [5], "skip_special_tokens": False,
        "ignore_eos": True, "min_tokens": 1, "unknown_field": {"is": "ignored"}})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == stop
    p = fake_engine.seen_params[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.0, 0, 0.5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.stop, p.stop_token_ids, p.skip_special_tokens, p.ignore_eos, p.min_tokens) == (
        (stop,), (5,), False, True, 1)
    seeded = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "seed": 3})
    assert body["choices"][0]["text"] == seeded["choices"][0]["text"][:4]


async def test_logit_bias_reaches_the_engine_as_pairs(client: TestClient,
                                                      fake_engine: FakeEngine) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        await post(client, path, {**body, "max_tokens": 2,
                                  "logit_bias": {"104": 2.5, "7": -100, "257": 100}})
        assert fake_engine.seen_params[-1].logit_bias == ((7, -100.0), (104, 2.5), (257, 100.0))
    await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {}})
    assert fake_engine.seen_params[-1].logit_bias == ()


async def test_eos_finishes_with_stop(fake_engine: FakeEngine, client: TestClient) -> None:
    fake_engine.eos_at = 2
    body = await post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 8})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    ignore = await post(client, "/v1/completions",
                        {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "return_token_ids": True})
    assert ignore["usage"]["completion_tokens"] == 8
    assert ignore["choices"][0]["token_ids"][2] == EOS


def rendered(messages: list[dict], tools: list | None = None) -> list[int]:
    return FakeTokenizer().encode(FakeTokenizer().apply_chat_template(messages, True, tools), False)


async def test_chat_basic_and_content_parts(client: TestClient) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    body = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    expected_prompt = rendered([{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}])
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": fake_completion_text(expected_prompt, 4)}
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)


async def test_chat_max_completion_tokens_wins(client: TestClient) -> None:
    messages = [{"role": "user", "content": "x"}]
    both = await post(client, "/v1/chat/completions",
                      {"messages": messages, "max_tokens": 2, "max_completion_tokens": 5})
    assert both["usage"]["completion_tokens"] == 5
    legacy = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert legacy["usage"]["completion_tokens"] == 2


async def test_chat_default_max_tokens_fills_context(client: TestClient, fake_engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "x"}]
    body = await post(client, "/v1/chat/completions", {"messages": messages})
    assert body["usage"]["total_tokens"] == fake_engine.max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_logprobs_format(client: TestClient) -> None:
    body = await post(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == -0.25
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    plain = await post(client, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True})
    assert plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


async def test_chat_tools_reach_the_template(client: TestClient) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    # "required": this worker has no --enable-auto-tool-choice for the default "auto".
    body = await post(client, "/v1/chat/completions",
                      {"messages": messages, "tools": tools, "tool_choice": "required", "max_tokens": 1})
    templ_messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""},
                      {"role": "tool", "content": "42"}]
    assert body["usage"]["prompt_tokens"] == len(rendered(templ_messages, tools))
    none = await post(client, "/v1/chat/completions",
                      {"messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 1})
    assert none["usage"]["prompt_tokens"] == len(rendered(templ_messages))


async def test_chat_template_options_reach_the_template(client: TestClient) -> None:
    """continue_final_message and chat_template_kwargs reach the template as they are, in chat
    completions and /tokenize alike (what they render: tests/model/test_tokenizer.py, against
    transformers)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Once"}]
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False, "style": "brief"}}
    want = FakeTokenizer().encode(FakeTokenizer().apply_chat_template(
        messages, False, None, continue_final_message=True, enable_thinking=False,
        style="brief"), False)
    body = await post(client, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "return_token_ids": True, **options})
    assert body["choices"][0]["prompt_token_ids"] == want
    assert (await post(client, "/tokenize", {"messages": messages, **options}))["tokens"] == want
    plain = await post(client, "/tokenize", {"messages": messages})
    assert plain["tokens"] == rendered(messages)


async def test_chat_return_token_ids(client: TestClient) -> None:
    body = await post(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == rendered([{"role": "user", "content": "x"}])
    assert len(choice["token_ids"]) == 2


async def test_models_tokenize_detokenize(client: TestClient, fake_engine: FakeEngine) -> None:
    models = (await client.get("/v1/models"))
    data = (await models.json())["data"]
    assert data[0]["id"] == MODEL and data[0]["object"] == "model"
    assert data[0]["max_model_len"] == fake_engine.max_model_len
    assert {"created", "owned_by"} <= set(data[0])
    tok = await post(client, "/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": False})
    assert tok == {"count": 2, "max_model_len": fake_engine.max_model_len, "tokens": [104, 105]}
    tok_default = await post(client, "/tokenize", {"prompt": "hi"})
    assert tok_default["tokens"] == HI
    chat = await post(client, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert chat["tokens"] == rendered([{"role": "user", "content": "x"}])
    detok = await post(client, "/detokenize", {"model": MODEL, "tokens": [104, 105]})
    assert detok == {"prompt": "hi"}


async def test_one_model_by_name_including_org_slash_names(fake_engine: FakeEngine) -> None:
    """GET /v1/models/{model} gives the list's card for every served name (an `org/name` one
    too: the path keeps its slash) and the OpenAI 404 envelope for any other."""
    client = await start_client(worker_config(served_model_names=(MODEL, "org/name")), fake_engine)
    try:
        listed = (await (await client.get("/v1/models")).json())["data"]
        for card in listed:
            resp = await client.get(f"/v1/models/{card['id']}")
            assert resp.status == 200 and await resp.json() == card
        for unknown in ("nope", "org", "org/name/extra", MODEL + "x"):
            resp = await client.get(f"/v1/models/{unknown}")
            error = (await resp.json())["error"]
            assert resp.status == 404 and (error["code"], error["param"]) == ("model_not_found",
                                                                             "model")
    finally:
        await client.close()


async def test_request_id_echoed_or_generated(client: TestClient) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                             headers={"X-Request-Id": "abc-123"})
    assert resp.headers["X-Request-Id"] == "abc-123"
    resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    generated = resp.headers["X-Request-Id"]
    assert len(generated) == 32
    stream = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True},
                               headers={"X-Request-Id": "s-1"})
    assert stream.headers["X-Request-Id"] == "s-1"
    error = await client.post("/v1/completions", data=b"{", headers={"X-Request-Id": "e-1"})
    assert error.status == 400 and error.headers["X-Request-Id"] == "e-1"


async def test_metadata_kernels_name_the_cpu_tier_cap_and_libraries(
        fake_engine: FakeEngine) -> None:
    config = worker_config(engine=EngineConfig(model=MODEL, kernel_tier="avx2"))
    client = await start_client(config, fake_engine)
    try:
        kernels = (await (await client.get("/v1/metadata")).json())["kernels"]
    finally:
        await client.close()
    assert kernels["requested"] == "avx2"  # the fake engine applies no cap: the process's own
    assert (kernels["cpu_tier"], kernels["max_tier"]) == (cpu_tier().label, max_tier().label)
    for name in ("dense", "mxfp4"):  # None: this test process has not loaded that library
        backend = kernels["backends"][name]
        if backend is None:
            assert kernels[name] is None
            continue
        assert kernels[name] == backend_tier(backend).label
        assert backend_tier(backend) <= min(cpu_tier(), max_tier())


async def test_health_metadata(client: TestClient, fake_engine: FakeEngine) -> None:
    assert (await client.get("/health")).status == 200
    meta = await (await client.get("/v1/metadata")).json()
    assert meta["role"] == "mixed"
    assert meta["engine_id"] == fake_engine.engine_id
    assert meta["model"]["id"] == MODEL and meta["model"]["fingerprint"] == fake_engine.fingerprint
    assert meta["max_model_len"] == fake_engine.max_model_len
    assert meta["block_size"] == fake_engine.block_size
    assert meta["kv_cache"]["num_total_blocks"] == fake_engine.num_total_blocks
    assert meta["kv_cache"]["num_used_blocks"] == 0
    assert meta["load"] == {"num_running": 0, "num_waiting": 0, "admitted_sequences": 0}
    assert meta["dtype"] == "float32"
