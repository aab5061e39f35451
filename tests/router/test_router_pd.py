"""P/D orchestration through the router against fake workers (non-streamed responses)."""

from __future__ import annotations

import json

import pytest

from services.router.config import Policy
from tests.support.fake_worker import FakeWorker, Rendezvous, expected_text


async def _post(mesh, path, body, headers=None):
    resp = await mesh.client.post(path, json=body, headers=headers or {})
    return resp, await resp.json()


async def test_pull_completion_equals_mixed_output_and_rewrites_legs(make_mesh):
    pd = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mixed = await make_mesh([FakeWorker("mixed")])
    body = {"model": "fake-model", "prompt": "the quick brown fox jumps", "max_tokens": 6,
            "min_tokens": 2, "stream": False}
    resp, doc = await _post(pd, "/v1/completions", body, {"X-Request-Id": "req-123"})
    _, ref = await _post(mixed, "/v1/completions", body)
    assert resp.status == 200
    assert doc["choices"][0]["text"] == ref["choices"][0]["text"] == expected_text(body)
    assert "kv_transfer_params" not in doc
    assert resp.headers["X-Request-Id"] == "req-123"

    (pcall,) = pd.role("prefill")[0].calls
    (dcall,) = pd.role("decode")[0].calls
    assert pcall.body["max_tokens"] == 1 and pcall.body["stream"] is False
    assert "min_tokens" not in pcall.body and "max_completion_tokens" not in pcall.body
    assert pcall.body["kv_transfer_params"]["do_remote_decode"] is True
    returned = pd.role("prefill")[0].engine_id
    assert dcall.body == {**body, "kv_transfer_params": dcall.body["kv_transfer_params"]}
    assert dcall.body["kv_transfer_params"]["remote_engine_id"] == returned
    assert pcall.headers["X-Request-Id"] == dcall.headers["X-Request-Id"] == "req-123"


async def test_chat_prefill_leg_caps_max_completion_tokens(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}],
            "max_completion_tokens": 5, "min_completion_tokens": 1}
    resp, doc = await _post(mesh, "/v1/chat/completions", body)
    assert resp.status == 200
    pbody = mesh.role("prefill")[0].calls[0].body
    assert pbody["max_completion_tokens"] == 1 and pbody["max_tokens"] == 1
    assert "min_completion_tokens" not in pbody
    assert mesh.role("decode")[0].calls[0].body["max_completion_tokens"] == 5
    assert doc["choices"][0]["message"]["content"] == expected_text({**body, "max_tokens": 5})


