"""Property: no JSON value or shape posted to the generation endpoints yields a 5xx.

Bodies mix the real field names with arbitrary JSON values, plus arbitrary top-level values
and raw bytes. The fake engine (no delay, short context) keeps hundreds of examples fast.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fake_engine import FakeEngine
from tests.support.strategies import bodies, json_values
from tests.support.worker import start_client, worker_config

base = {"/v1/completions": {"prompt": "hi", "max_tokens": 3},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}}


@pytest.fixture
async def fuzz_client() -> AsyncIterator[TestClient]:
    engine = FakeEngine(step_delay=0.0, max_model_len=48)
    client = await start_client(worker_config(), engine)
    yield client
    await client.close()


async def assert_not_5xx(client: TestClient, path: str, **kwargs: object) -> None:
    resp = await client.post(path, **kwargs)
    text = await resp.text()
    assert resp.status < 500, text
    assert "Traceback" not in text
    if resp.status >= 400:
        assert (await resp.json())["error"]["message"]


PATHS = st.sampled_from(sorted(base))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(path=PATHS, body=bodies)
async def test_arbitrary_fields(fuzz_client: TestClient, path: str, body: dict) -> None:
    await assert_not_5xx(fuzz_client, path, json=body)


@FUZZ
@given(path=PATHS, body=bodies)
async def test_valid_base_with_arbitrary_overrides(fuzz_client: TestClient, path: str, body: dict) -> None:
    await assert_not_5xx(fuzz_client, path, json={**base[path], **body})


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=PATHS, value=json_values)
async def test_arbitrary_top_level_json(fuzz_client: TestClient, path: str, value: object) -> None:
    await assert_not_5xx(fuzz_client, path, json=value)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=PATHS, raw=st.binary(max_size=64))
async def test_arbitrary_bytes(fuzz_client: TestClient, path: str, raw: bytes) -> None:
    await assert_not_5xx(fuzz_client, path, data=raw, headers={"Content-Type": "application/json"})
