"""Structured output through a worker's HTTP API (tiny random model, the openai SDK): the
answers validate against their constraint (jsonschema, regex, choice), bad grammars are a 400
naming the field (also for streams, before any byte), and a slow compile is cut off without
blocking the event loop."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from shared.config import EngineConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.structured_spec import InvalidStructuredOutput, StructuredOutputSpec
from tests.support.pd_mesh import MODEL
from tests.support.worker import WorkerThread

PET = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1,
             "maxItems": 2}},
    "required": ["name", "kind", "age", "toys"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Describe a pet."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def sdk(worker: WorkerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)


def test_json_schema_is_enforced_on_a_plain_answer(workers: dict[str, WorkerThread]) -> None:
    """No tools, just response_format: the answer is JSON valid against the schema (vLLM
    #52594 ignored it there)."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET,
                                                       "strict": True}}
    reply = sdk(workers["mixed"]).chat.completions.create(
        model=MODEL, messages=MSG, response_format=fmt, n=4, seed=7, temperature=1.0,
        max_tokens=120)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), PET)


def test_completions_take_vllm_extra_body(workers: dict[str, WorkerThread]) -> None:
    client = sdk(workers["mixed"])
    picked = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=10, n=3,
                                       seed=1, extra_body={"guided_choice": ["red", "blue"]})
    assert {c.text for c in picked.choices} <= {"red", "blue"}
    code = client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", code.choices[0].text)


def test_named_tool_choice_gives_that_tools_arguments(workers: dict[str, WorkerThread]) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = sdk(workers["mixed"]).chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER], tool_choice=choice, n=3, seed=2,
        temperature=1.0, max_tokens=60)
    for c in reply.choices:  # the grammar's JSON, read back into message.tool_calls
        calls = c.message.tool_calls or []
        assert [call.function.name for call in calls] == ["get_weather"]
        assert c.message.content is None and c.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(calls[0].function.arguments),
                            WEATHER["function"]["parameters"])


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema", "nope"),
    ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar",
     "unknown name"),
    ({"guided_json": {"type": "array", "minItems": -1}}, "guided_json", "minItems"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "Only one"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_bad_constraints_are_400_before_anything_streams(
        workers: dict[str, WorkerThread], extra: dict[str, Any], param: str, needle: str,
        stream: bool) -> None:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4, "stream": stream, **extra}
    async with aiohttp.ClientSession() as s, \
            s.post(f"{workers['mixed'].url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 400 and resp.content_type == "application/json"
        error = (await resp.json())["error"]
    assert error["param"] == param and needle in error["message"], error


async def test_a_slow_compile_is_cut_off_without_blocking_the_loop() -> None:
    engine = AsyncEngine(EngineConfig(grammar_compile_timeout_s=0.2))
    release = threading.Event()

    def slow_compile(spec: StructuredOutputSpec) -> None:
        release.wait(5.0)

    engine.engine = SimpleNamespace(check_structured=lambda spec: None,  # type: ignore[assignment]
                                    grammars=SimpleNamespace(compile=slow_compile))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    start = time.monotonic()
    spec = StructuredOutputSpec.json_schema(PET, "guided_json")
    with pytest.raises(InvalidStructuredOutput) as err:
        await engine.compile_grammar(spec)
    elapsed = time.monotonic() - start
    release.set()
    task.cancel()
    await engine.shutdown()
    assert err.value.param == "guided_json" and "within 0.2 s" in str(err.value)
    assert 0.2 <= elapsed < 2.0 and ticks >= 5  # the loop kept running meanwhile
