"""Fixtures for the worker tests: a fake-engine app in-loop, and on a thread for sync SDKs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from services.cli import main as pdmesh
from tests.support.fake_engine import FakeEngine
from tests.support.worker import API_KEY, WorkerThread, factory_for, start_client, worker_config


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(fake_engine: FakeEngine) -> AsyncIterator[TestClient]:
    """No API key configured."""
    c = await start_client(worker_config(), fake_engine)
    yield c
    await c.close()


@pytest.fixture
def threaded_fake() -> Iterator[tuple[WorkerThread, FakeEngine]]:
    """A fake-engine worker on a real port with API key `API_KEY`, for the openai SDK."""
    engine = FakeEngine()
    server = WorkerThread(worker_config(api_keys=(API_KEY,)), factory_for(engine))
    server.start(ready_timeout=120)
    yield server, engine
    server.stop()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (SmolLM2 tokenizer), written by `pdmesh make-model`."""
    out = tmp_path_factory.mktemp("tiny") / "llama"
    assert pdmesh(["make-model", str(out), "--preset", "tiny", "--arch", "llama", "--seed", "0"]) == 0
    return out
