"""Pull mode: a decode leg that ends without success gets the prefill's lease aborted at once.

Against fake workers, which record every `POST /v1/kv_transfer/abort` body; the real-process
version (held blocks freed on a real prefill) is in fleet/test_router_real_e2e.py.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from services.router.breaker import CircuitBreaker
from services.router.config import BreakerConfig, Policy
from services.router.leases import LeaseReleaser
from services.router.metrics import RouterMetrics
from services.router.upstream import Upstream
from services.router.workers import Worker
from shared.protocol.pd import Role
from tests.support.fake_worker import FakeWorker, Fault
from tests.support.net import free_port

BODY = {"model": "fake-model", "prompt": "lease me", "max_tokens": 4}


async def _until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


def _releases(metrics: RouterMetrics, result: str) -> float | None:
    return metrics.registry.get_sample_value("pdmesh:router_lease_releases_total",
                                             {"result": result})


@pytest.mark.parametrize("stream", [False, True])
async def test_client_gone_between_the_legs_aborts_the_lease(make_mesh, stream):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    mesh = await make_mesh([prefill, decode])
    decode.faults.append(Fault(hang=True))  # the decode leg never answers: the client gives up
    async with aiohttp.ClientSession() as s:
        client = asyncio.create_task(s.post(mesh.url + "/v1/completions",
                                            json={**BODY, "stream": stream}))
        await _until(lambda: decode.calls)  # the prefill answered, the decode leg is out
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
    await _until(lambda: prefill.lease_aborts)
    (abort,) = prefill.lease_aborts
    # Verbatim: exactly the params the decode leg was given, i.e. what the prefill returned.
    assert abort == {"kv_transfer_params": decode.calls[0].body["kv_transfer_params"]}
    assert abort["kv_transfer_params"]["remote_engine_id"] == prefill.engine_id
    await _until(lambda: decode.calls[0].finished is not None)
    assert decode.calls[0].aborted
    await _until(lambda: _releases(mesh.state.metrics, "released") == 1.0)


async def test_failed_decode_aborts_the_lease_before_the_retry(make_mesh):
    prefill = FakeWorker("prefill")
    mesh = await make_mesh([prefill, FakeWorker("decode"), FakeWorker("decode")],
                           decode_policy=Policy.ROUND_ROBIN)
    mesh.workers[1].faults.append(Fault(status=503))
    resp = await mesh.client.post("/v1/completions", json=BODY)
    assert resp.status == 200
    await _until(lambda: prefill.lease_aborts)
    # Only the first attempt's lease: the second decode pulled (and released) its own.
    assert len(prefill.calls) == 2 and len(prefill.lease_aborts) == 1
    first = mesh.workers[1].calls[0].body["kv_transfer_params"]
    assert prefill.lease_aborts[0] == {"kv_transfer_params": first}
    assert first != mesh.workers[2].calls[0].body["kv_transfer_params"]


async def test_successful_requests_abort_nothing(make_mesh):
    prefill = FakeWorker("prefill")
    mesh = await make_mesh([prefill, FakeWorker("decode")])
    for stream in (False, True):
        resp = await mesh.client.post("/v1/completions", json={**BODY, "stream": stream})
        assert resp.status == 200
        await resp.read()
    await asyncio.sleep(0.1)  # a (wrong) background abort would have landed by now
    assert prefill.lease_aborts == []
    assert all(_releases(mesh.state.metrics, r) is None for r in ("released", "failed"))


async def test_an_unreachable_prefill_is_counted_not_raised():
    metrics = RouterMetrics()
    async with aiohttp.ClientSession() as session:
        releaser = LeaseReleaser(Upstream(session, None), metrics)
        gone = Worker(id="prefill-0", url=f"http://127.0.0.1:{free_port()}",
                      declared_role=Role.PREFILL, breaker=CircuitBreaker(BreakerConfig()))
        releaser.release(gone, {"lease_id": "l"}, "req-1")
        assert releaser.pending == 1
        await releaser.close(timeout_s=5.0)
        assert releaser.pending == 0
    assert _releases(metrics, "failed") == 1.0
