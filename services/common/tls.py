"""TLS for every pdmesh listener and internal client: the files, the contexts, the warning.

Each service's config module holds one `TLSFiles` (built from the flags `add_arguments`
declares: `--tls-cert`, `--tls-key`, `--tls-ca`); the `ssl.SSLContext` objects are built only
here. A listener serves TLS when it has a certificate; a client verifies its peers against
`--tls-ca` (else the system's trust store), always with hostname checks: a certificate must
name (in its subjectAltName) the address the peer is reached by, e.g. the IP in
`--kv-advertise-host` or the host of a worker URL given to the router.

The worker's KV listener reuses the worker's certificate and key: one identity per worker.
With `--kv-require-client-cert` (mTLS) it accepts only clients whose certificate chains to
`--tls-ca`; KV clients present the worker's own certificate, so the certificates then need the
clientAuth extended key usage too (or no extendedKeyUsage at all).

`exposure_warning` is the secure-by-default check every service runs as it binds: plain HTTP
on a non-loopback address is logged as a risk (and, for a KV listener without a secret, as
one that lets anyone on the network pull prompt KV).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("pdmesh.tls")


class TLSFileError(ValueError):
    """A certificate, key or CA file that is missing, unreadable or not what it should be."""


@dataclass(frozen=True)
class TLSFiles:
    """The PEM files of one process: its certificate chain and key (a TLS listener, and the
    client certificate of an mTLS hop) and the CA bundle its peers are verified against.

    Validated on construction (both of cert/key or neither; every file readable and loadable),
    so a bad file is a start-up error naming it, never a traceback later.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TLSFileError("--tls-cert and --tls-key go together (give both or neither)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                           ("--tls-ca", self.ca)):
            if path is not None and not os.access(path, os.R_OK):
                reason = "does not exist" if not Path(path).exists() else "is not readable"
                raise TLSFileError(f"{flag} {path} {reason}")
        if self.cert is not None:
            self.server_context()  # loads the files now: a bad PEM fails at start-up
        if self.ca is not None:
            self.client_context()

    @property
    def enabled(self) -> bool:
        """Whether listeners built from these files serve TLS."""
        return self.cert is not None

    def server_context(self, require_client_cert: bool = False) -> ssl.SSLContext | None:
        """The listener's context (None: plain HTTP); with `require_client_cert`, mTLS."""
        if self.cert is None or self.key is None:
            return None
        return server_context(self.cert, self.key, self.ca, require_client_cert)

    def client_context(self) -> ssl.SSLContext:
        """The context of a client of internal hops (used for https:// peers only)."""
        return client_context(self.ca, self.cert, self.key)


def server_context(cert: str, key: str, client_ca: str | None = None,
                   require_client_cert: bool = False) -> ssl.SSLContext:
    """A TLS server context for `cert`/`key`; with `require_client_cert`, clients must present
    a certificate that chains to `client_ca` (mTLS)."""
    if require_client_cert and client_ca is None:
        raise TLSFileError("requiring client certificates needs --tls-ca (the CA they chain to)")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key)
    if require_client_cert:
        assert client_ca is not None
        _load_ca(ctx, client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: str | None, cert: str | None = None,
                   key: str | None = None) -> ssl.SSLContext:
    """A verifying client context: peers chain to `ca` (None: the system's trust store) and
    their certificate names the host they are reached by; `cert`/`key`, when given, are
    presented to servers that ask for a client certificate (mTLS)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca is not None:
        _load_ca(ctx, ca)
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key)
    assert ctx.check_hostname and ctx.verify_mode is ssl.CERT_REQUIRED
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError(f"cannot load the certificate {cert} with the key {key}: "
                           f"{_reason(exc)}") from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError(f"cannot load the CA bundle {ca}: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a listener on this machine (an unparsable name other than
    localhost counts as exposed: it may resolve to anything)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(service: str, host: str, port: int, tls: bool,
                     kv_secret: bool | None = None) -> str | None:
    """Log (and return) the WARNING for a listener bound beyond loopback without protection.

    `kv_secret` is given for a KV listener only: without PDMESH_KV_SECRET it serves loopback
    peers only (services/kv_transfer/auth.py), so no worker on another host can pair with it.
    None when nothing is at risk.
    """
    if is_loopback(host):
        return None
    if kv_secret is not None and not kv_secret:
        message = (f"{service} listens on {host}:{port} without PDMESH_KV_SECRET: it refuses "
                   "every peer that is not on loopback, so no worker on another host can pair "
                   "with it; set the same PDMESH_KV_SECRET on every worker (and "
                   "--tls-cert/--tls-key to encrypt the KV it moves)")
    elif not tls:
        message = (f"{service} listens on {host}:{port} over plain HTTP: traffic (prompts, "
                   "completions, bearer keys) can be read and changed on the network; "
                   "give --tls-cert/--tls-key, or bind to loopback")
    else:
        return None
    log.warning(message)
    return message


class ArgumentTarget(Protocol):
    """A parser or an argument group of one."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


def add_arguments(parser: ArgumentTarget) -> None:
    """The TLS flags a router or worker declares (its config module calls this)."""
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="serve HTTPS with this certificate chain (the worker's KV "
                             "listener too); also the client certificate of mTLS KV hops")
    parser.add_argument("--tls-key", default=None, metavar="PEM",
                        help="private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="CA bundle that internal peers' certificates are verified "
                             "against (default: the system store); certificates must name "
                             "the address a peer is reached by")


def from_args(args: argparse.Namespace) -> TLSFiles:
    return TLSFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
