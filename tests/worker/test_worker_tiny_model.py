"""End to end with the real engine on a tiny random model (fp32): the HTTP path must give the
offline `LLM.generate` tokens, free KV blocks on disconnect, and speak vllm-bench's dialect."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import dense, mxfp4
from kernels.tier import Tier
from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from shared.kernel_tiers import backend_tier, cpu_tier
from tests.support.strategies import bodies
from tests.support.worker import WorkerThread, start_client

MAX_LEN = 512
KV_BYTES = 16 * 1024 * 1024
PROMPTS = [f"Request {i}: " + f"tell me about the number {i}. " * (1 + i % 5) for i in range(32)]


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[WorkerThread]:
    engine = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=MAX_LEN,
                          kv_cache_memory_bytes=KV_BYTES, max_num_seqs=64)
    srv = WorkerThread(WorkerConfig(engine=engine, served_model_names=("tiny",))).start(ready_timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_dir: Path) -> LLM:
    return LLM(model=str(tiny_dir), dtype="float32", max_model_len=MAX_LEN, kv_cache_memory_bytes=KV_BYTES)


async def stream_token_ids(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    ids: list[int] = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids.extend(choice.get("token_ids", []))
    return ids


async def test_32_concurrent_streams_match_offline(server: WorkerThread, offline: LLM) -> None:
    lengths = [8 + i % 9 for i in range(len(PROMPTS))]
    async with aiohttp.ClientSession() as session:
        got = await asyncio.gather(*(stream_token_ids(session, server.url, p, n)
                                     for p, n in zip(PROMPTS, lengths, strict=True)))
    want = offline.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths])
    for i, (ids, ref) in enumerate(zip(got, want, strict=True)):
        assert ids == ref.outputs[0].token_ids, f"prompt {i} differs"


async def metadata(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/v1/metadata") as resp:
        return await resp.json()


async def abort_count(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("pdmesh:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_disconnect_mid_stream_frees_blocks(server: WorkerThread) -> None:
    url = server.url
    async with aiohttp.ClientSession() as probe:
        aborts_before = await abort_count(probe, url)
        body = {"model": "tiny", "prompt": "x " * 200, "max_tokens": MAX_LEN - 300, "ignore_eos": True,
                "stream": True}
        session = aiohttp.ClientSession()
        resp = await session.post(f"{url}/v1/completions", json=body)
        for _ in range(5):
            await resp.content.readline()
        busy = await metadata(probe, url)
        assert busy["kv_cache"]["num_used_blocks"] > 0 and busy["load"]["num_running"] == 1
        resp.close()  # drop the connection mid-stream
        await session.close()
        deadline = time.monotonic() + 10
        while True:
            meta = await metadata(probe, url)
            # The admission slot is released when the handler unwinds, which may be a moment
            # after the engine freed the blocks: all three must reach zero.
            load = meta["load"]
            if (meta["kv_cache"]["num_used_blocks"] == 0 and load["num_running"] == 0
                    and load["admitted_sequences"] == 0):
                break
            assert time.monotonic() < deadline, f"blocks or admission not freed: {meta}"
            await asyncio.sleep(0.05)
        assert await abort_count(probe, url) == aborts_before + 1


async def test_vllm_bench_dialect(server: WorkerThread, tiny_dir: Path) -> None:
    """What `vllm bench serve` sends: /tokenize, /metrics, then streamed completions with
    ignore_eos, repetition_penalty=1.0 and include_usage."""
    from shared.model.tokenizer import Tokenizer

    url = server.url
    prompt = "The quick brown fox jumps over the lazy dog"
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/tokenize",
                                json={"model": "tiny", "prompt": prompt, "add_special_tokens": False}) as r:
            tok = await r.json()
        assert tok["tokens"] == Tokenizer(tiny_dir).encode(prompt, add_special_tokens=False)
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_LEN
        async with session.get(f"{url}/metrics") as r:
            assert r.status == 200 and "pdmesh:num_requests_running" in await r.text()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                "repetition_penalty": 1.0, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            events = [line[6:].strip() async for line in r.content if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 40
    assert usage["usage"]["prompt_tokens"] == tok["count"]


def test_openai_chat_matches_offline_chat(server: WorkerThread, offline: LLM) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    ref = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == ref.text
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref.text


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, chat=st.booleans())
def test_fuzz_real_model_never_5xx(server: WorkerThread, body: dict, chat: bool) -> None:
    """Arbitrary fields against the real tokenizer, template and engine (short generations)."""
    import urllib.error
    import urllib.request

    base = ({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "hi"})
    payload = {**base, **body, "max_tokens": 2, "max_completion_tokens": 2, "n": 1}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(server.url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    assert status < 500, text


@pytest.mark.parametrize("tier", ["auto", "avx2", "reference"])
async def test_metadata_reports_the_kernel_tier_the_engine_runs(tiny_dir: Path, tier: str) -> None:
    """A bf16 worker (dense kernels in use) built with --kernel-tier: /v1/metadata names the
    CPU's tier, the cap and, per library, what a kernel lookup under that cap resolves to."""
    engine = EngineConfig(model=str(tiny_dir), dtype="bfloat16", max_model_len=MAX_LEN,
                          kv_cache_memory_bytes=KV_BYTES, kernel_tier=tier)
    client = await start_client(WorkerConfig(engine=engine, served_model_names=("tiny",)))
    try:
        kernels = (await (await client.get("/v1/metadata")).json())["kernels"]
    finally:
        await client.close()
    cap = Tier.AVX512_BF16 if tier == "auto" else Tier.parse(tier)
    assert kernels["requested"] == tier and kernels["max_tier"] == cap.label
    assert kernels["cpu_tier"] == cpu_tier().label
    assert kernels["backends"]["dense"] is not None  # a bf16 engine loads kernels.dense
    for name, lib in (("dense", dense), ("mxfp4", mxfp4)):
        if kernels["backends"][name] is None:  # never loaded in this process (mxfp4, here)
            assert lib.build_info(build=False).state == "not_built"
            continue
        backend = str(lib.kernel_path(None).backend)  # the engine's cap is still in force
        assert kernels["backends"][name] == backend
        assert kernels[name] == backend_tier(backend).label
        assert backend_tier(backend) <= min(cap, cpu_tier())