async def test_cached_tokens_come_from_the_prefill_and_phases_header(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    body = {"model": "fake-model", "prompt": "a b c d e f g h i", "max_tokens": 3}
    _, first = await _post(mesh, "/v1/completions", body)
    resp, second = await _post(mesh, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 8  # 2 blocks of 4
    phases = json.loads(resp.headers["x-pdmesh-phases"])
    assert phases["decision"] == "prefill_decode" and phases["attempts"] == 1
    assert phases["prefill_worker"] == "prefill-0" and phases["decode_worker"] == "decode-0"
    assert phases["kv_transfer_ms"] == 1.5  # reported by the decode, merged unchanged
    for key in ("queue_ms", "prefill_ms", "first_token_ms", "decode_ms", "total_ms"):
        assert phases[key] >= 0
    assert phases["prefill_ms"] <= phases["first_token_ms"] <= phases["total_ms"]


async def test_push_mode_dispatches_both_legs_concurrently_with_one_transfer_id(make_mesh):
    rv = Rendezvous()
    prefill = FakeWorker("prefill", transfer_mode="push", compat_hash="h-push", rendezvous=rv,
                         prefill_delay=0.2)
    decode = FakeWorker("decode", transfer_mode="push", compat_hash="h-push", rendezvous=rv)
    mesh = await make_mesh([prefill, decode])
    body = {"model": "fake-model", "prompt": "push me please", "max_tokens": 4}
    resp, doc = await _post(mesh, "/v1/completions", body)
    assert resp.status == 200 and doc["choices"][0]["text"] == expected_text(body)
    pp, dp = prefill.calls[0], decode.calls[0]
    tid = pp.body["kv_transfer_params"]["transfer_id"]
    assert tid and dp.body["kv_transfer_params"]["transfer_id"] == tid
    assert dp.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert dp.body["kv_transfer_params"]["remote_engine_id"] == prefill.engine_id
    assert pp.body["kv_transfer_params"]["do_remote_decode"] is True
    assert dp.body["kv_transfer_params"]["remote_port"] == prefill.metadata()["kv_endpoint"]["port"]
    assert dp.started < pp.finished  # the decode leg went out while the prefill was running


async def test_short_prompts_skip_the_prefill_and_decisions_are_counted(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")], disagg_min_tokens=5,
                           prefill_policy=Policy.ROUND_ROBIN)
    short = {"model": "fake-model", "prompt": "one two", "max_tokens": 3}
    long = {"model": "fake-model", "prompt": "one two three four five six", "max_tokens": 3}
    for body in (short, long, short):
        resp, doc = await _post(mesh, "/v1/completions", body)
        assert resp.status == 200 and doc["choices"][0]["text"] == expected_text(body)
    assert len(mesh.role("prefill")[0].calls) == 1
    assert len(mesh.role("decode")[0].calls) == 3
    metrics = await (await mesh.client.get("/metrics")).text()
    assert 'pdmesh:disagg_decision_total{decision="decode_only"} 2.0' in metrics
    assert 'pdmesh:disagg_decision_total{decision="prefill_decode"} 1.0' in metrics


async def test_mixed_only_group_serves_locally(make_mesh):
    mesh = await make_mesh([FakeWorker("mixed")])
    body = {"model": "fake-model", "prompt": "solo", "max_tokens": 2}
    resp, doc = await _post(mesh, "/v1/completions", body)
    assert resp.status == 200 and doc["choices"][0]["text"] == expected_text(body)
    assert json.loads(resp.headers["x-pdmesh-phases"])["decision"] == "mixed"


async def test_models_tokenize_detokenize_are_proxied(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    resp, models = await _post(mesh, "/tokenize", {"model": "fake-model", "prompt": "a b"})
    assert resp.status == 200 and models["count"] == 2
    resp, doc = await _post(mesh, "/detokenize", {"model": "fake-model", "tokens": [1, 2]})
    assert resp.status == 200 and doc["prompt"] == "1 2"
    resp = await mesh.client.get("/v1/models")
    assert (await resp.json())["data"][0]["id"] == "fake-model"
    resp = await mesh.client.get("/v1/models/fake-model")
    assert resp.status == 200 and (await resp.json())["id"] == "fake-model"
    resp = await mesh.client.get("/v1/models/no-such-model")  # the worker's 404, as it is
    doc = await resp.json()
    assert resp.status == 404 and doc["error"]["code"] == "model_not_found"


async def test_stream_options_without_stream_is_rejected_before_any_leg(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    body = {"model": "fake-model", "prompt": "x", "stream_options": {"include_usage": True}}
    resp, doc = await _post(mesh, "/v1/completions", body)
    assert resp.status == 400 and doc["error"]["param"] == "stream_options"
    assert not mesh.role("prefill")[0].calls


@pytest.mark.parametrize("member", ["include_usage", "continuous_usage_stats"])
async def test_a_non_boolean_stream_option_is_a_400_before_any_leg(make_mesh, member):
    """The prefill leg drops stream_options, and the router's early chunks follow them: a
    malformed one is refused before the first token could go out (never a 200 ending in an
    error event from the decode)."""
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    body = {"model": "fake-model", "prompt": "x", "stream": True,
            "stream_options": {"include_usage": True, member: "yes"}}
    resp, doc = await _post(mesh, "/v1/completions", body)
    assert resp.status == 400 and set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["param"] == f"stream_options.{member}"
    assert not mesh.role("prefill")[0].calls and not mesh.role("decode")[0].calls


async def test_prefix_aware_prefill_policy_follows_the_prefix_until_overloaded(make_mesh):
    p0, p1 = FakeWorker("prefill"), FakeWorker("prefill")
    mesh = await make_mesh([p0, p1, FakeWorker("decode")], prefill_policy=Policy.PREFIX_AWARE)
    shared = " ".join(f"s{i}" for i in range(12))  # 3 blocks of 4 tokens (fake tokenizer)

    async def prefill_of(prompt: str) -> FakeWorker:
        before = len(p0.calls)
        resp, _ = await _post(mesh, "/v1/completions",
                              {"model": "fake-model", "prompt": prompt, "max_tokens": 2})
        assert resp.status == 200
        return p0 if len(p0.calls) > before else p1

    assert await prefill_of(shared + " first") is p0  # nothing cached anywhere: least loaded
    p0.running = 3  # busier, but within the overload margin
    await mesh.health_round()
    assert await prefill_of(shared + " second") is p0  # the prefix holder wins
    assert await prefill_of("an unrelated prompt of a few words") is p1  # no prefix: load
    p0.running = 30
    await mesh.health_round()
    assert await prefill_of(shared + " third") is p1  # the holder is overloaded
