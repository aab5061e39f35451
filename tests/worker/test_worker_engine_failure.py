"""The real engine behind the worker's HTTP app when things go wrong.

- A padded vocabulary (model rows > tokenizer tokens): prompt ids up to the rows are taken,
  past them a 400 names the id and the limit; generated ids past the tokenizer come back in
  token_ids and usage with no text, equal to the offline engine (itself checked against HF).
- An injected engine failure (the runner's test-only fault_hook): every in-flight request is
  failed at once (streams: an error event, then [DONE]; others: a 500 envelope naming the
  request id), later ones get 503 at once, /health and /v1/metadata answer 503
  `engine_failed`, and the process exits 1 after the drain, logging one traceback.
- NaN weights: a clear per-request 500 (or in-stream error) naming non-finite logits, no
  hang, the failures counted in /metrics, and /health 503 `model_degraded` for the hold (the
  engine itself still runs); one NaN weight fails only the prompts that meet it, and a clean
  request (equal to the clean model offline) brings /health back.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from services.common.lifecycle import LIFECYCLE_KEY, ServiceState
from services.common.runner import serve_until_signalled
from services.router.workers import WorkerMetadata
from services.worker.app import create_app
from services.worker.routes import RUNTIME_KEY
from shared.config import EngineConfig
from shared.engine import LLM, SamplingParams
from shared.engine.engine import NON_FINITE_LOGITS
from shared.engine.scheduler import ScheduledBatch
from shared.model.make_model import VOCAB_SIZE
from tests.conftest import NAN_TOKEN, ONE_NAN
from tests.support.net import free_port
from tests.support.sse import split_events
from tests.support.worker import start_client, wait_ready, worker_config

MODEL = "fake-model"  # the served name worker_config sets
BOUND_S = 60.0  # any hang fails the test instead of stalling the suite
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


def engine_config(ckpt: Path) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20,
                        max_num_seqs=8, num_threads=1, max_model_len=512)


async def real_client(ckpt: Path, **overrides) -> TestClient:
    return await asyncio.wait_for(start_client(worker_config(engine=engine_config(ckpt),
                                                             **overrides)), BOUND_S)


@pytest.fixture
async def tiny_worker(make_checkpoint) -> AsyncIterator[TestClient]:
    client = await real_client(make_checkpoint(preset="tiny", seed=0))
    yield client
    await client.close()


class Fault:
    """fault_hook: raises on every step once armed."""

    armed = False

    def __call__(self, batch: ScheduledBatch) -> None:
        if self.armed:
            raise RuntimeError("injected step failure")


def arm(client: TestClient) -> Fault:
    fault = Fault()
    client.app[RUNTIME_KEY].engine.engine.runner.fault_hook = fault
    return fault


async def error_of(resp: aiohttp.ClientResponse, status: int) -> dict:
    assert resp.status == status, await resp.text()
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---- padded vocabulary ----------------------------------------------------------------------
async def test_padded_vocabulary_over_http(padded_vocab_ckpt: Path) -> None:
    from transformers import AutoTokenizer

    rows = VOCAB_SIZE + 64
    prompt = [VOCAB_SIZE + 3, 17, rows - 1, 42, 504]
    want = LLM(model=str(padded_vocab_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20,
               num_threads=1).generate([prompt], SamplingParams(
                   temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert any(t >= VOCAB_SIZE for t in want.token_ids)  # precondition: unknown ids generated
    hf_tok = AutoTokenizer.from_pretrained(padded_vocab_ckpt)
    client = await real_client(padded_vocab_ckpt)
    try:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True, "echo": True}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        out = await resp.json()
        choice = out["choices"][0]
        assert choice["token_ids"] == want.token_ids and choice["prompt_token_ids"] == prompt
        assert choice["text"] == hf_tok.decode(prompt + want.token_ids, skip_special_tokens=False)
        assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}

        body.update(stream=True, echo=False, stream_options={"include_usage": True})
        resp = await client.post("/v1/completions", json=body)
        events = [json.loads(p) for p in split_events(await resp.read())[:-1]]
        chunks = [c for c in events if c["choices"]]
        assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == want.token_ids
        assert "".join(c["choices"][0]["text"] for c in chunks) == hf_tok.decode(want.token_ids)
        assert events[-1]["usage"]["completion_tokens"] == 24

        resp = await client.post("/detokenize", json={"tokens": [VOCAB_SIZE, 42, rows - 1]})
        assert (await resp.json())["prompt"] == hf_tok.decode([42])
        for bad in ([rows], [5, rows + 7], [-1]):
            resp = await client.post("/v1/completions", json={"prompt": bad, "max_tokens": 2})
            err = await error_of(resp, 400)
            assert err["type"] == "invalid_request_error" and err["param"] == "prompt"
        resp = await client.post("/v1/completions", json={"prompt": [5, rows + 7], "max_tokens": 2})
        message = (await error_of(resp, 400))["message"]
        assert str(rows + 7) in message and str(rows) in message
        assert (await client.get("/health")).status == 200
    finally:
        await client.close()


# ---- an injected engine failure --------------------------------------------------------------
async def read_stream_after_first_chunk(client: TestClient, rid: str,
                                        started: asyncio.Event) -> list[bytes]:
    body = {"model": MODEL, "prompt": f"stream {rid}", "stream": True, **LONG}
    async with client.post("/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
        assert resp.status == 200
        first = await resp.content.readline()
        started.set()
        return split_events(first + await resp.content.read())


async def test_injected_failure_over_http(tiny_worker: TestClient) -> None:
    client = tiny_worker
    runtime, lifecycle = client.app[RUNTIME_KEY], client.app[LIFECYCLE_KEY]
    fault = arm(client)
    started = [asyncio.Event(), asyncio.Event()]
    streams = [asyncio.create_task(read_stream_after_first_chunk(client, f"s-{i}", started[i]))
               for i in range(2)]
    plain = [asyncio.create_task(client.post(
        "/v1/chat/completions", headers={"X-Request-Id": f"p-{i}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], **LONG}))
        for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), BOUND_S)
    while runtime.engine.stats().num_running < 4:  # the plain ones are generating too
        await asyncio.sleep(0.01)
    fault.armed = True

    for i, task in enumerate(streams):
        events = await asyncio.wait_for(task, BOUND_S)
        assert events[-1] == b"[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_failed" and err["type"] == "server_error"
        assert f"s-{i}" in err["message"] and "injected step failure" in err["message"]
    for i, task in enumerate(plain):
        resp = await asyncio.wait_for(task, BOUND_S)
        err = await error_of(resp, 500)
        assert err["code"] == "engine_failed" and f"p-{i}" in err["message"]
        assert resp.headers["X-Request-Id"] == f"p-{i}"

    # From now on: 503 at once everywhere, with the reason; nothing waits on the engine.
    for path, method in (("/health", "get"), ("/v1/metadata", "get"), ("/v1/models", "get")):
        resp = await asyncio.wait_for(getattr(client, method)(path), BOUND_S)
        assert (await error_of(resp, 503))["code"] == "engine_failed", path
    late = await asyncio.wait_for(client.post("/v1/completions", json={
        "model": MODEL, "prompt": "late", "max_tokens": 3}), BOUND_S)
    assert (await error_of(late, 503))["code"] == "engine_failed"
    assert lifecycle.state is ServiceState.FAILED
    # The drain ends as soon as nothing is in flight: the runner may exit.
    await asyncio.wait_for(lifecycle.wait_finished(), BOUND_S)


async def test_engine_failure_ends_the_process_with_status_1(make_checkpoint, caplog) -> None:
    """serve_until_signalled is what `pdmesh serve` runs: it returns the process's exit status."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    app = create_app(worker_config(engine=engine_config(make_checkpoint(preset="tiny", seed=0)),
                                   engine_failure_drain_seconds=30.0))
    server = asyncio.create_task(serve_until_signalled(app, "127.0.0.1", port, 5.0))
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, base, BOUND_S)
        fault = Fault()
        app[RUNTIME_KEY].engine.engine.runner.fault_hook = fault
        body = {"model": MODEL, "prompt": "bye", "stream": True, **LONG}
        with caplog.at_level(logging.INFO):
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                await resp.content.readline()
                fault.armed = True
                raw = await asyncio.wait_for(resp.content.read(), BOUND_S)
            assert raw.endswith(b"data: [DONE]\n\n") and b'"engine_failed"' in raw
            assert await asyncio.wait_for(server, BOUND_S) == 1
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1 and "injected step failure" in str(tracebacks[0].exc_info[1])
    assert any("exits with status 1" in r.getMessage() for r in caplog.records)


