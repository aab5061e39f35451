"""A worker whose engine failed answers 503 `engine_failed` on /v1/metadata (what the router's
health checker reads), so the router's next health round marks it unhealthy and every request
goes to the other worker: two real workers (tiny model) in process, one with a failure
injected through the runner's test-only fault_hook."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app as create_router
from services.router.config import RouterConfig
from services.router.state import STATE_KEY
from services.worker.app import create_app as create_worker
from services.worker.config import WorkerConfig
from services.worker.routes import RUNTIME_KEY
from shared.config import EngineConfig
from shared.protocol.pd import PHASES_HEADER
from tests.conftest import NAN_TOKEN, ONE_NAN

BOUND_S = 60.0
BODY = {"model": "tiny", "prompt": "route me", "max_tokens": 4, "temperature": 0}


async def wait_status(client: TestClient, path: str, status: int) -> None:
    for _ in range(int(BOUND_S / 0.05)):
        if (await client.get(path)).status == status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never answered {status}")


async def test_router_marks_a_failed_worker_unhealthy_in_one_round(tiny_workers) -> None:
    failing, healthy = tiny_workers
    urls = tuple(str(w.make_url("")).rstrip("/") for w in tiny_workers)
    # One round at start-up, then none on its own during the test: the round below is the
    # "next health interval" after the failure.
    config = RouterConfig(mixed_urls=urls, health_interval_s=3600.0, health_timeout_s=5.0)
    async with TestClient(TestServer(create_router(config), host="127.0.0.1")) as router:
        await wait_status(router, "/health", 200)
        ids = {w["url"]: w["id"] for w in (await (await router.get("/v1/router/metadata"))
                                           .json())["workers"]}
        served = set()
        for _ in range(4):  # precondition: the router does send work to the first worker
            resp = await asyncio.wait_for(router.post("/v1/completions", json=BODY), BOUND_S)
            served.add(json.loads(resp.headers[PHASES_HEADER])["decode_worker"])
        assert ids[urls[0]] in served

        def boom(batch) -> None:
            raise RuntimeError("injected step failure")

        failing.app[RUNTIME_KEY].engine.engine.runner.fault_hook = boom
        resp = await asyncio.wait_for(failing.post("/v1/completions", json=BODY), BOUND_S)
        assert resp.status == 500 and (await resp.json())["error"]["code"] == "engine_failed"

        await router.app[STATE_KEY].rt.checker.check_all()  # one health round
        doc = await (await router.get("/v1/router/metadata")).json()
        by_url = {w["url"]: w for w in doc["workers"]}
        dead, alive = by_url[urls[0]], by_url[urls[1]]
        assert dead["health"] == "unhealthy" and "503" in dead["reason"]
        assert "engine failed" in dead["reason"]
        assert alive["health"] == "healthy"

        for _ in range(6):
            resp = await asyncio.wait_for(router.post("/v1/completions", json=BODY), BOUND_S)
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["usage"]["completion_tokens"] == 4
            phases = json.loads(resp.headers[PHASES_HEADER])
            assert phases["decode_worker"] == alive["id"]
            assert phases["attempts"] == 1  # never tried the failed worker first


async def test_router_routes_around_a_worker_whose_model_went_degraded(make_checkpoint) -> None:
    """NaN logits put a worker in `model_degraded` (its /health is 503); the router reads only
    /v1/metadata, whose `health` says the same, so the next round marks it unhealthy and the
    requests go to the other worker. One embedding row of the first worker is set to NaN in
    place: a prompt holding that token makes its logits NaN, every other prompt is untouched."""
    engine = EngineConfig(model=str(make_checkpoint(**ONE_NAN)), dtype="float32",
                          kv_cache_memory_bytes=8 << 20, num_threads=1, max_model_len=256)
    workers = []
    for _ in range(2):
        config = WorkerConfig(engine=engine, served_model_names=("tiny",),
                              degraded_hold_seconds=600.0)
        client = TestClient(TestServer(create_worker(config), host="127.0.0.1"))
        await client.start_server()
        workers.append(client)
    try:
        for client in workers:
            await wait_status(client, "/health", 200)
        urls = tuple(str(w.make_url("")).rstrip("/") for w in workers)
        config = RouterConfig(mixed_urls=urls, health_interval_s=3600.0, health_timeout_s=5.0)
        async with TestClient(TestServer(create_router(config), host="127.0.0.1")) as router:
            await wait_status(router, "/health", 200)
            model = workers[0].app[RUNTIME_KEY].engine.engine.runner.model
            model.embed_tokens.weight[NAN_TOKEN, 0] = float("nan")
            bad = {**BODY, "prompt": [5, 6, NAN_TOKEN, 8]}
            resp = await asyncio.wait_for(workers[0].post("/v1/completions", json=bad), BOUND_S)
            assert resp.status == 500 and "non-finite" in (await resp.json())["error"]["message"]
            assert (await workers[0].get("/health")).status == 503

            await router.app[STATE_KEY].rt.checker.check_all()  # one health round
            doc = await (await router.get("/v1/router/metadata")).json()
            by_url = {w["url"]: w for w in doc["workers"]}
            degraded, alive = by_url[urls[0]], by_url[urls[1]]
            assert degraded["health"] == "unhealthy" and "model_degraded" in degraded["reason"]
            assert alive["health"] == "healthy"
            for _ in range(4):
                resp = await asyncio.wait_for(router.post("/v1/completions", json=bad), BOUND_S)
                assert resp.status == 200, await resp.text()  # the clean worker's answer
                phases = json.loads(resp.headers[PHASES_HEADER])
                assert phases["decode_worker"] == alive["id"] and phases["attempts"] == 1
    finally:
        for client in workers:
            await client.close()
