"""Fixtures for the chat-output tests: fake-engine workers on real ports (for the openai SDK),
one configured as an agent server (hermes tool calls, auto tool choice, qwen3 reasoning) and one
with no parser at all. The fake engine's `script` makes the "model" write exactly a given text.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from services.worker.parsers_config import ParsersConfig
from tests.support.fake_engine import FakeEngine
from tests.support.worker import WorkerThread, factory_for, worker_config

AGENT_PARSERS = ParsersConfig(tool_call_parser="hermes", reasoning_parser="qwen3",
                              enable_auto_tool_choice=True)


class FakeServer:
    """A fake-engine worker on a thread; `say(text)` scripts what the model writes next."""

    def __init__(self, parsers: ParsersConfig) -> None:
        self.engine = FakeEngine(step_delay=0.0005, max_model_len=4096)  # tools: long prompts
        self.worker = WorkerThread(worker_config(parsers=parsers), factory_for(self.engine))

    def say(self, text: str | None) -> None:
        self.engine.script = text  # between requests: nothing reads it concurrently

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.worker.url}/v1", api_key="unused", max_retries=0,
                             timeout=30)


@pytest.fixture(scope="module")
def agent() -> Iterator[FakeServer]:
    server = FakeServer(AGENT_PARSERS)
    server.worker.start(ready_timeout=60)
    yield server
    server.worker.stop()


@pytest.fixture(scope="module")
def plain() -> Iterator[FakeServer]:
    server = FakeServer(ParsersConfig())
    server.worker.start(ready_timeout=60)
    yield server
    server.worker.stop()
