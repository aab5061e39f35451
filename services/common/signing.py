"""HMAC request signing with a timestamp, a nonce and a replay cache (the mesh's shared secret).

Who signs what: every KV-service request between workers (`services.kv_transfer.handshake`),
and every POST the router sends to a worker when the mesh has a KV secret (a worker hands out
KV leases only to prefill legs so signed: `services.worker.leg_auth`).

A signed request carries three headers:
- `X-PDMesh-KV-Timestamp`: unix seconds when it was signed;
- `X-PDMesh-KV-Nonce`: 32 hex characters, fresh for every request (`secrets.token_hex`);
- `X-PDMesh-KV-Signature`: hex HMAC-SHA256 over "timestamp\\nnonce\\nMETHOD\\npath\\n" + body.
Binding method and path stops a signed body from being replayed on another route. The verifier
accepts a timestamp at most `window.past_s` old and `window.future_s` ahead of its clock, and a
nonce at most once within that span (`ReplayCache`): a replayed request gets 401
`kv_auth_replayed`, a stale one 401 `kv_auth_expired`. A nonce is remembered only once its MAC
verified, so only holders of the secret can fill the cache; it forgets a nonce once the nonce's
timestamp could no longer pass the window, and refuses (503) past `max_entries` instead of
forgetting early (fail closed).

All comparisons are constant time (`hmac.compare_digest`); no message quotes a signature or the
secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from services.common.errors import AuthenticationError, ServiceUnavailableError

SIGNATURE_HEADER = "X-PDMesh-KV-Signature"
TIMESTAMP_HEADER = "X-PDMesh-KV-Timestamp"
NONCE_HEADER = "X-PDMesh-KV-Nonce"
SIGNED_HEADERS = (TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
MIN_SECRET_BYTES = 16

_NONCE = re.compile(r"^[0-9a-f]{32}$")
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_SIGNATURE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class SignatureWindow:
    """How far a signed request's timestamp may lie behind (`past_s`) or ahead (`future_s`) of
    the verifier's clock. Small on purpose: the mesh's clocks are expected in sync (NTP), and
    the window is also how long the replay cache must remember a nonce."""

    past_s: float = 30.0
    future_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.past_s <= 3600 or not 0 <= self.future_s <= 300:
            raise ValueError(f"signature window must have 0 < past <= 3600 s and "
                             f"0 <= future <= 300 s, got {self.past_s}, {self.future_s}")

    @property
    def span_s(self) -> float:
        return self.past_s + self.future_s


def _mac(secret: bytes, timestamp: str, nonce: str, method: str, path: str,
         body_parts: Iterable[bytes | memoryview]) -> str:
    head = f"{timestamp}\n{nonce}\n{method.upper()}\n{path}\n".encode()
    mac = hmac.new(secret, head, hashlib.sha256)
    for part in body_parts:
        mac.update(part)
    return mac.hexdigest()


def sign(secret: bytes | None, method: str, path: str,
         body_parts: Iterable[bytes | memoryview]) -> dict[str, str]:
    """Headers to send with one request (none without a secret). Parts avoid joining a body.
    Sign every attempt anew: a retried request needs a fresh nonce."""
    if secret is None:
        return {}
    ts, nonce = str(int(time.time())), secrets.token_hex(16)
    return {TIMESTAMP_HEADER: ts, NONCE_HEADER: nonce,
            SIGNATURE_HEADER: _mac(secret, ts, nonce, method, path, body_parts)}


def signed_json(secret: bytes | None, path: str, body: object) -> tuple[bytes, dict[str, str]]:
    """A JSON POST body as the bytes to send and its headers (signed when there is a secret)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    return data, {"Content-Type": "application/json", **sign(secret, "POST", path, (data,))}


def is_signed(headers: Mapping[str, str]) -> bool:
    """True when a request carries any of the signature headers (it is then verified)."""
    return any(h in headers for h in SIGNED_HEADERS)


class ReplayCache:
    """Nonces seen in the last `ttl_s` seconds, forgotten in arrival order (each entry's
    expiry is arrival + ttl, so expiries are sorted by arrival: eviction pops from the front).
    """

    def __init__(self, ttl_s: float, max_entries: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._max, self._clock = ttl_s, max_entries, clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def _evict(self, now: float) -> None:
        while self._seen:
            nonce, expiry = next(iter(self._seen.items()))
            if expiry > now:
                return
            del self._seen[nonce]

    def admit(self, nonce: str) -> bool:
        """Remember `nonce`; False if it was already seen within the ttl."""
        now = self._clock()
        self._evict(now)
        if nonce in self._seen:
            return False
        if len(self._seen) >= self._max:
            raise ServiceUnavailableError("too many signed requests in the replay window; "
                                          "retry shortly", code="kv_auth_busy",
                                          headers={"Retry-After": "1"})
        self._seen[nonce] = now + self._ttl
        return True


class SignatureVerifier:
    """Checks signed requests against one secret, window and replay cache (one per listener).

    `verify` raises AuthenticationError (401) with a code saying what was wrong; the checks
    run in an order that reveals nothing without the secret: presence and shape, then the MAC
    (constant time), then the clock window, then the nonce.
    """

    def __init__(self, secret: bytes, window: SignatureWindow,
                 wall_clock: Callable[[], float] = time.time,
                 cache: ReplayCache | None = None) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the signing secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret, self.window, self._now = secret, window, wall_clock
        self.replays = cache or ReplayCache(window.span_s)

    def __repr__(self) -> str:  # never the secret
        return f"SignatureVerifier(window={self.window!r})"

    def verify(self, headers: Mapping[str, str], method: str, path: str,
               body: bytes | memoryview) -> None:
        ts, nonce, sig = (headers.get(h) for h in SIGNED_HEADERS)
        if ts and sig and not nonce:
            raise AuthenticationError(
                f"request is signed without {NONCE_HEADER}: the peer speaks an older KV "
                "protocol (< 4, no replay protection); upgrade it", code="kv_auth_missing")
        if not ts or not nonce or not sig:
            raise AuthenticationError(
                f"request is not signed (needs {', '.join(SIGNED_HEADERS)}; every worker and "
                "the router of a mesh need the same PDMESH_KV_SECRET)", code="kv_auth_missing")
        if not (_TIMESTAMP.match(ts) and _NONCE.match(nonce) and _SIGNATURE.match(sig)):
            raise AuthenticationError("request signature headers are malformed",
                                      code="kv_auth_invalid")
        expected = _mac(self._secret, ts, nonce, method, path, (body,))
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise AuthenticationError("request signature is invalid (different secret?)",
                                      code="kv_auth_invalid")
        age = self._now() - int(ts)
        if age > self.window.past_s or -age > self.window.future_s:
            raise AuthenticationError(
                f"signed request timestamp is {age:+.0f} s from this server's clock, outside "
                f"the window [-{self.window.future_s:g}, +{self.window.past_s:g}] s "
                "(clock skew, or a replay)", code="kv_auth_expired")
        if not self.replays.admit(nonce):
            raise AuthenticationError("signed request was already used (replayed nonce)",
                                      code="kv_auth_replayed")
