"""Handshake: the hash first, named factors on rejection, negotiation after, HMAC, caching."""

from __future__ import annotations

import logging

import msgpack
import pytest
from kv_helpers import SECRET, post_raw, small_spec

from services.kv_transfer.errors import ApiError
from services.kv_transfer.pairing import sign
from shared.protocol.codec import seal
from shared.protocol.messages import PullRequest


async def expect_error(coro, status: int) -> ApiError:
    with pytest.raises(ApiError) as err:
        await coro
    assert err.value.status == status, err.value.message
    return err.value


async def test_compatible_pair_handshakes_once_and_is_cached(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    peer = await d.service.ctx.peers.connect(p.address)
    assert peer.engine_id == p.service.identity.node.engine_id
    assert await d.service.ctx.peers.connect(p.address, peer.engine_id) is peer  # cached
    assert len(p.service.ctx.registry) == 1


async def test_push_vs_pull_rejected_with_transfer_mode_named(nodes) -> None:
    p, d = await nodes("prefill", "pull"), await nodes("decode", "push")
    err = await expect_error(d.service.ctx.peers.connect(p.address), 409)
    assert "transfer_mode: local 'pull' vs remote 'push'" in err.message
    assert p.service.identity.compat_hash in err.message
    assert d.service.identity.compat_hash in err.message
    assert err.code == "kv_incompatible" and len(p.service.ctx.registry) == 0


@pytest.mark.parametrize("factor,override,local,remote", [
    ("weights_fingerprint", {"weights_fingerprint": "v" * 64}, "'" + "w" * 64 + "'",
     "'" + "v" * 64 + "'"),
    ("kv_dtype", {"kv_dtype": "float32", "dtype": "bfloat16"}, "'bfloat16'", "'float32'"),
])
async def test_differing_factor_rejected_and_named(nodes, factor, override, local, remote) -> None:
    import torch

    spec = small_spec(**override)
    dtype = torch.float32 if spec.kv_dtype == "float32" else torch.bfloat16
    p, d = await nodes("prefill"), await nodes("decode", spec=spec, dtype=dtype)
    err = await expect_error(d.service.ctx.peers.connect(p.address), 409)
    assert f"{factor}: local {local} vs remote {remote}" in err.message
    assert err.message.count("local") == 2  # hashes + exactly one factor named


async def test_block_size_rejected_after_hash_matched(nodes) -> None:
    p, d = await nodes("prefill", block_size=4), await nodes("decode", block_size=8)
    assert p.service.identity.compat_hash == d.service.identity.compat_hash
    err = await expect_error(d.service.ctx.peers.connect(p.address), 409)
    assert err.code == "kv_block_size_mismatch"
    assert "block size differs: local 4 vs remote 8" in err.message


async def test_same_role_rejected(nodes) -> None:
    p1, p2 = await nodes("prefill"), await nodes("prefill")
    err = await expect_error(p2.service.ctx.peers.connect(p1.address), 409)
    assert err.code == "kv_role_mismatch"


async def test_garbage_after_a_different_hash_is_a_clean_409(nodes) -> None:
    p = await nodes("prefill")
    body = msgpack.packb("f" * 64) + b"\xc1\xff\x00 not msgpack at all"
    status, err = await post_raw(p.url + "/kv/v1/handshake", body)
    assert status == 409 and err["error"]["code"] == "kv_incompatible"
    assert "f" * 64 in err["error"]["message"]
    assert "factors: local <map> vs remote '<unreadable>'" in err["error"]["message"]
    assert set(err["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", [b"", b"\xc1", msgpack.packb(12), b"{json: no}"])
async def test_garbage_without_a_hash_is_a_clean_400(nodes, body: bytes) -> None:
    p = await nodes("prefill")
    status, err = await post_raw(p.url + "/kv/v1/handshake", body)
    assert status == 400 and err["error"]["code"] == "kv_bad_envelope"


async def test_right_hash_wrong_message_is_a_clean_400(nodes) -> None:
    p = await nodes("prefill")
    ident = p.service.identity
    body = seal(ident.compat_hash, ident.factors.to_wire(), PullRequest("e", "r", "l", []))
    status, err = await post_raw(p.url + "/kv/v1/handshake", body)
    assert status == 400 and err["error"]["code"] == "kv_bad_message"


async def test_transfer_without_handshake_is_409(nodes) -> None:
    p = await nodes("prefill")
    ident = p.service.identity
    body = seal(ident.compat_hash, ident.factors.to_wire(), PullRequest("stranger", "r", "l", []))
    status, err = await post_raw(p.url + "/kv/v1/pull", body)
    assert status == 409 and err["error"]["code"] == "kv_handshake_required"


async def test_hmac_required_when_a_secret_is_set(nodes) -> None:
    p = await nodes("prefill", secret=SECRET)
    d_ok = await nodes("decode", secret=SECRET)
    d_bad = await nodes("decode", secret=b"another-secret-of-16+bytes")
    d_none = await nodes("decode")
    assert (await d_ok.service.ctx.peers.connect(p.address)).role == "prefill"
    err = await expect_error(d_bad.service.ctx.peers.connect(p.address), 401)
    assert err.code == "kv_auth_invalid"
    err = await expect_error(d_none.service.ctx.peers.connect(p.address), 401)
    assert err.code == "kv_auth_missing"
    # A valid signature for another path (replay onto another route) is rejected too.
    ident = d_ok.service.identity
    body = seal(ident.compat_hash, ident.factors.to_wire(), ident.node)
    headers = sign(SECRET, "POST", "/kv/v1/release", [body])
    status, err_body = await post_raw(p.url + "/kv/v1/handshake", body, headers)
    assert status == 401 and err_body["error"]["type"] == "invalid_request_error"


async def test_allow_incompatible_pairs_with_a_loud_warning(nodes, caplog) -> None:
    p = await nodes("prefill", allow_incompatible=True)
    d = await nodes("decode", spec=small_spec(weights_fingerprint="v" * 64),
                    allow_incompatible=True)
    with caplog.at_level(logging.WARNING, logger="pdmesh.kv_transfer"):
        await d.service.ctx.peers.connect(p.address)
    warnings = [r.getMessage() for r in caplog.records if "INCOMPATIBLE" in r.getMessage()]
    assert len(warnings) == 2 and all("weights_fingerprint" in w for w in warnings)


async def test_cached_handshake_invalidated_when_engine_id_changes(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    peers = d.service.ctx.peers
    first = await peers.connect(p.address)
    # Params naming another engine at the same address: the peer restarted -> handshake again,
    # and since the live engine is not the one named, the caller gets a clean 502.
    err = await expect_error(peers.connect(p.address, "engine-that-restarted"), 502)
    assert err.code == "kv_peer_restarted"
    assert await peers.connect(p.address, first.engine_id) == first


async def test_info_route_reports_hash_and_factors(nodes) -> None:
    import aiohttp

    from shared.protocol.codec import decode
    from shared.protocol.messages import ServiceInfo

    p = await nodes("prefill", secret=SECRET)
    async with aiohttp.ClientSession() as s, s.get(p.url + "/kv/v1/info") as r:
        info = decode(await r.read(), ServiceInfo)
    assert info.compat_hash == p.service.identity.compat_hash
    assert info.factors["transfer_mode"] == "pull" and info.node.role == "prefill"
