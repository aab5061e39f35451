"""Retries, circuit breaking, admission, client disconnect and auth, against fake workers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from services.router.config import AdmissionConfig, BreakerConfig, Policy, RetryConfig
from tests.support.fake_worker import FakeWorker, Fault, Rendezvous, expected_text

BODY = {"model": "fake-model", "prompt": "retry me", "max_tokens": 4}


async def _complete(mesh, body=BODY, headers=None):
    resp = await mesh.client.post("/v1/completions", json=body, headers=headers or {})
    return resp, await resp.json()


async def test_prefill_failure_retries_on_another_prefill(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("prefill"), FakeWorker("decode")],
                           prefill_policy=Policy.ROUND_ROBIN)
    mesh.workers[0].faults.append(Fault(status=503))
    resp, doc = await _complete(mesh)
    assert resp.status == 200 and doc["choices"][0]["text"] == expected_text(BODY)
    assert len(mesh.workers[0].calls) == 1 and len(mesh.workers[1].calls) == 1
    assert json.loads(resp.headers["x-pdmesh-phases"])["attempts"] == 2
    metrics = await (await mesh.client.get("/metrics")).text()
    assert 'pdmesh:router_retries_total{leg="prefill"} 1.0' in metrics


async def test_decode_failure_before_output_redispatches_with_a_fresh_prefill(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")],
                           decode_policy=Policy.ROUND_ROBIN)
    mesh.workers[1].faults.append(Fault(status=503))
    resp, doc = await _complete(mesh)
    assert resp.status == 200 and doc["choices"][0]["text"] == expected_text(BODY)
    assert len(mesh.workers[0].calls) == 2  # the prefill ran again for the second decode
    assert len(mesh.workers[1].calls) == 1 and len(mesh.workers[2].calls) == 1
    metrics = await (await mesh.client.get("/metrics")).text()
    assert 'pdmesh:router_retries_total{leg="decode"} 1.0' in metrics


async def test_stream_cut_before_any_output_is_retried_when_nothing_was_sent(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")],
                           decode_policy=Policy.ROUND_ROBIN, early_first_token=False)
    mesh.workers[1].faults.append(Fault(cut_after=0))  # headers, then the connection drops
    body = {**BODY, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(mesh.url + "/v1/completions", json=body) as r:
        raw = (await r.read()).decode()
    texts = [json.loads(x[6:])["choices"][0]["text"] for x in raw.split("\n") if x.startswith("data: {")]
    assert "".join(texts) == expected_text(BODY) and raw.rstrip().endswith("[DONE]")
    assert len(mesh.workers[0].calls) == 2
    assert len(mesh.workers[1].calls) == 1 and len(mesh.workers[2].calls) == 1


async def test_decode_failure_after_first_byte_becomes_an_error_event(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mesh.workers[1].faults.append(Fault(cut_after=2))
    body = {**BODY, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(mesh.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    events = [x[6:] for x in raw.split("\n") if x.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert len(mesh.workers[0].calls) == 1  # no retry once the client had bytes


async def test_non_retryable_worker_errors_pass_through_unchanged(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    mesh.workers[0].faults.append(Fault(status=400))
    resp, doc = await _complete(mesh)
    assert resp.status == 400 and doc["error"]["message"] == "injected 400"
    assert len(mesh.workers[0].calls) == 1 and not mesh.workers[1].calls


async def test_retries_stop_at_max_attempts_with_the_worker_error(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")],
                           retry=RetryConfig(max_attempts=2, initial_backoff_s=0.01))
    mesh.workers[0].faults.extend([Fault(status=502), Fault(status=502)])
    resp, doc = await _complete(mesh)
    assert resp.status == 502 and doc["error"]["message"] == "injected 502"
    assert len(mesh.workers[0].calls) == 2


async def test_circuit_breaker_opens_and_traffic_moves_to_healthy_workers(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("prefill"), FakeWorker("decode")],
                           prefill_policy=Policy.ROUND_ROBIN)
    bad = mesh.workers[0]
    bad.faults.extend(Fault(status=500) for _ in range(3))
    for _ in range(6):
        resp, _ = await _complete(mesh)
        assert resp.status == 200
    assert len(bad.calls) == 3  # opened after 3 failures (breaker failures=3 in tests)
    meta = await mesh.metadata()
    states = {w["id"]: w["circuit_breaker"] for w in meta["workers"]}
    assert states == {"prefill-0": "open", "prefill-1": "closed", "decode-0": "closed"}
    metrics = await (await mesh.client.get("/metrics")).text()
    assert 'pdmesh:router_worker_breaker_state{worker="prefill-0"} 2.0' in metrics


async def test_admission_queue_full_is_429_and_timeout_is_503(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill", prefill_delay=0.5), FakeWorker("decode")],
                           admission=AdmissionConfig(max_inflight=1, max_queue=1, timeout_s=0.2))
    first = asyncio.create_task(_complete(mesh))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(_complete(mesh))
    await asyncio.sleep(0.05)
    resp, doc = await _complete(mesh)
    assert resp.status == 429 and doc["error"]["code"] == "queue_full"
    assert resp.headers["x-should-retry"] == "true"
    assert int(resp.headers["Retry-After"]) >= 1  # benchmarks/load.py counts any 429 without it
    resp, doc = await queued
    assert resp.status == 503 and doc["error"]["code"] == "queue_timeout"
    assert resp.headers["x-should-retry"] == "true" and int(resp.headers["Retry-After"]) >= 1
    assert (await first)[0].status == 200


async def _until(predicate, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_client_disconnect_closes_both_legs(make_mesh, mode):
    rv = Rendezvous()
    prefill = FakeWorker("prefill", transfer_mode=mode, rendezvous=rv)
    decode = FakeWorker("decode", transfer_mode=mode, rendezvous=rv, token_delay=0.2)
    mesh = await make_mesh([prefill, decode])
    if mode == "push":
        prefill.faults.append(Fault(hang=True))  # both legs are in flight when the client leaves
    body = {**BODY, "max_tokens": 50, "stream": True}
    async with aiohttp.ClientSession() as s:
        client = asyncio.create_task(s.post(mesh.url + "/v1/completions", json=body))
        await _until(lambda: decode.calls and prefill.calls)  # both legs reached their worker
        await asyncio.sleep(0.1)
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
    await _until(lambda: all(c.finished for w in (prefill, decode) for c in w.calls))
    assert decode.calls[0].aborted
    if mode == "push":
        assert prefill.calls[0].aborted  # the prefill leg was still running: closed too
    else:
        assert not prefill.calls[0].aborted  # it had finished before the decode started
    assert len(prefill.calls) == len(decode.calls) == 1
    metrics = await (await mesh.client.get("/metrics")).text()
    assert "pdmesh:router_client_disconnects_total 1.0" in metrics


async def test_api_key_guards_client_endpoints_only(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")], api_keys=("sk-1",))
    resp, doc = await _complete(mesh)
    assert resp.status == 401 and doc["error"]["code"] == "invalid_api_key"
    resp, _ = await _complete(mesh, headers={"Authorization": "Bearer sk-1"})
    assert resp.status == 200
    for path in ("/health", "/live", "/metrics"):
        assert (await mesh.client.get(path)).status == 200
    assert (await mesh.client.get("/v1/router/metadata")).status == 401


async def test_request_id_is_generated_when_absent(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")])
    resp, _ = await _complete(mesh)
    rid = resp.headers["X-Request-Id"]
    assert rid and mesh.workers[0].calls[0].headers["X-Request-Id"] == rid
    assert mesh.workers[1].calls[0].headers["X-Request-Id"] == rid


async def test_half_open_probe_closes_the_breaker_after_recovery(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("prefill"), FakeWorker("decode")],
                           prefill_policy=Policy.ROUND_ROBIN,
                           breaker=BreakerConfig(failures=2, window_s=10, cooldown_s=0.3, successes=1))
    bad = mesh.workers[0]
    bad.faults.extend([Fault(status=500), Fault(status=500)])
    for _ in range(4):
        assert (await _complete(mesh))[0].status == 200
    assert mesh.state.registry.get("prefill-0").breaker.state.value == "open"
    calls = len(bad.calls)
    await asyncio.sleep(0.35)  # cool-down over: half-open, the next pick may probe it
    for _ in range(3):
        assert (await _complete(mesh))[0].status == 200
    assert len(bad.calls) > calls
    assert mesh.state.registry.get("prefill-0").breaker.state.value == "closed"