# ---- NaN weights ----------------------------------------------------------------------------
def non_finite_count(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("pdmesh:non_finite_logits_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("pdmesh:non_finite_logits_total is not exported")


async def assert_degraded(client: TestClient) -> None:
    health = await client.get("/health")
    err = await error_of(health, 503)
    assert err["code"] == "model_degraded" and "non-finite logits" in err["message"]
    assert int(health.headers["Retry-After"]) >= 1
    # The router reads /v1/metadata only: it says the same, so the router routes around it.
    meta = await (await client.get("/v1/metadata")).json()
    assert meta["health"]["status"] == "model_degraded" and meta["health"]["retry_after_s"] > 0
    assert WorkerMetadata.parse(meta).not_serving == "model_degraded: non-finite logits (NaN or inf)"


async def assert_no_blocks(client: TestClient) -> None:
    meta = await (await client.get("/v1/metadata")).json()
    assert meta["load"]["num_running"] == 0 and meta["kv_cache"]["num_used_blocks"] == 0


async def test_nan_weights_over_http(nan_ckpt: Path) -> None:
    """Regression ("NaN weights answer 200 with garbage"): every request ends with an error
    naming non-finite logits, streaming or not, with no hang; the failures are counted in
    /metrics; /health reports the model degraded; no block is held."""
    client = await real_client(nan_ckpt, degraded_hold_seconds=600.0)
    try:
        assert non_finite_count(await (await client.get("/metrics")).text()) == 0
        sampling = {"model": MODEL, "prompt": "hello", "max_tokens": 16, "temperature": 0.8,
                    "top_p": 0.9, "seed": 7}
        for body in (sampling, {**sampling, "temperature": 0}):  # the engine keeps answering
            resp = await asyncio.wait_for(client.post("/v1/completions", json=body), BOUND_S)
            err = await error_of(resp, 500)
            assert err["code"] == "engine_error" and NON_FINITE_LOGITS in err["message"]
        for path, body in (("/v1/completions", sampling), ("/v1/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4})):
            resp = await asyncio.wait_for(client.post(path, json={**body, "stream": True}),
                                          BOUND_S)
            events = split_events(await resp.read())
            assert events[-1] == b"[DONE]"
            assert NON_FINITE_LOGITS in json.loads(events[-2])["error"]["message"]
        await assert_degraded(client)
        assert non_finite_count(await (await client.get("/metrics")).text()) == 4
        await assert_no_blocks(client)
    finally:
        await client.close()


async def test_one_nan_weight_fails_only_its_requests_and_health_recovers(
        one_nan_ckpt: Path, make_checkpoint) -> None:
    """A prompt holding the NaN token fails (500 / in-stream error); /health says degraded
    until a clean request has been sampled, whose tokens equal the clean model's offline."""
    client = await real_client(one_nan_ckpt, degraded_hold_seconds=600.0)
    try:
        bad = {"model": MODEL, "prompt": [5, 6, NAN_TOKEN, 8], "max_tokens": 6, "temperature": 0}
        resp = await asyncio.wait_for(client.post("/v1/completions", json=bad), BOUND_S)
        assert NON_FINITE_LOGITS in (await error_of(resp, 500))["message"]
        await assert_degraded(client)
        resp = await asyncio.wait_for(client.post("/v1/completions", json={
            **bad, "stream": True}), BOUND_S)
        events = split_events(await resp.read())
        assert events[-1] == b"[DONE]" and NON_FINITE_LOGITS in events[-2].decode()
        await assert_degraded(client)

        good = {**bad, "prompt": [5, 6, 7, 8], "return_token_ids": True}
        resp = await asyncio.wait_for(client.post("/v1/completions", json=good), BOUND_S)
        assert resp.status == 200, await resp.text()
        got = (await resp.json())["choices"][0]["token_ids"]
        clean = LLM(model=str(make_checkpoint(**ONE_NAN)), dtype="float32", num_threads=1,
                    kv_cache_memory_bytes=1 << 20)
        want = clean.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6))
        assert got == want[0].outputs[0].token_ids
        assert (await client.get("/health")).status == 200  # a clean step since
        meta = await (await client.get("/v1/metadata")).json()
        assert meta["health"] == {"status": "ok"} and WorkerMetadata.parse(meta).not_serving is None
        assert non_finite_count(await (await client.get("/metrics")).text()) == 2
        await assert_no_blocks(client)
    finally:
        await client.close()


async def test_degraded_hold_zero_keeps_health_200(one_nan_ckpt: Path) -> None:
    client = await real_client(one_nan_ckpt, degraded_hold_seconds=0.0)
    try:
        bad = {"model": MODEL, "prompt": [NAN_TOKEN, 6], "max_tokens": 3, "temperature": 0}
        resp = await asyncio.wait_for(client.post("/v1/completions", json=bad), BOUND_S)
        await error_of(resp, 500)
        assert (await client.get("/health")).status == 200
    finally:
        await client.close()
