"""Handshake: the hash first, named factors on rejection, negotiation after, HMAC, caching."""

from __future__ import annotations

import logging

import msgpack
import pytest

from services.common.errors import ApiError, ConflictError
from services.kv_transfer.handshake import KVIdentity, check_layer_coverage, layer_coverage, sign
from services.kv_transfer.pull import PullTransfer
from shared.protocol.codec import KV_PROTOCOL_VERSION, seal, to_fields
from shared.protocol.compat import CompatFactors
from shared.protocol.messages import NodeInfo, PullRequest
from tests.support.kv import SECRET, post_raw, small_spec


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


# ---- pipeline layout: per-stage layer ranges, negotiated after the hash ----------------------


def node_info(role: str, ranges: list[list[int]], *, span: tuple[int, int] = (0, 4),
              pp_size: int | None = None, engine_id: str = "peer-e") -> NodeInfo:
    return NodeInfo(engine_id, role, "pull", 4, 64, span[0], span[1],
                    pp_size or len(ranges), "127.0.0.1", 1,
                    tuple(tuple(r) for r in ranges))


async def test_pp_prefill_pairs_with_a_pp1_decode_and_declares_its_stages(nodes) -> None:
    p, d = await nodes("prefill", pp_size=2), await nodes("decode")
    one_stage = await nodes("prefill")
    # Pipeline size is negotiated, not hashed: a PP=2 and a PP=1 prefill pair alike.
    assert p.service.identity.compat_hash == one_stage.service.identity.compat_hash
    assert p.service.identity.compat_hash == d.service.identity.compat_hash
    peer = await d.service.ctx.peers.connect(p.address)  # the handshake reply declares them
    assert peer.stage_ranges == ((0, 2), (2, 4)) and peer.pp_size == 2
    assert d.service.identity.node.stage_ranges == ((0, 4),)
    assert len(p.service.ctx.registry) == 1  # and the prefill accepted the decode's one range


@pytest.mark.parametrize("ranges,named", [
    ([[0, 1], [2, 4]], ": missing layers 1."),
    ([[0, 3], [2, 4]], ": layers served by more than one stage 2."),
    ([[0, 2], [2, 6]], ": layers outside the model's span 4-5."),
    ([[0, 2]], ": missing layers 2-3."),
    ([[1, 2], [2, 4]], ": missing layers 0."),
])
@pytest.mark.parametrize("server_role", ["prefill", "decode"])
async def test_declared_ranges_that_do_not_tile_get_a_clean_409(nodes, ranges, named,
                                                                server_role) -> None:
    server = await nodes(server_role)
    ident = server.service.identity
    peer_role = "decode" if server_role == "prefill" else "prefill"
    end = max(b for _, b in ranges)
    body = seal(ident.compat_hash, ident.factors.to_wire(),
                node_info(peer_role, ranges, span=(min(a for a, _ in ranges), end)))
    status, err = await post_raw(server.url + "/kv/v1/handshake", body)
    assert status == 409, err
    assert err["error"]["code"] == "kv_layer_coverage"
    assert err["error"]["param"] == "layer_ranges"
    message = err["error"]["message"]
    assert named in message and str(ranges) in message and "[0, 4)" in message
    assert len(server.service.ctx.registry) == 0


def test_a_decode_rejects_a_prefill_whose_stages_leave_a_gap() -> None:
    """The client side (pull: the decode checks the prefill's reply) runs the same check."""
    decode = node_info("decode", [[0, 4]], engine_id="d")
    check_layer_coverage(decode, node_info("prefill", [[0, 2], [2, 4]]))
    check_layer_coverage(decode, node_info("prefill", [[0, 1], [1, 3], [3, 4]]))
    with pytest.raises(ConflictError) as err:
        check_layer_coverage(decode, node_info("prefill", [[0, 1], [3, 4]]))
    assert err.value.status == 409 and "missing layers 1-2" in err.value.message
    with pytest.raises(ConflictError) as err:  # ranges fine, but the peer claims other layers
        check_layer_coverage(decode, node_info("prefill", [[0, 2], [2, 4]], span=(0, 3)))
    assert "claims to hold [0, 3)" in err.value.message


def test_coverage_is_computed_on_intervals() -> None:
    cov = layer_coverage([(2, 30), (0, 2), (0, 10**12)], 0, 30)
    assert cov.overlapping == ((0, 30),) and cov.outside == ((30, 10**12),) and not cov.missing
    assert layer_coverage([(15, 30), (0, 15)], 0, 30).exact  # any order


@pytest.mark.parametrize("ranges,pp_size", [
    ([[3, 1], [1, 4]], 2), ([[0, 1, 2], [2, 4]], 2), ([[0, 2], [2, 4]], 3), ([[-1, 4]], 1),
])
async def test_malformed_ranges_are_a_clean_400(nodes, ranges, pp_size) -> None:
    p = await nodes("prefill")
    ident = p.service.identity
    node = to_fields(node_info("decode", [[0, 4]]))
    node.update(layer_ranges=ranges, pp_size=pp_size)
    message = msgpack.packb({"t": NodeInfo.TAG, "b": node})  # what a buggy peer might send
    body = b"".join(msgpack.packb(part) for part in (
        ident.compat_hash, KV_PROTOCOL_VERSION, ident.factors.to_wire(), message))
    status, err = await post_raw(p.url + "/kv/v1/handshake", body)
    assert status == 400 and err["error"]["code"] == "kv_bad_message", err


def test_a_service_must_declare_ranges_that_tile_its_own_layers() -> None:
    factors = CompatFactors.for_transfer(small_spec(), PullTransfer)
    KVIdentity(node_info("prefill", [[0, 3], [3, 4]]), factors)
    with pytest.raises(ValueError, match="missing layers 2"):
        KVIdentity(node_info("prefill", [[0, 2], [3, 4]]), factors)
    with pytest.raises(ValueError, match="model has 4"):
        KVIdentity(node_info("prefill", [[0, 3], [3, 5]], span=(0, 5)), factors)

