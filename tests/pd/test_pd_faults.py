"""The fault matrix, through the decode's HTTP API, with stale or doctored kv_transfer_params.

Each fault gives the client an OpenAI error envelope with a 4xx/5xx status (never a 200 with
wrong text, never a 500), and afterwards neither side holds a block. Faults that need a worker
process to die are in test_pd_worker_kill.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from tests.support.pd import metadata, post, prefill_body, settle_to_zero
from tests.support.pd_mesh import MODEL, SHORT_LEASE_S, Mesh

COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": "Faults are part of life. " * 8, "max_tokens": 6,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}


async def prefill(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    pre = await post(s, url + COMPLETIONS, prefill_body(BODY, {"do_remote_decode": True}))
    assert pre.status == 200, pre.body
    return pre.body["kv_transfer_params"]


async def decode(s: aiohttp.ClientSession, url: str, params: dict[str, Any]):
    return await post(s, url + COMPLETIONS, {**BODY, "kv_transfer_params": params})


def assert_error(answer, status: int, code: str | None = None) -> None:
    assert answer.status == status, answer.body
    error = answer.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if code is not None:
        assert error["code"] == code, error


def _doctor(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda params: {**params, **changes}


def _bad_digest(params: dict[str, Any]) -> dict[str, Any]:
    digests = list(params["digests"])
    digests[-1] = "0" * len(digests[-1])
    return {**params, "digests": digests}


def _far_blocks(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "block_ids": [10**6 + i for i in range(len(params["block_ids"]))]}


@pytest.mark.parametrize("doctor,status,code", [
    (_doctor(remote_request_id="cmpl-no-such-request-0"), 404, "kv_lease_unknown"),
    (_doctor(lease_id="0123456789abcdef"), 410, "kv_lease_stale"),
    (_far_blocks, 400, "kv_bad_params"),
    (_bad_digest, 502, "kv_digest_mismatch"),
    (_doctor(remote_port=1), 502, "kv_peer_unreachable"),
    (_doctor(num_tokens=3, block_ids=[0], digests=["0" * 32]), 400, "kv_prompt_mismatch"),
    (_doctor(first_token={"token_id": 10**9}), 400, "kv_bad_params"),
], ids=["unknown-request-id", "unknown-lease", "out-of-range-blocks", "digest-mismatch",
        "peer-unreachable", "params-of-another-prompt", "first-token-outside-vocabulary"])
async def test_doctored_params_fail_closed(mesh: Mesh, doctor, status: int, code: str) -> None:
    async with aiohttp.ClientSession() as s:
        params = await prefill(s, mesh.prefill.url)
        got = await decode(s, mesh.decode.url, doctor(params))
        assert_error(got, status, code)
        # Whatever the fault left on the prefill (a lease the doctored params did not name)
        # is consumed by the genuine params, or was released by the failed pull already.
        again = await decode(s, mesh.decode.url, params)
        assert again.status in (200, 410), again.body
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)


async def test_stale_params_reused_after_release_are_gone(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        params = await prefill(s, mesh.prefill.url)
        first = await decode(s, mesh.decode.url, params)
        assert first.status == 200, first.body
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)  # the release has landed
        again = await decode(s, mesh.decode.url, params)
        assert_error(again, 410, "kv_lease_released")
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)


async def test_lease_expired_before_the_pull(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        params = await prefill(s, mesh.short_lease_prefill.url)
        await asyncio.sleep(SHORT_LEASE_S + 0.5)  # no decode heartbeats it: it is reaped
        await settle_to_zero(s, mesh.short_lease_prefill.url)
        got = await decode(s, mesh.decode.url, params)
        assert_error(got, 410, "kv_lease_expired")
        await settle_to_zero(s, mesh.short_lease_prefill.url, mesh.decode.url)


async def test_client_disconnect_during_the_transfer_frees_both_sides(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        params = await prefill(s, mesh.prefill.url)
        mesh.prefill.freeze(1.0)  # the prefill's KV service stalls: the pull is in flight
        task = asyncio.ensure_future(decode(s, mesh.decode.url, params))
        await asyncio.sleep(0.3)
        task.cancel()  # the client goes away mid-transfer
        await asyncio.gather(task, return_exceptions=True)
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)
        # The lease was released (not merely expired): its params are gone now.
        assert_error(await decode(s, mesh.decode.url, params), 410, "kv_lease_released")
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)


async def test_decode_refusing_before_admission_releases_the_prefill(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        params = await prefill(s, mesh.prefill.url)
        got = await post(s, mesh.decode.url + COMPLETIONS,
                         {**BODY, "model": "no-such-model", "kv_transfer_params": params})
        assert_error(got, 404, "model_not_found")
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url, timeout=5.0)


@pytest.mark.parametrize("doctor", [_doctor(remote_port=1), _bad_digest],
                         ids=["peer-unreachable", "digest-mismatch"])
async def test_recompute_policy_answers_correctly_without_remote_kv(mesh: Mesh, doctor) -> None:
    async with aiohttp.ClientSession() as s:
        ref = await post(s, mesh.mixed.url + COMPLETIONS, BODY)
        params = await prefill(s, mesh.prefill.url)
        got = await decode(s, mesh.recompute_decode.url, doctor(params))
        assert got.status == 200, got.body
        assert got.token_ids == ref.token_ids and got.phases["kv_recomputed"] is True
        assert (await decode(s, mesh.decode.url, params)).status in (200, 410)  # consume it
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url, mesh.recompute_decode.url)


async def test_dispatcher_abort_between_the_legs_frees_the_lease_now(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        params = await prefill(s, mesh.prefill.url)
        url = mesh.prefill.url + "/v1/kv_transfer/abort"
        async with s.post(url, json={"kv_transfer_params": params}) as resp:
            assert resp.status == 200 and await resp.json() == {"released": True}
        await settle_to_zero(s, mesh.prefill.url)
        async with s.post(url, json={"kv_transfer_params": params}) as resp:  # harmless again
            assert resp.status == 200 and await resp.json() == {"released": False}
        async with s.post(mesh.decode.url + "/v1/kv_transfer/abort",
                          json={"kv_transfer_params": params}) as resp:  # not issued there
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "kv_not_issued_here"
        assert_error(await decode(s, mesh.decode.url, params), 410, "kv_lease_released")
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)


async def test_push_prefill_failing_early_fails_the_waiting_decode_at_once(mesh: Mesh) -> None:
    """Errors go both ways: the decode does not wait out the push deadline for a prefill leg
    that was refused."""
    async with aiohttp.ClientSession() as s:
        meta = await metadata(s, mesh.push_prefill.url)
        to_d = {"do_remote_prefill": True, "transfer_id": "t-refused-prefill",
                "remote_engine_id": meta["engine_id"], "remote_host": meta["kv_host"],
                "remote_port": meta["kv_port"]}
        start = time.monotonic()
        leg = asyncio.ensure_future(decode(s, mesh.push_decode.url, to_d))
        refused = await post(s, mesh.push_prefill.url + COMPLETIONS, {
            **prefill_body(BODY, {"do_remote_decode": True, "transfer_id": "t-refused-prefill"}),
            "stream": True})  # a prefill leg must not stream: 400 before any work
        assert_error(refused, 400)
        assert_error(await leg, 502, "kv_push_aborted")
        assert time.monotonic() - start < 3.0  # the push deadline is 5 s
        await settle_to_zero(s, mesh.push_prefill.url, mesh.push_decode.url)
