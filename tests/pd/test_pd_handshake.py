"""Compatibility at the worker level: what /v1/metadata publishes, and pairings the KV
handshake (or the leg checks) refuse, each as an OpenAI error to the client, with no block
left behind on either side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from services.common.signing import signed_json
from services.router.config import RouterConfig
from services.router.errors import NoServableGroupError
from services.router.pairing import Decision, Pairing
from services.router.registry import WorkerRegistry
from services.router.workers import WorkerMetadata
from shared.protocol.pd import Role
from tests.support.pd import (
    dispatch_pull,
    dispatch_push,
    metadata,
    post,
    prefill_body,
    settle_to_zero,
)
from tests.support.pd_mesh import MODEL, Mesh, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all

COMPLETIONS = "/v1/completions"
BODY = {"model": MODEL, "prompt": "Pairing check " * 6, "max_tokens": 4, "temperature": 0}
SECRET = b"pd-test-secret-0123456789"


@pytest.fixture(scope="module")
def variants(tiny_model: Path) -> Iterator[dict[str, WorkerThread]]:
    """Decodes that differ from the mesh's prefill in one negotiated or hashed way, and a
    prefill/decode pair that signs its KV requests."""
    configs = {
        "bf16_decode": worker_config(tiny_model, "decode", dtype="bfloat16"),
        "bs32_decode": worker_config(tiny_model, "decode", block_size=32),
        # Same checkpoint and dtypes as the mesh's prefill, weights quantised at load time.
        "mxfp4_decode": worker_config(tiny_model, "decode", quantization="mxfp4"),
        "signed_prefill": worker_config(tiny_model, "prefill", secret=SECRET),
        "signed_decode": worker_config(tiny_model, "decode", secret=SECRET),
    }
    workers = start_workers(configs)
    try:
        yield workers
    finally:
        stop_all(workers)


def assert_envelope(error: dict, status: int, got_status: int) -> None:
    assert got_status == status, error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


async def test_metadata_publishes_hash_factors_mode_and_kv_address(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        pre, dec = await metadata(s, mesh.prefill.url), await metadata(s, mesh.decode.url)
        push, mixed = await metadata(s, mesh.push_prefill.url), await metadata(s, mesh.mixed.url)
        other = await metadata(s, mesh.other_decode.url)
    assert pre["role"] == "prefill" and dec["role"] == "decode"
    assert pre["compat_hash"] == dec["compat_hash"] and len(pre["compat_hash"]) == 64
    assert push["compat_hash"] != pre["compat_hash"]  # the transfer mode is a factor
    assert other["compat_hash"] != dec["compat_hash"]  # so are the weights
    assert (pre["transfer_mode"], push["transfer_mode"]) == ("pull", "push")
    assert pre["compat_factors"]["transfer_mode"] == "pull"
    assert pre["compat_factors"]["weights_fingerprint"] == pre["model"]["fingerprint"]
    assert pre["kv_endpoint"] == {"host": pre["kv_host"], "port": pre["kv_port"], "tls": False}
    assert pre["kv_port"] > 0 and pre["kv_transfer"]["engine_id"] == pre["engine_id"]
    assert mixed["compat_hash"] is None and mixed["transfer_mode"] is None


async def test_kv_metrics_are_on_the_workers_metrics_page(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s, s.get(f"{mesh.decode.url}/metrics") as resp:
        text = await resp.text()
    for name in ("kv_transfer_seconds histogram", "kv_transfer_bytes histogram",
                 "kv_failed_transfers_total counter", "kv_expired_leases_total counter",
                 "kv_held_blocks gauge", "kv_oldest_lease_age_seconds gauge"):
        metric, kind = name.split()
        assert f"# TYPE pdmesh:{metric} {kind}" in text


async def _pull_params(s: aiohttp.ClientSession, prefill_url: str,
                       secret: bytes | None = None) -> dict:
    pre = await post(s, prefill_url + COMPLETIONS, prefill_body(BODY, {"do_remote_decode": True}),
                     secret)
    assert pre.status == 200, pre.body
    return pre.body["kv_transfer_params"]


async def test_pull_decode_refuses_a_push_prefill_at_the_handshake(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        params = await _pull_params(s, mesh.prefill.url)
        push = await metadata(s, mesh.push_prefill.url)
        # Params naming the push prefill's KV service: the pull decode's handshake is refused
        # on the hash, which names the transfer mode as the differing factor.
        aimed = {**params, "remote_host": push["kv_host"], "remote_port": push["kv_port"],
                 "remote_engine_id": push["engine_id"]}
        got = await post(s, mesh.decode.url + COMPLETIONS, {**BODY, "kv_transfer_params": aimed})
        assert_envelope(got.error, 409, got.status)
        assert "transfer_mode" in got.error["message"] and "'push'" in got.error["message"]
        # The real lease is untouched by that, and still serves its own decode.
        ok = await post(s, mesh.decode.url + COMPLETIONS, {**BODY, "kv_transfer_params": params})
        assert ok.status == 200, ok.body
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url, mesh.push_prefill.url)


async def test_push_dispatch_to_a_pull_decode_names_transfer_mode(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        meta = await metadata(s, mesh.push_prefill.url)
        got = await dispatch_push(s, mesh.push_prefill.url, mesh.decode.url, COMPLETIONS, BODY,
                                  meta)
        assert_envelope(got.error, 409, got.status)
        assert got.error["param"] == "kv_transfer_params.transfer_mode"
        assert "transfer_mode 'push'" in got.error["message"]
        await settle_to_zero(s, mesh.push_prefill.url, mesh.decode.url)


async def test_different_weights_are_refused_and_the_prefill_released_at_once(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        got = await dispatch_pull(s, mesh.prefill.url, mesh.other_decode.url, COMPLETIONS, BODY)
        assert_envelope(got.error, 409, got.status)
        assert "weights_fingerprint" in got.error["message"]
        assert got.error["code"] == "kv_incompatible"
        # Release needs no handshake: the 30 s lease is freed now, not when it expires.
        await settle_to_zero(s, mesh.prefill.url, mesh.other_decode.url, timeout=5.0)


async def test_legs_sent_to_the_wrong_role_or_malformed_are_400(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        wrong = await post(s, mesh.decode.url + COMPLETIONS,
                           prefill_body(BODY, {"do_remote_decode": True}))
        assert_envelope(wrong.error, 400, wrong.status)
        assert wrong.error["code"] == "kv_wrong_role"
        for bad in ({"do_remote_prefill": True, "remote_request_id": 3}, [1], {"extra": 1},
                    {"do_remote_prefill": True, "do_remote_decode": True}):
            got = await post(s, mesh.decode.url + COMPLETIONS, {**BODY, "kv_transfer_params": bad})
            assert_envelope(got.error, 400, got.status)
            assert got.error["param"].startswith("kv_transfer_params")
        streamed = await post(s, mesh.prefill.url + COMPLETIONS,
                              {**prefill_body(BODY, {"do_remote_decode": True}), "stream": True})
        assert_envelope(streamed.error, 400, streamed.status)
        n2 = await post(s, mesh.prefill.url + COMPLETIONS,
                        {**prefill_body(BODY, {"do_remote_decode": True}), "n": 2})
        assert_envelope(n2.error, 400, n2.status)
        # A mixed worker has no KV service: it ignores the field, as vLLM without a connector.
        mixed = await post(s, mesh.mixed.url + COMPLETIONS,
                           {**BODY, "kv_transfer_params": {"do_remote_decode": True}})
        assert mixed.status == 200 and "kv_transfer_params" not in mixed.body
        await settle_to_zero(s, mesh.prefill.url, mesh.decode.url)


async def test_other_kv_dtype_is_refused_on_the_hash(mesh: Mesh, variants) -> None:
    async with aiohttp.ClientSession() as s:
        got = await dispatch_pull(s, mesh.prefill.url, variants["bf16_decode"].url, COMPLETIONS,
                                  BODY)
        assert_envelope(got.error, 409, got.status)
        assert "kv_dtype" in got.error["message"] and "'bfloat16'" in got.error["message"]
        await settle_to_zero(s, mesh.prefill.url, variants["bf16_decode"].url, timeout=5.0)


async def test_other_block_size_is_refused_after_the_hash_matched(mesh: Mesh, variants) -> None:
    async with aiohttp.ClientSession() as s:
        pre = await metadata(s, mesh.prefill.url)
        dec = await metadata(s, variants["bs32_decode"].url)
        assert pre["compat_hash"] == dec["compat_hash"]  # block size is negotiated, not hashed
        got = await dispatch_pull(s, mesh.prefill.url, variants["bs32_decode"].url, COMPLETIONS,
                                  BODY)
        assert_envelope(got.error, 409, got.status)
        assert got.error["code"] == "kv_block_size_mismatch"
        assert "block size" in got.error["message"]
        await settle_to_zero(s, mesh.prefill.url, variants["bs32_decode"].url, timeout=5.0)


async def test_kv_requests_are_signed_when_a_secret_is_set(mesh: Mesh, variants) -> None:
    signed_prefill, signed_decode = variants["signed_prefill"].url, variants["signed_decode"].url
    async with aiohttp.ClientSession() as s:
        ok = await dispatch_pull(s, signed_prefill, signed_decode, COMPLETIONS, BODY, SECRET)
        assert ok.status == 200, ok.body
        assert (await metadata(s, signed_prefill))["kv_transfer"]["auth"] is True
        # An unsigned decode is refused by the prefill: a mesh fault (502), not the client's 401.
        params = await _pull_params(s, signed_prefill, SECRET)
        got = await post(s, mesh.decode.url + COMPLETIONS, {**BODY, "kv_transfer_params": params})
        assert_envelope(got.error, 502, got.status)
        assert got.error["code"] == "kv_auth_missing"
        # Its release was refused too (unsigned): the dispatcher lets go of the lease instead.
        async with s.post(signed_prefill + "/v1/kv_transfer/abort",
                          json={"kv_transfer_params": params}) as resp:
            assert await resp.json() == {"released": True}
        await settle_to_zero(s, signed_prefill, signed_decode, mesh.decode.url, timeout=5.0)


async def test_a_signed_prefill_hands_out_kv_only_to_signed_legs(variants) -> None:
    """Regression ("the KV channel is open by default"): with a secret, a prefill leg that
    the mesh's secret did not sign (any local process) gets no lease, and a signed leg
    replayed as is gets none either; nothing is held after either refusal."""
    signed_prefill = variants["signed_prefill"].url
    leg = prefill_body(BODY, {"do_remote_decode": True})
    async with aiohttp.ClientSession() as s:
        unsigned = await post(s, signed_prefill + COMPLETIONS, leg)
        assert_envelope(unsigned.error, 401, unsigned.status)
        assert unsigned.error["code"] == "kv_leg_unsigned"
        data, headers = signed_json(SECRET, COMPLETIONS, leg)
        answers = []
        for _ in range(2):  # the same signed bytes twice: the second is a replay
            async with s.post(signed_prefill + COMPLETIONS, data=data, headers=headers) as r:
                answers.append((r.status, await r.json()))
        (first, lease), (second, replayed) = answers
        assert first == 200 and "kv_transfer_params" in lease, lease
        assert_envelope(replayed["error"], 401, second)
        assert replayed["error"]["code"] == "kv_auth_replayed"
        async with s.post(signed_prefill + "/v1/kv_transfer/abort",
                          json={"kv_transfer_params": lease["kv_transfer_params"]}) as resp:
            assert await resp.json() == {"released": True}
        await settle_to_zero(s, signed_prefill, timeout=5.0)


async def test_a_quantised_decode_is_refused_on_the_hash_naming_the_transform(mesh: Mesh,
                                                                           variants) -> None:
    async with aiohttp.ClientSession() as s:
        pre = await metadata(s, mesh.prefill.url)
        dec = await metadata(s, variants["mxfp4_decode"].url)
        assert pre["compat_factors"]["weight_transforms"] == {"activations": "float",
                                                              "encoder": "none",
                                                              "lm_head": "dense",
                                                              "quantization": "none"}
        assert dec["compat_factors"]["weight_transforms"]["quantization"] == "mxfp4"
        assert dec["compat_factors"]["weight_transforms"]["encoder"] in {"ocp", "mse"}
        assert pre["model"]["fingerprint"] == dec["model"]["fingerprint"]  # one checkpoint
        assert pre["compat_hash"] != dec["compat_hash"]
        # Dispatched anyway (as a router without groups would): the handshake refuses it.
        got = await dispatch_pull(s, mesh.prefill.url, variants["mxfp4_decode"].url,
                                  COMPLETIONS, BODY)
        assert_envelope(got.error, 409, got.status)
        assert got.error["code"] == "kv_incompatible"
        assert "weight_transforms" in got.error["message"]
        assert "'mxfp4'" in got.error["message"]
        await settle_to_zero(s, mesh.prefill.url, variants["mxfp4_decode"].url, timeout=5.0)


async def test_the_router_never_groups_a_quantised_worker_with_a_dense_one(mesh: Mesh,
                                                                          variants) -> None:
    """The router's own registry and pairing, fed the workers' real /v1/metadata."""
    async with aiohttp.ClientSession() as s:
        docs = {name: await metadata(s, url) for name, url in (
            ("prefill", mesh.prefill.url), ("decode", mesh.decode.url),
            ("mxfp4_decode", variants["mxfp4_decode"].url))}
    registry = WorkerRegistry(RouterConfig().breaker)
    pairing = Pairing(registry, RouterConfig())
    registry.add("http://prefill", Role.PREFILL).mark_healthy(WorkerMetadata.parse(docs["prefill"]))
    quantised = registry.add("http://mxfp4-decode", Role.DECODE)
    quantised.mark_healthy(WorkerMetadata.parse(docs["mxfp4_decode"]))
    assert len(registry.groups()) == 2 and not registry.servable_groups()
    with pytest.raises(NoServableGroupError, match="no decode worker"):
        pairing.plan(None, set())
    # A dense decode completes the dense group; the quantised decode stays in its own.
    registry.add("http://decode", Role.DECODE).mark_healthy(WorkerMetadata.parse(docs["decode"]))
    (group,) = registry.servable_groups()
    assert group.compat_hash == docs["prefill"]["compat_hash"]
    assert quantised.id not in group.decode
    for _ in range(8):
        route = pairing.plan(None, set())
        assert route.decision is Decision.PREFILL_DECODE and route.target is not quantised
