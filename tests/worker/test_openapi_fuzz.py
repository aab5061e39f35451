"""schemathesis over the published OpenAPI documents: a real worker (tiny random model, role
mixed) and a router in front of it, fuzzed with schema-conforming and schema-violating
requests on every operation.

Checks per response: never a 5xx from bad input (`not_a_server_error`), a status and content
type the document declares, and a body matching the declared schema. Afterwards the worker is
healthy, holds no KV block, and gives the same greedy completion it gave before the fuzzing.
Examples per operation are few (the suite's time budget); the seed is fixed (derandomize) so a
failure reproduces.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.router.app import create_app as create_router
from services.router.config import RouterConfig
from services.router.openapi import router_document
from services.worker.config import WorkerConfig
from services.worker.openapi import worker_document
from shared.config import EngineConfig
from tests.support.pd import settle_to_zero
from tests.support.worker import WorkerThread

MAX_LEN = 96  # bounds the work one fuzzed request can ask for (n x max_tokens)
EXAMPLES = 15  # per operation and generation mode (derandomized: the same cases each run)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
GREEDY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 12,
          "temperature": 0}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Iterator[WorkerThread]:
    engine = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=MAX_LEN,
                          kv_cache_memory_bytes=8 << 20, max_num_seqs=16, num_threads=1)
    srv = WorkerThread(WorkerConfig(engine=engine, served_model_names=("tiny",)))
    yield srv.start(ready_timeout=120)
    srv.stop()


def fuzz(doc: dict[str, Any], base_url: str) -> Counter[int]:
    """Every operation of `doc`, in both generation modes; raises on the first failed check.
    Returns how many responses had each status."""
    statuses: Counter[int] = Counter()
    schema = schemathesis.openapi.from_dict(doc)
    for result in schema.get_all_operations():
        operation = result.ok()
        raw = operation.definition.raw
        takes_input = "requestBody" in raw or "parameters" in raw
        # (an operation without inputs has no schema-violating request to generate)
        modes = [GenerationMode.POSITIVE] + [GenerationMode.NEGATIVE] * takes_input
        for mode in modes:
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def one(case: Any) -> None:
                response = case.call(base_url=base_url, timeout=60)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=CHECKS)

            one()
    return statuses


async def greedy_text(session: aiohttp.ClientSession, url: str) -> list[int]:
    async with session.post(f"{url}/v1/completions",
                            json={**GREEDY, "return_token_ids": True}) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["token_ids"]


async def test_schemathesis_worker_and_router(worker: WorkerThread) -> None:
    async with aiohttp.ClientSession() as session:
        before = await greedy_text(session, worker.url)
        on_worker = await asyncio.to_thread(fuzz, worker_document(), worker.url)

        router = TestServer(create_router(RouterConfig(mixed_urls=(worker.url,),
                                                       health_interval_s=0.2)), host="127.0.0.1")
        await router.start_server()
        try:
            base = str(router.make_url("")).rstrip("/")
            for _ in range(100):
                async with session.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            on_router = await asyncio.to_thread(fuzz, router_document(), base)
        finally:
            await router.close()

        async with session.get(f"{worker.url}/health") as resp:
            assert resp.status == 200, await resp.text()
        await settle_to_zero(session, worker.url)
        assert await greedy_text(session, worker.url) == before
    print(f"schemathesis statuses: worker {dict(on_worker)}, router {dict(on_router)}")
    assert not [s for s in (on_worker + on_router) if s >= 500]