async def test_resumed_request_continues_the_output(server: WorkerThread) -> None:
    """RESUME_FIELD (what the router sends a migrated request with): the prompt plus the ids
    already generated, and a budget reduced by them, give the rest of the same output; a
    request it cannot resume is a 400 naming the field."""
    from shared.protocol.pd import RESUME_FIELD

    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.url}/v1/completions", json=body) as resp:
            full = await resp.json()
        ids = full["choices"][0]["token_ids"]
        for k in (1, 7):
            resumed_body = {**body, "max_tokens": 12 - k, RESUME_FIELD: ids[:k]}
            async with s.post(f"{server.url}/v1/completions", json=resumed_body) as resp:
                assert resp.status == 200, await resp.text()
                rest = await resp.json()
            assert ids[:k] + rest["choices"][0]["token_ids"] == ids
            assert rest["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] + k
        for bad in ({"n": 2}, {"prompt": ["a", "b"]}, {RESUME_FIELD: [10 ** 9]},
                    {RESUME_FIELD: ["x"]}):
            async with s.post(f"{server.url}/v1/completions",
                              json={**body, RESUME_FIELD: ids[:2], **bad}) as resp:
                assert resp.status == 400, bad
                assert (await resp.json())["error"]["param"] == RESUME_FIELD, bad


async def test_metadata_reports_the_weights_and_kv_cache_bytes(server: WorkerThread,
                                                               tiny_dir: Path) -> None:
    from safetensors import safe_open

    async with aiohttp.ClientSession() as session:
        meta = await metadata(session, server.url)
    mem, cfg = meta["memory"], json.loads((tiny_dir / "config.json").read_text())
    # KV: every block holds K and V of every layer, fp32 here, within the configured budget.
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = (cfg["num_hidden_layers"] * 2 * meta["block_size"] * cfg["num_key_value_heads"]
                   * head_dim * 4)
    assert mem["kv_cache_bytes"] == meta["kv_cache"]["num_total_blocks"] * block_bytes <= KV_BYTES
    # Weights: the checkpoint's tensors in fp32 (a tied head counted once), plus the RoPE
    # tables, which are far smaller than one layer.
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if not (cfg.get("tie_word_embeddings") and n == "lm_head.weight")]
        checkpoint = sum(math.prod(f.get_slice(n).get_shape()) for n in names) * 4
    assert checkpoint <= mem["weights_bytes"] < checkpoint * 1.1
