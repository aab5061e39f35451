"""Who may use a KV service: signed requests once within a narrow window, loopback without a
secret. Regression tests for two defects found by hand:
- "Signed requests can be replayed": a replayed signed pull returned the KV again, replayed
  release and handshake requests got 200, and a timestamp 290 s ahead was accepted;
- "The KV channel is open by default": without a secret any process could handshake and pull.
"""

from __future__ import annotations

import time

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from services.common.errors import ApiError
from services.common.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ReplayCache,
    SignatureVerifier,
    SignatureWindow,
    _mac,
    sign,
)
from services.kv_transfer.auth import is_loopback, kv_auth_middleware
from shared.protocol.codec import seal
from shared.protocol.messages import PullRequest, ReleaseRequest
from tests.kv_transfer.test_kv_pull import offered
from tests.support.kv import SECRET, Node, assert_no_leaks, post_raw


def sealed(node: Node, msg) -> bytes:
    ident = node.service.identity
    return seal(ident.compat_hash, ident.factors.to_wire(), msg)


async def twice(url: str, body: bytes, headers: dict[str, str]) -> list[tuple[int, dict]]:
    """The same bytes and signature headers sent twice, as a replaying process would."""
    return [await post_raw(url, body, headers) for _ in range(2)]


def codes(answers: list[tuple[int, dict]]) -> list[tuple[int, str | None]]:
    return [(status, (body.get("error") or {}).get("code")) for status, body in answers]


async def test_replayed_handshake_pull_and_release_are_refused(nodes) -> None:
    p, d = await nodes("prefill", secret=SECRET), await nodes("decode", secret=SECRET)
    hs = sealed(d, d.service.identity.node)
    assert codes(await twice(p.url + "/kv/v1/handshake", hs,
                             sign(SECRET, "POST", "/kv/v1/handshake", [hs]))) == [
        (200, None), (401, "kv_auth_replayed")]
    params, _ = await offered(p)
    engine = d.service.identity.node.engine_id
    pull = sealed(d, PullRequest(engine, params.remote_request_id, params.lease_id,
                                 list(params.block_ids)))
    first, again = await twice(p.url + "/kv/v1/pull", pull,
                               sign(SECRET, "POST", "/kv/v1/pull", [pull]))
    assert first[0] == 200 and codes([again]) == [(401, "kv_auth_replayed")]
    assert p.service.transfer.held_blocks > 0  # the lease is still held: only the replay failed
    release = sealed(d, ReleaseRequest(engine, params.remote_request_id, params.lease_id))
    assert codes(await twice(p.url + "/kv/v1/release", release,
                             sign(SECRET, "POST", "/kv/v1/release", [release]))) == [
        (200, None), (401, "kv_auth_replayed")]
    await assert_no_leaks(p, d)


def _headers_at(ts: float, body: bytes, path: str, nonce: str = "ab" * 16) -> dict[str, str]:
    stamp = str(int(ts))
    return {TIMESTAMP_HEADER: stamp, NONCE_HEADER: nonce,
            SIGNATURE_HEADER: _mac(SECRET, stamp, nonce, "POST", path, (body,))}


@pytest.mark.parametrize("ahead,window,status", [
    (290, {}, 401),  # the case found by hand (290 s in the future): accepted before
    (7, {}, 401), (-32, {}, 401), (3, {}, 200), (-25, {}, 200),  # default: 30 s past, 5 ahead
    (-100, {"auth_past_s": 120.0}, 200), (10, {"auth_future_s": 15.0}, 200),  # configured
])
async def test_the_clock_window_is_narrow_and_configurable(nodes, ahead, window, status) -> None:
    p = await nodes("prefill", secret=SECRET, **window)
    d = await nodes("decode")
    hs = sealed(d, d.service.identity.node)
    got, body = await post_raw(p.url + "/kv/v1/handshake", hs,
                               _headers_at(time.time() + ahead, hs, "/kv/v1/handshake"))
    assert got == status, body
    if status == 401:
        assert body["error"]["code"] == "kv_auth_expired"
        assert "window" in body["error"]["message"]


async def test_a_peer_signing_without_a_nonce_is_told_to_upgrade(nodes) -> None:
    p, d = await nodes("prefill", secret=SECRET), await nodes("decode")
    hs = sealed(d, d.service.identity.node)
    headers = _headers_at(time.time(), hs, "/kv/v1/handshake")
    del headers[NONCE_HEADER]
    status, body = await post_raw(p.url + "/kv/v1/handshake", hs, headers)
    assert status == 401 and body["error"]["code"] == "kv_auth_missing"
    assert "protocol" in body["error"]["message"]


def test_replay_cache_forgets_by_time_and_is_bounded() -> None:
    now = [0.0]
    cache = ReplayCache(ttl_s=10.0, max_entries=3, clock=lambda: now[0])
    assert cache.admit("a") and not cache.admit("a")
    now[0] = 5.0
    assert cache.admit("b") and cache.admit("c") and len(cache) == 3
    with pytest.raises(ApiError) as full:  # full within the ttl: refuse, never forget early
        cache.admit("d")
    assert full.value.status == 503
    now[0] = 10.5  # "a" expired, "b" and "c" not yet
    assert cache.admit("d") and len(cache) == 3 and not cache.admit("b")
    now[0] = 100.0
    assert cache.admit("a") and len(cache) == 1


def test_the_verifier_remembers_nonces_only_for_valid_signatures() -> None:
    verifier = SignatureVerifier(SECRET, SignatureWindow())
    body = b"payload"
    good = sign(SECRET, "POST", "/kv/v1/pull", [body])
    forged = {**good, SIGNATURE_HEADER: "0" * 64}
    with pytest.raises(ApiError) as bad:
        verifier.verify(forged, "POST", "/kv/v1/pull", body)
    assert bad.value.code == "kv_auth_invalid" and len(verifier.replays) == 0
    verifier.verify(good, "POST", "/kv/v1/pull", body)  # the forged try used no nonce
    assert SECRET.decode() not in repr(verifier)


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.2", False), ("192.168.1.9", False), ("::ffff:10.0.0.2", False), ("fe80::1", False),
    ("not-an-ip", False),
])
def test_loopback_addresses(host, loopback) -> None:
    assert is_loopback(host) is loopback


class _Transport:
    def __init__(self, peer: tuple[str, int]) -> None:
        self._peer = peer

    def get_extra_info(self, name: str, default=None):
        return self._peer if name == "peername" else default


@pytest.mark.parametrize("peer,status", [("10.1.2.3", 403), ("127.0.0.1", 200)])
async def test_without_a_secret_only_loopback_peers_are_served(peer, status) -> None:
    """Every KV route, /kv/v1/info included, refuses a peer off the host (the socket's
    address, not a header) when no secret is configured."""
    ok = web.Response(text="ok")

    async def handler(_request: web.Request) -> web.StreamResponse:
        return ok

    middleware = kv_auth_middleware(None, SignatureWindow())
    for path in ("/kv/v1/handshake", "/kv/v1/pull", "/kv/v1/info"):
        request = make_mocked_request("POST", path, transport=_Transport((peer, 40000)))
        if status == 200:
            assert await middleware(request, handler) is ok
            continue
        with pytest.raises(ApiError) as err:
            await middleware(request, handler)
        assert (err.value.status, err.value.code) == (403, "kv_peer_not_loopback")
        assert peer in err.value.message and "PDMESH_KV_SECRET" in err.value.message
