"""Who may send a worker a prefill leg (services/worker/leg_auth.py): with a KV secret, a
caller that signs with it; without one, a caller on loopback. The end-to-end refusal of an
unsigned or replayed leg by a real prefill is in tests/pd/test_pd_handshake.py."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from services.common.errors import ApiError, error_middleware
from services.common.signing import sign
from services.kv_transfer.config import KVTransferConfig
from services.worker.leg_auth import is_trusted_leg_caller, leg_auth_middleware, require_trusted_leg
from tests.support.kv import SECRET

BODY = b'{"kv_transfer_params": {"do_remote_decode": true}}'


class _Peer:
    def __init__(self, host: str) -> None:
        self._host = host

    def get_extra_info(self, name: str, default=None):
        return (self._host, 50000) if name == "peername" else default


async def _echo_trust(request: web.Request) -> web.StreamResponse:
    return web.json_response({"trusted": is_trusted_leg_caller(request)})


async def trusted_peer(kv: KVTransferConfig, host: str) -> bool:
    """What the middleware decides for an unsigned caller at `host` (the socket's address)."""
    request = make_mocked_request("POST", "/v1/completions", transport=_Peer(host))
    response = await leg_auth_middleware(kv)(request, _echo_trust)
    assert isinstance(response, web.Response) and response.body is not None
    return json.loads(bytes(response.body))["trusted"]


async def signed_post(kv: KVTransferConfig, headers: dict[str, str]) -> tuple[int, dict]:
    """A real loopback POST through the middleware (it reads and verifies the body)."""
    app = web.Application(middlewares=[error_middleware, leg_auth_middleware(kv)])
    app.router.add_post("/v1/completions", _echo_trust)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/completions", data=BODY, headers=headers)
        return resp.status, await resp.json()


@pytest.mark.parametrize("host,expected", [("127.0.0.1", True), ("::1", True),
                                           ("10.0.0.7", False), ("192.168.3.4", False)])
async def test_without_a_secret_only_loopback_callers_may_send_prefill_legs(host, expected) -> None:
    assert await trusted_peer(KVTransferConfig(role="prefill"), host) is expected


async def test_with_a_secret_only_signed_callers_may_send_prefill_legs() -> None:
    kv = KVTransferConfig(role="prefill", secret=SECRET)
    assert await signed_post(kv, {}) == (200, {"trusted": False})  # loopback is no credential
    good = sign(SECRET, "POST", "/v1/completions", [BODY])
    assert await signed_post(kv, good) == (200, {"trusted": True})
    status, body = await signed_post(kv, sign(b"another-secret-0123456789", "POST",
                                              "/v1/completions", [BODY]))
    assert (status, body["error"]["code"]) == (401, "kv_auth_invalid")


@pytest.mark.parametrize("secret,status,code", [(True, 401, "kv_leg_unsigned"),
                                                (False, 403, "kv_leg_not_loopback")])
def test_an_untrusted_prefill_leg_is_refused_saying_how_to_fix_it(secret, status, code) -> None:
    require_trusted_leg(secret, True)  # a trusted caller passes either way
    with pytest.raises(ApiError) as err:
        require_trusted_leg(secret, False)
    assert (err.value.status, err.value.code, err.value.param) == (
        status, code, "kv_transfer_params")
    assert "PDMESH_KV_SECRET" in err.value.message
