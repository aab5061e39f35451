"""RouterConfig from `pdmesh router` flags and the environment."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.router.config import Policy, RouterConfig


def _config(argv: list[str], env: dict[str, str] | None = None) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(["router", *argv]), env or {})


def test_flags_build_the_config():
    cfg = _config(["--prefill", "http://p:1/", "--prefill", "http://p:2", "--decode", "http://d:1",
                   "--worker", "http://m:1", "--prefill-policy", "round_robin",
                   "--decode-policy", "power_of_two", "--disagg-min-tokens", "32",
                   "--max-queue", "7", "--breaker-failures", "2", "--max-attempts", "4"])
    assert cfg.prefill_urls == ("http://p:1", "http://p:2") and cfg.mixed_urls == ("http://m:1",)
    assert cfg.prefill_policy is Policy.ROUND_ROBIN and cfg.decode_policy is Policy.POWER_OF_TWO
    assert cfg.disagg_min_tokens == 32 and cfg.admission.max_queue == 7
    assert cfg.breaker.failures == 2 and cfg.retry.max_attempts == 4
    assert cfg.api_keys == () and cfg.admin_token is None


def test_secrets_come_from_the_environment_unless_flags_say_otherwise():
    env = {"PDMESH_API_KEY": "k1, k2", "PDMESH_ADMIN_TOKEN": "adm", "PDMESH_WORKER_API_KEY": "w"}
    cfg = _config([], env)
    assert cfg.api_keys == ("k1", "k2") and cfg.admin_token == "adm" and cfg.worker_api_key == "w"
    assert _config(["--api-key", "flag"], env).api_keys == ("flag",)


def test_upstream_keepalive_reaches_the_config_and_must_be_positive():
    assert _config([]).upstream_keepalive_s == 30.0
    assert _config(["--upstream-keepalive-seconds", "1.5"]).upstream_keepalive_s == 1.5
    with pytest.raises(ValueError, match="--upstream-keepalive-seconds"):
        _config(["--upstream-keepalive-seconds", "0"])


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="http"):
        _config(["--prefill", "p:1"])
    with pytest.raises(ValueError):
        _config(["--max-attempts", "0"])


def test_discover_targets_are_parsed_once_with_clear_errors():
    cfg = _config(["--discover", "dns://decode:8200", "--discover", "k8s://prod/decode:http",
                   "--discover", "k8s://prod/prefill:8100", "--discover", "k8s://prod/pp",
                   "--discover-interval", "2.5", "--kubeconfig", "/k/config"])
    dns, named, numbered, bare = cfg.discovery.targets
    assert (dns.scheme, dns.host, dns.port, dns.uri) == ("dns", "decode", 8200,
                                                         "dns://decode:8200")
    assert (named.namespace, named.service, named.port_name, named.port) == (
        "prod", "decode", "http", None)
    assert (numbered.port_name, numbered.port) == (None, 8100)
    assert (bare.service, bare.port_name, bare.port) == ("pp", None, None)
    assert cfg.discovery.interval_s == 2.5 and cfg.discovery.kubeconfig == "/k/config"
    assert _config([], {"KUBECONFIG": "/env/k"}).discovery.kubeconfig == "/env/k"
    assert _config([]).discovery.targets == ()
    for bad, expected in (("decode:8200", "expected dns://"), ("dns://decode", "dns://NAME:PORT"),
                          ("dns://decode:http", "dns://NAME:PORT"),
                          ("dns://decode:8200/x", "dns://NAME:PORT"),
                          ("http://decode:8200", "expected dns://"),
                          ("k8s://decode", "k8s://NAMESPACE/SERVICE"),
                          ("k8s://Prod/decode", "k8s://NAMESPACE/SERVICE"),
                          ("k8s://prod/decode:0", "k8s://NAMESPACE/SERVICE")):
        with pytest.raises(ValueError, match=expected):
            _config(["--discover", bad])
    with pytest.raises(ValueError, match="twice"):
        _config(["--discover", "dns://d:1", "--discover", "dns://d:1"])
    with pytest.raises(ValueError, match="interval"):
        _config(["--discover", "dns://d:1", "--discover-interval", "0"])
