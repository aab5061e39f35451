"""KVTransferConfig: the KV service's settings, built once from flags and the environment.

`PDMESH_KV_SECRET` (or the file named by `PDMESH_KV_SECRET_FILE`) is read here and nowhere
else (`kv_secret_from_env`, through the `environ` mapping handed to `from_args`; the router's
config calls it too). The transfer mode is a name here only to pick the transfer class; the mode in
the compat hash always comes from that class's `mode` attribute.
"""

from __future__ import annotations

import argparse
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.limits import ServerLimits
from services.common.signing import MIN_SECRET_BYTES, SignatureWindow
from services.common.tls import TLSFiles
from shared.protocol.codec import MAX_CHUNK_BYTES, MAX_HEADER_BYTES
from shared.protocol.messages import ROLES, TRANSFER_MODES

KV_SECRET_ENV = "PDMESH_KV_SECRET"
KV_SECRET_FILE_ENV = "PDMESH_KV_SECRET_FILE"


def kv_secret_from_env(environ: Mapping[str, str]) -> bytes | None:
    """The mesh's KV secret: `PDMESH_KV_SECRET`, else the contents of `PDMESH_KV_SECRET_FILE`
    (surrounding whitespace stripped; the docker-secrets convention), else None."""
    value = environ.get(KV_SECRET_ENV, "")
    path = environ.get(KV_SECRET_FILE_ENV, "")
    if not value and path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{KV_SECRET_FILE_ENV}: cannot read {path}: "
                             f"{exc.strerror or type(exc).__name__}") from None
        if not value:
            raise ValueError(f"{KV_SECRET_FILE_ENV}: {path} is empty")
    if value and len(value.encode()) < MIN_SECRET_BYTES:
        raise ValueError(f"{KV_SECRET_ENV} must be at least {MIN_SECRET_BYTES} bytes")
    return value.encode() if value else None
