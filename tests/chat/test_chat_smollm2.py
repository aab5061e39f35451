"""Agent-client calls on the real SmolLM2-135M-Instruct (fp32, greedy), through the openai SDK
unchanged: tool_choice "required" over two tools gives the same calls streamed (the SDK's own
stream assembly) as not, valid against the chosen tool's schema; and
`chat.completions.parse(response_format=<pydantic model>)` returns a parsed object."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from services.worker.config import WorkerConfig
from services.worker.parsers_config import ParsersConfig
from shared.config import EngineConfig
from tests.support.pd import SMOLLM2
from tests.support.tools import TOOLS
from tests.support.worker import WorkerThread


class Capital(pydantic.BaseModel):
    country: str = pydantic.Field(max_length=30)
    capital: str = pydantic.Field(max_length=30)
    confidence: Literal["low", "high"]


@pytest.fixture(scope="module")
def smol() -> Iterator[WorkerThread]:
    engine = EngineConfig(model=SMOLLM2, dtype="float32", max_model_len=1024,
                          kv_cache_memory_bytes=32 << 20, num_threads=1)
    parsers = ParsersConfig("hermes", enable_auto_tool_choice=True)
    worker = WorkerThread(WorkerConfig(engine=engine, parsers=parsers)).start(ready_timeout=300)
    try:
        yield worker
    finally:
        worker.stop()


def sdk(worker: WorkerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.mark.slow
def test_required_calls_streamed_equal_non_streamed(smol: WorkerThread) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    kwargs: Any = {"model": SMOLLM2, "tools": TOOLS, "tool_choice": "required",
                   "temperature": 0, "max_tokens": 80,
                   "messages": [{"role": "user", "content": "What's the weather in Paris?"}]}
    client = sdk(smol)
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert calls and whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, c.function.arguments)
            for c in streamed.message.tool_calls or []] == calls
    assert streamed.finish_reason == "tool_calls"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.slow
def test_parse_returns_the_pydantic_object(smol: WorkerThread) -> None:
    reply = sdk(smol).chat.completions.parse(
        model=SMOLLM2, response_format=Capital, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital
