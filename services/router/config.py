"""Router configuration: one frozen `RouterConfig`, built once from CLI flags and the environment.

`add_arguments` declares every flag; `RouterConfig.from_args` folds in the few environment
variables (secrets stay out of process listings) and validates. Nothing below this module reads
the environment: the config is passed down.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

from services.common import tls
from services.common.limits import ServerLimits
from services.common.tls import TLSFiles
from services.kv_transfer.config import kv_secret_from_env
from services.router.disagg_threshold import DisaggLearning, parse_min_tokens


class Policy(StrEnum):
    """How one leg picks a worker among the candidates of a compatibility group."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    POWER_OF_TWO = "power_of_two"
    PREFIX_AWARE = "prefix_aware"


class TokenizerSource(StrEnum):
    """Where the router gets prompt token ids (prefix-aware routing, conditional disaggregation)."""

    AUTO = "auto"  # the local tokenizer if it loads, else a worker's /tokenize
    WORKER = "worker"
    LOCAL = "local"


@dataclass(frozen=True)
class BreakerConfig:
    """Per-worker circuit breaker: open after `failures` in `window_s`, probe after `cooldown_s`."""

    failures: int = 5
    window_s: float = 60.0
    cooldown_s: float = 30.0
    successes: int = 2

    def __post_init__(self) -> None:
        if self.failures < 1 or self.successes < 1:
            raise ValueError("breaker failures and successes must be >= 1")
        if self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError("breaker window must be > 0 and cool-down >= 0")


@dataclass(frozen=True)
class RetryConfig:
    """Retries before the first byte reaches the client: attempts, backoff with jitter, budget."""

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    multiplier: float = 2.0
    max_backoff_s: float = 2.0
    jitter: float = 0.1  # fraction of the delay, drawn uniformly in [-j, +j]
    budget_s: float = 30.0  # wall time allowed for all attempts of one request

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")


@dataclass(frozen=True)
class AdmissionConfig:
    """At most `max_inflight` requests dispatched; `max_queue` wait FIFO for `timeout_s`."""

    max_inflight: int = 256
    max_queue: int = 1024
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_queue < 0 or self.timeout_s <= 0:
            raise ValueError("admission needs max_inflight >= 1, max_queue >= 0, timeout > 0")


class DiscoveryScheme(StrEnum):
    """How a `--discover` target finds workers (also the `source` /workers shows for them)."""

    DNS = "dns"  # re-resolve a name every interval: one worker per address
    K8S = "k8s"  # watch a Service's EndpointSlices


# A Kubernetes name (RFC 1123 label): what namespaces and Services are called.
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class DiscoveryTarget:
    """One `--discover` URL: `dns://NAME:PORT` or `k8s://NAMESPACE/SERVICE[:PORT]`.

    DNS: `host` is the name to resolve and `port` the workers' HTTP port. Kubernetes:
    `namespace`/`service` select the EndpointSlices (label kubernetes.io/service-name), and the
    port is a number (`port`), a named endpoint port (`port_name`), or neither (the slice's only
    port). `uri` is the URL as written, normalised: how /workers names what found a worker.
    """

    scheme: DiscoveryScheme
    uri: str
    host: str = ""
    port: int | None = None
    namespace: str = ""
    service: str = ""
    port_name: str | None = None

    @staticmethod
    def parse(uri: str) -> DiscoveryTarget:
        """Raises ValueError naming the expected form."""
        scheme, _, rest = uri.partition("://")
        if scheme == DiscoveryScheme.DNS:
            return DiscoveryTarget._dns(uri, rest)
        if scheme == DiscoveryScheme.K8S:
            return DiscoveryTarget._k8s(uri, rest)
        raise ValueError(f"--discover {uri!r}: expected dns://NAME:PORT or "
                         "k8s://NAMESPACE/SERVICE[:PORT]")

    @staticmethod
    def _dns(uri: str, rest: str) -> DiscoveryTarget:
        form = f"--discover {uri!r}: expected dns://NAME:PORT (e.g. dns://decode:8200)"
        try:
            parts = urlsplit("//" + rest)
            port = parts.port
        except ValueError:
            raise ValueError(form) from None
        if not parts.hostname or port is None or parts.path or parts.query or parts.username:
            raise ValueError(form)
        return DiscoveryTarget(DiscoveryScheme.DNS, f"dns://{rest}", host=parts.hostname,
                               port=port)

    @staticmethod
    def _k8s(uri: str, rest: str) -> DiscoveryTarget:
        form = (f"--discover {uri!r}: expected k8s://NAMESPACE/SERVICE[:PORT_NAME_OR_NUMBER] "
                "(e.g. k8s://default/decode:http)")
        namespace, slash, service = rest.partition("/")
        service, _, port_part = service.partition(":")
        if not slash or not _K8S_NAME.fullmatch(namespace) or not _K8S_NAME.fullmatch(service):
            raise ValueError(form)
        port, port_name = None, None
        if port_part.isdigit():
            port = int(port_part)
            if not 0 < port < 65536:
                raise ValueError(form)
        elif port_part:
            if not _K8S_NAME.fullmatch(port_part):
                raise ValueError(form)
            port_name = port_part
        return DiscoveryTarget(DiscoveryScheme.K8S, f"k8s://{rest}", namespace=namespace,
                               service=service, port=port, port_name=port_name)


@dataclass(frozen=True)
class DiscoveryConfig:
    """`--discover` targets, the DNS re-resolve interval, and where the Kubernetes client
    finds its credentials (`kubeconfig`: a file; None: the in-cluster service account)."""

    targets: tuple[DiscoveryTarget, ...] = ()
    interval_s: float = 5.0
    kubeconfig: str | None = None

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("--discover-interval must be > 0")
        uris = [t.uri for t in self.targets]
        if len(set(uris)) != len(uris):
            raise ValueError(f"--discover lists a target twice: {uris}")


@dataclass(frozen=True)
class MigrationConfig:
    """Request migration and stall detection of streamed decode legs (migration.py).

    A decode stream that breaks after the client got bytes is continued on another decode of
    its group, at most `max_migrations` times per request. A leg silent for `stall_timeout_s`
    has its worker probed (GET /health): one that does not answer has failed; one that does
    is waited on, up to `stall_limit_s` of silence (stall.py).
    """

    max_migrations: int = 2
    stall_timeout_s: float = 30.0
    stall_limit_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if not 0 < self.stall_timeout_s <= self.stall_limit_s:
            raise ValueError("the stall timeout must be > 0 and <= the stall limit")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router app needs; built once in `from_args` (or directly in tests).

    Secrets (`api_keys`, `admin_token`, `worker_api_key`, `kv_secret`) never appear in repr.
    `kv_secret` is the mesh's PDMESH_KV_SECRET: the router signs every POST to a worker with it,
    and workers with a secret hand out KV only to prefill legs so signed. A request head must
    arrive within `header_timeout_s`, its body within `body_timeout_s` (`limits`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    mixed_urls: tuple[str, ...] = ()
    model: str | None = None  # None: the model the first healthy worker reports
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_token: str | None = field(default=None, repr=False)
    worker_api_key: str | None = field(default=None, repr=False)
    kv_secret: bytes | None = field(default=None, repr=False)
    prefill_policy: Policy = Policy.PREFIX_AWARE
    decode_policy: Policy = Policy.LEAST_LOADED
    disagg_min_tokens: int = 0
    # Set: `--disagg-min-tokens auto`, the threshold is learned (disagg_min_tokens is unused).
    disagg_learning: DisaggLearning | None = None
    tokenizer: TokenizerSource = TokenizerSource.AUTO
    prefix_block_size: int = 16  # used until a group reports its own block size
    overload_abs: int = 8  # prefix-aware falls back to load past min_load + abs ...
    overload_rel: float = 1.5  # ... and past min_load * rel
    early_first_token: bool = True
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    upstream_keepalive_s: float = 30.0  # an idle pooled connection to a worker closes after this
    request_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    drain_grace_s: float = 10.0  # SIGTERM: in-flight requests get this long to finish
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    # The listener's certificate (HTTPS when set) and the CA https:// workers are checked with.
    tls: TLSFiles = field(default_factory=TLSFiles)
    cors_allow_origins: tuple[str, ...] = ()  # browser origins allowed to call; "*": any
    migration: MigrationConfig = field(default_factory=MigrationConfig)

    def __post_init__(self) -> None:
        for url in (*self.prefill_urls, *self.decode_urls, *self.mixed_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https://, got {url!r}")
        if self.disagg_min_tokens < 0 or self.prefix_block_size < 1:
            raise ValueError("disagg_min_tokens must be >= 0 and prefix_block_size >= 1")
        if self.upstream_keepalive_s <= 0:
            raise ValueError("--upstream-keepalive-seconds must be > 0")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health interval and timeout must be > 0")
        for origin in self.cors_allow_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"--cors-allow-origin takes '*' or scheme://host[:port], "
                                 f"got {origin!r}")
        ServerLimits(self.max_body_bytes, self.header_timeout_s, self.body_timeout_s)

    @property
    def limits(self) -> ServerLimits:
        return ServerLimits(self.max_body_bytes, self.header_timeout_s, self.body_timeout_s)

    @staticmethod
    def from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> RouterConfig:
        """Flags win; secrets may come from PDMESH_API_KEY / _ADMIN_TOKEN / _WORKER_API_KEY;
        the KV secret only from PDMESH_KV_SECRET (or _FILE), never a flag (argv is public)."""
        api_keys = tuple(args.api_key or ()) or _env_list(environ, "PDMESH_API_KEY")
        return RouterConfig(
            host=args.host, port=args.port,
            prefill_urls=tuple(_strip(args.prefill)), decode_urls=tuple(_strip(args.decode)),
            mixed_urls=tuple(_strip(args.worker)), model=args.model, api_keys=api_keys,
            admin_token=args.admin_token or environ.get("PDMESH_ADMIN_TOKEN") or None,
            worker_api_key=args.worker_api_key or environ.get("PDMESH_WORKER_API_KEY") or None,
            kv_secret=kv_secret_from_env(environ),
            max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout_seconds,
            body_timeout_s=args.body_timeout_seconds,
            prefill_policy=Policy(args.prefill_policy), decode_policy=Policy(args.decode_policy),
            disagg_min_tokens=args.disagg_min_tokens or 0,
            disagg_learning=DisaggLearning() if args.disagg_min_tokens is None else None,
            tokenizer=TokenizerSource(args.tokenizer),
            early_first_token=not args.no_early_first_token,
            health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
            request_timeout_s=args.request_timeout,
            upstream_keepalive_s=args.upstream_keepalive_seconds,
            drain_grace_s=args.drain_grace_seconds,
            breaker=BreakerConfig(failures=args.breaker_failures, window_s=args.breaker_window,
                                  cooldown_s=args.breaker_cooldown,
                                  successes=args.breaker_successes),
            retry=RetryConfig(max_attempts=args.max_attempts, budget_s=args.retry_budget),
            admission=AdmissionConfig(max_inflight=args.max_inflight, max_queue=args.max_queue,
                                      timeout_s=args.queue_timeout),
            discovery=DiscoveryConfig(
                targets=tuple(DiscoveryTarget.parse(u) for u in args.discover or ()),
                interval_s=args.discover_interval,
                kubeconfig=args.kubeconfig or environ.get("KUBECONFIG") or None),
            tls=tls.from_args(args),
            cors_allow_origins=tuple(o.rstrip("/") for o in args.cors_allow_origin or ()),
            migration=MigrationConfig(max_migrations=args.max_migrations,
                                      stall_timeout_s=args.stall_timeout,
                                      stall_limit_s=args.stall_limit),
        )


def _strip(urls: list[str] | None) -> list[str]:
    return [u.rstrip("/") for u in urls or ()]


def _env_list(environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in environ.get(name, "").split(",") if k.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `pdmesh router` flags (also used by `python -m services.router`)."""
    d = RouterConfig()
    parser.add_argument("--prefill", action="append", metavar="URL", help="prefill worker URL")
    parser.add_argument("--decode", action="append", metavar="URL", help="decode worker URL")
    parser.add_argument("--worker", action="append", metavar="URL", help="mixed worker URL")
    parser.add_argument("--discover", action="append", metavar="URL",
                        help="find workers: dns://NAME:PORT (one worker per address, "
                        "re-resolved every --discover-interval) or "
                        "k8s://NAMESPACE/SERVICE[:PORT] (watch its EndpointSlices); repeatable")
    parser.add_argument("--discover-interval", type=float, default=d.discovery.interval_s,
                        help="seconds between DNS re-resolutions")
    parser.add_argument("--kubeconfig", default=None,
                        help="kubeconfig for k8s:// discovery (or KUBECONFIG; default: the "
                        "in-cluster service account)")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--model", default=None, help="served model id (default: the workers')")
    parser.add_argument("--api-key", action="append", help="guards client endpoints "
                        "(or PDMESH_API_KEY, comma-separated)")
    parser.add_argument("--admin-token", default=None,
                        help="guards POST/DELETE /workers (or PDMESH_ADMIN_TOKEN)")
    parser.add_argument("--worker-api-key", default=None,
                        help="bearer key sent to workers (or PDMESH_WORKER_API_KEY)")
    choices = [p.value for p in Policy]
    parser.add_argument("--prefill-policy", choices=choices, default=d.prefill_policy.value)
    parser.add_argument("--decode-policy", choices=choices, default=d.decode_policy.value)
    parser.add_argument("--disagg-min-tokens", type=parse_min_tokens,
                        default=d.disagg_min_tokens, metavar="N|auto",
                        help="shorter prompts skip the prefill leg and are served whole by a "
                             "decode worker; 'auto': learn N from measured prefill, KV-transfer "
                             "and decode-batch costs (GET /v1/router/metadata shows them)")
    parser.add_argument("--tokenizer", choices=[t.value for t in TokenizerSource],
                        default=d.tokenizer.value)
    parser.add_argument("--no-early-first-token", action="store_true",
                        help="do not stream the prefill's first token before decode starts")
    _add_connection_arguments(parser, d)
    _add_resilience_arguments(parser, d)
    tls.add_arguments(parser.add_argument_group("TLS (the router's listener; --tls-ca: the "
                                                "CA of https:// workers)"))
    parser.add_argument("--cors-allow-origin", action="append", metavar="ORIGIN",
                        help="browser origin allowed to call the API (repeatable; '*': any, "
                             "without credentials)")


def _add_connection_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Health checks, timeouts, keep-alive and body limits of the router's connections."""
    parser.add_argument("--health-interval", type=float, default=d.health_interval_s)
    parser.add_argument("--health-timeout", type=float, default=d.health_timeout_s)
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                        help="seconds a worker may stay silent during a leg")
    parser.add_argument("--upstream-keepalive-seconds", type=float,
                        default=d.upstream_keepalive_s,
                        help="an idle pooled connection to a worker is closed after this long")
    parser.add_argument("--drain-grace-seconds", type=float, default=d.drain_grace_s)
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                        help="a larger request body gets 413 before any byte of it is read")
    parser.add_argument("--header-timeout-seconds", type=float, default=d.header_timeout_s,
                        help="close a connection whose request head is not complete after "
                             "this long (or that stays idle this long)")
    parser.add_argument("--body-timeout-seconds", type=float, default=d.body_timeout_s,
                        help="close a connection whose request body is not complete this long "
                             "after its head")


