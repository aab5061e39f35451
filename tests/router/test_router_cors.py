"""CORS on the router (`--cors-allow-origin`), driven the way a browser drives it.

A page on an allowed origin first sends a preflight (OPTIONS with Origin and
Access-Control-Request-Method/-Headers): it must be answered before the API-key check (a
preflight carries no Authorization header). The real request then carries Origin, and the
answer, streamed, refused (401) or not, must name the origin so the page may read it.
A disallowed origin gets no CORS header at all.
"""

from __future__ import annotations

from tests.support.fake_worker import FakeWorker

PAGE = "https://chat.example.com"
OTHER = "https://evil.example.net"
KEY = "sk-cors"
BODY = {"model": "fake-model", "prompt": "hello there", "max_tokens": 3}


def preflight_headers(origin: str) -> dict[str, str]:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-request-id"}


async def test_preflight_from_an_allowed_origin_is_answered_before_auth(make_mesh) -> None:
    mesh = await make_mesh([FakeWorker("mixed")], cors_allow_origins=(PAGE,), api_keys=(KEY,))
    resp = await mesh.client.options("/v1/completions", headers=preflight_headers(PAGE))
    assert resp.status == 204
    h = resp.headers
    assert h["Access-Control-Allow-Origin"] == PAGE
    assert h["Access-Control-Allow-Credentials"] == "true"
    assert "POST" in h["Access-Control-Allow-Methods"].replace(" ", "").split(",")
    assert h["Access-Control-Allow-Headers"] == "authorization, content-type, x-request-id"
    assert "Origin" in h.getall("Vary")
    assert not mesh.role("mixed")[0].calls  # nothing reached a worker


async def test_requests_from_an_allowed_origin_carry_the_headers(make_mesh) -> None:
    mesh = await make_mesh([FakeWorker("mixed")], cors_allow_origins=(PAGE,), api_keys=(KEY,))
    auth = {"Origin": PAGE, "Authorization": f"Bearer {KEY}"}
    for body in (BODY, {**BODY, "stream": True}):  # a stream's headers go out early
        resp = await mesh.client.post("/v1/completions", json=body, headers=auth)
        assert resp.status == 200
        await resp.read()
        assert resp.headers["Access-Control-Allow-Origin"] == PAGE
        assert resp.headers["Access-Control-Allow-Credentials"] == "true"
        assert "X-Request-Id" in resp.headers["Access-Control-Expose-Headers"]
        assert "Origin" in resp.headers.getall("Vary")
    # A refusal is readable by the page too (it can show "bad API key").
    resp = await mesh.client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
    assert resp.status == 401
    assert resp.headers["Access-Control-Allow-Origin"] == PAGE
    assert "API key" in (await resp.json())["error"]["message"]


async def test_a_disallowed_origin_gets_no_cors_headers(make_mesh) -> None:
    mesh = await make_mesh([FakeWorker("mixed")], cors_allow_origins=(PAGE,))
    resp = await mesh.client.options("/v1/completions", headers=preflight_headers(OTHER))
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "cors_origin_not_allowed"
    assert not any(k.startswith("Access-Control-Allow") for k in resp.headers)
    resp = await mesh.client.post("/v1/completions", json=BODY, headers={"Origin": OTHER})
    assert resp.status == 200  # served (a non-browser client may send any Origin) ...
    assert not any(k.startswith("Access-Control-") for k in resp.headers)  # ... unreadable
    assert "Origin" in resp.headers.getall("Vary")  # and no cache mixes the two origins


async def test_any_origin_never_allows_credentials(make_mesh) -> None:
    mesh = await make_mesh([FakeWorker("mixed")], cors_allow_origins=("*",))
    resp = await mesh.client.options("/v1/chat/completions", headers=preflight_headers(OTHER))
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in resp.headers
    resp = await mesh.client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in resp.headers


async def test_without_the_flag_there_is_no_cors(make_mesh) -> None:
    mesh = await make_mesh([FakeWorker("mixed")])
    resp = await mesh.client.options("/v1/completions", headers=preflight_headers(PAGE))
    assert resp.status == 405  # no preflight handling: the route table answers
    assert "Access-Control-Allow-Origin" not in resp.headers
    resp = await mesh.client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