DEFAULT_KV_PORT = 14579
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def own_address() -> str:
    """This machine's address as peers reach it: what its hostname resolves to. In a container
    or a pod that is its own IP (from /etc/hosts), unlike a service name, which resolves to
    every replica; the hostname itself if it does not resolve."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


@dataclass(frozen=True)
class KVTransferConfig:
    """Settings of one KV-transfer service (one per prefill or decode worker).

    `advertise_host` is what goes into kv_transfer_params (defaults to `host`; `from_args` sets
    it to `own_address()` for a wildcard bind), `advertise_port` likewise (defaults to the bound
    port: a forwarder or NAT in front of the listener names its own). Leases last
    `lease_seconds`; decode heartbeats every lease/6 extend them to now + 2/3 lease. A push
    rendezvous waits at most `push_deadline_seconds` for the other leg. `layer_start`/
    `layer_end` (None: all) and `pp_size` describe a pipeline stage for negotiation;
    `layer_partition` (None: the even split) gives each stage's layer count, as
    `--pp-layer-partition` does, so the ranges declared in the handshake are the engine's own.
    `tls` are the worker's own files (services/common/tls.py): with a certificate the KV
    listener serves TLS (advertised as `kv_endpoint.tls` and in kv_transfer_params, so peers
    know to connect with TLS), and this service's peer client verifies TLS peers against
    `tls.ca` and presents the certificate as its client certificate. `require_client_cert`
    (mTLS) refuses peers whose certificate does not chain to `tls.ca`.
    With a `secret` every request is signed; a signature is accepted `auth_past_s` after and
    `auth_future_s` before this clock, once (`services.kv_transfer.auth`). A request head must
    arrive within `header_timeout_s`, a body within `body_timeout_s` (ServerLimits).
    """

    role: str = "prefill"
    mode: str = "pull"
    host: str = "127.0.0.1"
    port: int = DEFAULT_KV_PORT
    advertise_host: str | None = None
    advertise_port: int | None = None
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    lease_seconds: float = 30.0
    push_deadline_seconds: float = 30.0
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    secret: bytes | None = field(default=None, repr=False)
    allow_incompatible: bool = False
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 60.0
    keepalive_s: float = 15.0  # an idle pooled connection to a peer closes after this
    auth_past_s: float = 30.0
    auth_future_s: float = 5.0
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    layer_start: int = 0
    layer_end: int | None = None
    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    tls: TLSFiles = field(default_factory=TLSFiles)
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"KV role must be one of {ROLES}, got {self.role!r}")
        if self.mode not in TRANSFER_MODES:
            raise ValueError(f"KV transfer mode must be one of {TRANSFER_MODES}, got {self.mode!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"KV port must be in [0, 65535], got {self.port}")
        if self.advertise_port is not None and not 1 <= self.advertise_port <= 65535:
            raise ValueError(f"KV advertise port must be in [1, 65535], got {self.advertise_port}")
        if self.lease_seconds <= 0 or self.push_deadline_seconds <= 0 or self.keepalive_s <= 0:
            raise ValueError("lease, push deadline and keepalive must be > 0 seconds")
        if not 4096 <= self.max_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes must be in [4096, {MAX_CHUNK_BYTES}]")
        if self.layer_partition is not None and len(self.layer_partition) != self.pp_size:
            raise ValueError(f"layer partition {list(self.layer_partition)} has "
                             f"{len(self.layer_partition)} stages, pp_size is {self.pp_size}")
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"{KV_SECRET_ENV} must be at least {MIN_SECRET_BYTES} bytes")
        if self.require_client_cert and (not self.tls.enabled or self.tls.ca is None):
            raise ValueError("--kv-require-client-cert needs --tls-cert/--tls-key (the KV "
                             "listener's TLS) and --tls-ca (the CA client certificates chain to)")
        SignatureWindow(self.auth_past_s, self.auth_future_s)  # validates
        ServerLimits(self.max_body_bytes, self.header_timeout_s, self.body_timeout_s)

    @property
    def signature_window(self) -> SignatureWindow:
        return SignatureWindow(self.auth_past_s, self.auth_future_s)

    @property
    def max_body_bytes(self) -> int:
        """A push write is one envelope plus one chunk; nothing larger is ever posted."""
        return self.max_chunk_bytes + MAX_HEADER_BYTES

    @property
    def limits(self) -> ServerLimits:
        return ServerLimits(self.max_body_bytes, self.header_timeout_s, self.body_timeout_s)

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def heartbeat_interval_s(self) -> float:
        return self.lease_seconds / 6

    @property
    def lease_extension_s(self) -> float:
        return self.lease_seconds * 2 / 3

    @property
    def reap_interval_s(self) -> float:
        return min(1.0, self.lease_seconds / 10)

    @property
    def reclaim_deadline_s(self) -> float:
        """How long a decode request may wait for remote KV before its slot is reclaimed:
        longer than both the lease and the push rendezvous, so it never fires first."""
        return self.lease_seconds + self.push_deadline_seconds

    @classmethod
    def from_args(cls, args: argparse.Namespace, role: str, environ: Mapping[str, str],
                  tls: TLSFiles | None = None) -> KVTransferConfig:
        """`tls`: the worker's files (the KV listener reuses its certificate)."""
        return cls(
            role=role, mode=args.transfer_mode, host=args.kv_host, port=args.kv_port,
            # A wildcard bind names no address a peer can use: advertise our own.
            advertise_host=args.kv_advertise_host or (
                own_address() if args.kv_host in WILDCARD_HOSTS else None),
            advertise_port=args.kv_advertise_port,
            lease_seconds=args.kv_lease_seconds,
            push_deadline_seconds=args.kv_push_deadline_seconds,
            secret=kv_secret_from_env(environ),
            allow_incompatible=args.kv_allow_incompatible, tls=tls or TLSFiles(),
            require_client_cert=args.kv_require_client_cert,
            auth_past_s=args.kv_auth_window_seconds, auth_future_s=args.kv_auth_future_seconds,
            header_timeout_s=args.kv_header_timeout_seconds,
            body_timeout_s=args.kv_body_timeout_seconds, keepalive_s=args.kv_keepalive_seconds,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV-transfer flags of a prefill/decode worker."""
    d = KVTransferConfig()
    g = parser.add_argument_group("KV transfer (prefill/decode roles)")
    g.add_argument("--kv-host", default=d.host, help="KV service bind address")
    g.add_argument("--kv-port", type=int, default=d.port, help="KV service port")
    g.add_argument("--kv-advertise-host", default=None,
                   help="host put in kv_transfer_params and metadata (default: --kv-host; "
                   "with --kv-host 0.0.0.0, this machine's own address: what its hostname "
                   "resolves to, so each replica of a scaled service is reached directly)")
    g.add_argument("--kv-advertise-port", type=int, default=None,
                   help="port put in kv_transfer_params and metadata (default: the bound "
                   "port; set it when peers reach the listener through a forwarder)")
    g.add_argument("--transfer-mode", "--kv-mode", dest="transfer_mode", default=d.mode,
                   choices=TRANSFER_MODES, help="KV transfer mode (part of the compat hash)")
    g.add_argument("--kv-lease-seconds", type=float, default=d.lease_seconds,
                   help="how long a prefill holds finished KV blocks without a heartbeat")
    g.add_argument("--kv-push-deadline-seconds", type=float, default=d.push_deadline_seconds,
                   help="push mode: a decode gives up a transfer after this long without a "
                   "block or keepalive from its prefill (a prefill whose prompt is queued "
                   "keeps it alive), and a prefill waits this long for the decode to register")
    g.add_argument("--kv-keepalive-seconds", type=float, default=d.keepalive_s,
                   help="an idle pooled connection to a KV peer is closed after this long")
    g.add_argument("--kv-allow-incompatible", action="store_true",
                   help="pair with workers whose compat hash differs (logs a loud warning; "
                        "for debugging only)")
    g.add_argument("--kv-require-client-cert", action="store_true",
                   help="mTLS: KV peers must present a certificate that chains to --tls-ca "
                        "(the KV listener serves TLS with the worker's --tls-cert/--tls-key)")
    g.add_argument("--kv-auth-window-seconds", type=float, default=d.auth_past_s,
                   help="a signed KV request is accepted this long after it was signed (its "
                        "nonce is remembered as long, so a replay is refused)")
    g.add_argument("--kv-auth-future-seconds", type=float, default=d.auth_future_s,
                   help="clock skew allowed for a signed KV request dated in the future")
    g.add_argument("--kv-header-timeout-seconds", type=float, default=d.header_timeout_s,
                   help="KV port: close a connection whose request head is not complete "
                        "after this long (or idle this long)")
    g.add_argument("--kv-body-timeout-seconds", type=float, default=d.body_timeout_s,
                   help="KV port: close a connection whose request body is not complete "
                        "this long after its head")
