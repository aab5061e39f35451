"""Workers killed mid-transfer (real `pdmesh serve` processes, SIGSTOP/SIGKILL).

A stopped process still accepts connections (the kernel queues them), so stopping the prefill
and then sending the decode leg puts the pull in flight for as long as the test wants; the
kill then lands mid-transfer. Runs after the other P/D tests (file order): the first test
kills the decode process, the second the prefill process.
"""

from __future__ import annotations

import asyncio
import re
import signal

import aiohttp

from tests.support.pd import dispatch_pull, post, prefill_body, settle_to_zero
from tests.support.pd_mesh import KILL_LEASE_S, MODEL, Mesh, ProcessPair
from tests.support.worker import SubprocessWorker, wait_ready

COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": "Killing a worker mid-transfer. " * 10, "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}


async def ready(s: aiohttp.ClientSession, worker: SubprocessWorker) -> None:
    try:
        await wait_ready(s, worker.url, alive=lambda: worker.proc.poll() is None)
    except TimeoutError:
        log = worker.log_path.read_text()
        raise AssertionError(f"{worker.url} did not start:\n{log}") from None


async def expired_leases(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(f"{url}/metrics") as resp:
        match = re.search(r"^pdmesh:kv_expired_leases_total (\S+)$", await resp.text(), re.M)
    return float(match.group(1)) if match else 0.0


async def pull_params(s: aiohttp.ClientSession, prefill_url: str) -> dict:
    pre = await post(s, prefill_url + COMPLETIONS, prefill_body(BODY, {"do_remote_decode": True}))
    assert pre.status == 200, pre.body
    return pre.body["kv_transfer_params"]


async def test_decode_killed_mid_transfer_the_prefill_reclaims_its_lease(
        process_pair: ProcessPair) -> None:
    prefill, decode = process_pair.prefill, process_pair.decode
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(ready(s, prefill), ready(s, decode))
        warm = await dispatch_pull(s, prefill.url, decode.url, COMPLETIONS, BODY)
        assert warm.status == 200, warm.body  # and the decode's handshake is cached
        params = await pull_params(s, prefill.url)
        expired = await expired_leases(s, prefill.url)
        prefill.signal(signal.SIGSTOP)
        try:
            leg = asyncio.ensure_future(post(s, decode.url + COMPLETIONS,
                                             {**BODY, "kv_transfer_params": params}))
            await asyncio.sleep(0.5)  # the decode's pull is sent and waits on the prefill
            decode.kill()
            answer = await leg
        finally:
            prefill.signal(signal.SIGCONT)
        assert answer.status == 502 and answer.error["type"] == "server_error"
        # No heartbeat or release will come from the dead decode: the lease expires, is reaped.
        await settle_to_zero(s, prefill.url, timeout=KILL_LEASE_S + 10.0)
        assert await expired_leases(s, prefill.url) == expired + 1


async def test_prefill_killed_mid_transfer_the_decode_fails_closed(
        process_pair: ProcessPair, mesh: Mesh) -> None:
    prefill = process_pair.prefill
    async with aiohttp.ClientSession() as s:
        await ready(s, prefill)
        warm = await dispatch_pull(s, prefill.url, mesh.decode.url, COMPLETIONS, BODY)
        assert warm.status == 200, warm.body
        params = await pull_params(s, prefill.url)
        prefill.signal(signal.SIGSTOP)
        leg = asyncio.ensure_future(post(s, mesh.decode.url + COMPLETIONS,
                                         {**BODY, "kv_transfer_params": params}))
        await asyncio.sleep(0.3)  # the pull is in flight
        prefill.kill()
        answer = await leg
        assert answer.status == 502, answer.body
        assert answer.error["code"] in ("kv_peer_unreachable", "kv_stream_truncated")
        assert answer.error["type"] == "server_error"
        await settle_to_zero(s, mesh.decode.url)