def _add_resilience_arguments(parser: argparse.ArgumentParser, d: RouterConfig) -> None:
    """Breaker, retries, admission and mid-stream migration."""
    parser.add_argument("--breaker-failures", type=int, default=d.breaker.failures)
    parser.add_argument("--breaker-window", type=float, default=d.breaker.window_s)
    parser.add_argument("--breaker-cooldown", type=float, default=d.breaker.cooldown_s)
    parser.add_argument("--breaker-successes", type=int, default=d.breaker.successes)
    parser.add_argument("--max-attempts", type=int, default=d.retry.max_attempts)
    parser.add_argument("--retry-budget", type=float, default=d.retry.budget_s)
    parser.add_argument("--max-inflight", type=int, default=d.admission.max_inflight)
    parser.add_argument("--max-queue", type=int, default=d.admission.max_queue)
    parser.add_argument("--queue-timeout", type=float, default=d.admission.timeout_s)
    parser.add_argument("--max-migrations", type=int, default=d.migration.max_migrations,
                        help="times one streamed request may move to another decode after "
                        "its decode failed mid-stream (0: never)")
    parser.add_argument("--stall-timeout", type=float, default=d.migration.stall_timeout_s,
                        help="seconds of silence on a leg before its worker is probed "
                        "(GET /health); a worker that does not answer has failed the leg")
    parser.add_argument("--stall-limit", type=float, default=d.migration.stall_limit_s,
                        help="seconds of silence that fail a leg even while its worker "
                        "answers the probes")
