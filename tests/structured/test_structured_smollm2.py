"""Structured output on the real SmolLM2-135M-Instruct (fp32), through the openai SDK: 20
sampled replies to a json_schema (enums, nested objects, arrays with minItems,
additionalProperties false) all validate; tool_choice "required" over two tools gives calls
valid against the chosen tool's schema; and a pull P/D pair gives the mixed worker's tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from services.kv_transfer.config import KVTransferConfig
from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.protocol.pd import Role
from tests.support.pd import SMOLLM2, dispatch_pull, post, settle_to_zero
from tests.support.tools import TOOLS
from tests.support.worker import WorkerThread, start_workers, stop_all

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "genre": {"enum": ["fantasy", "mystery", "science", "history"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "author": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "alive": {"type": "boolean"}},
            "required": ["name", "alive"], "additionalProperties": False},
        "themes": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 2, "maxItems": 3},
    },
    "required": ["title", "genre", "year", "author", "themes"],
    "additionalProperties": False,
}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30},
                                          "confidence": {"enum": ["low", "high"]}},
          "required": ["answer", "confidence"], "additionalProperties": False}


def config(role: str) -> WorkerConfig:
    engine = EngineConfig(model=SMOLLM2, dtype="float32", max_model_len=1024,
                          kv_cache_memory_bytes=64 << 20, num_threads=1)
    kv = None if role == "mixed" else KVTransferConfig(role=role, mode="pull", port=0)
    return WorkerConfig(engine=engine, role=Role(role), kv=kv)


@pytest.fixture(scope="module")
def smol() -> Iterator[dict[str, WorkerThread]]:
    workers = start_workers({r: config(r) for r in ("mixed", "prefill", "decode")}, timeout=300)
    try:
        yield workers
    finally:
        stop_all(workers)


def sdk(worker: WorkerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_twenty_sampled_replies_validate(smol: dict[str, WorkerThread]) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK,
                                                       "strict": True}}
    reply = sdk(smol["mixed"]).chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Describe a book you like."}],
        response_format=fmt, n=20, seed=1234, temperature=1.0, max_tokens=200)
    assert len(reply.choices) == 20
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), BOOK)


@pytest.mark.slow
def test_tool_choice_required_gives_valid_calls(smol: dict[str, WorkerThread]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    reply = sdk(smol["mixed"]).chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=TOOLS, tool_choice="required", n=4, seed=3, temperature=0.7, max_tokens=120)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        calls = choice.message.tool_calls or []
        assert calls and choice.message.content is None
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow
async def test_pd_equals_mixed_with_a_json_schema(smol: dict[str, WorkerThread]) -> None:
    body = {"model": SMOLLM2, "max_tokens": 60, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": ANSWER}}}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, smol["mixed"].url + "/v1/chat/completions", body)
        got = await dispatch_pull(s, smol["prefill"].url, smol["decode"].url,
                                  "/v1/chat/completions", body)
        assert ref.status == got.status == 200, (ref.body, got.body)
        assert got.token_ids == ref.token_ids
        jsonschema.validate(json.loads(got.text), ANSWER)
        await settle_to_zero(s, smol["prefill"].url, smol["decode"].url)
