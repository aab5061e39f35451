"""KVTransferConfig: flags and the one environment variable, validated once."""

from __future__ import annotations

import argparse
import socket

import pytest

from services.kv_transfer.config import KV_SECRET_ENV, KVTransferConfig, add_arguments
from tests.support.kv import FIRST, SECRET, prefill_request


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_from_args_reads_the_secret_from_the_given_environment_only() -> None:
    args = parse("--kv-port", "15000", "--kv-mode", "push", "--kv-allow-incompatible")
    cfg = KVTransferConfig.from_args(args, "decode", {KV_SECRET_ENV: SECRET.decode()})
    assert (cfg.port, cfg.mode, cfg.role, cfg.allow_incompatible) == (15000, "push", "decode", True)
    assert cfg.secret == SECRET and SECRET.decode() not in repr(cfg)
    plain = KVTransferConfig.from_args(parse(), "prefill", {})
    assert plain.secret is None and not plain.allow_incompatible and plain.lease_seconds == 30.0
    assert plain.heartbeat_interval_s == 5.0 and plain.lease_extension_s == 20.0


@pytest.mark.parametrize("bad", [
    {"role": "mixed"}, {"mode": "teleport"}, {"port": 70000}, {"lease_seconds": 0},
    {"max_chunk_bytes": 8 * 1024 * 1024}, {"secret": b"short"}, {"advertise_port": 0},
    {"advertise_port": 70000},
])
def test_invalid_settings_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        KVTransferConfig(**bad)


async def test_signed_pull_end_to_end(nodes) -> None:
    p, d = await nodes("prefill", secret=SECRET), await nodes("decode", secret=SECRET)
    ids = await prefill_request(p, "r", 20)
    params = await p.service.pull.prefill.offer("r", ids, 20, FIRST)
    kv = await d.service.pull.decode.fetch(params)
    assert kv.num_tokens == 20 and len(kv.block_ids) == len(ids)


def test_a_wildcard_bind_advertises_this_machines_own_address() -> None:
    """Replicas of a scaled service share its name; each must hand out its own address."""
    own = socket.gethostbyname(socket.gethostname())
    assert KVTransferConfig.from_args(parse("--kv-host", "0.0.0.0"), "prefill", {}
                                      ).public_host == own
    assert KVTransferConfig.from_args(parse(), "prefill", {}).public_host == "127.0.0.1"
    explicit = parse("--kv-host", "0.0.0.0", "--kv-advertise-host", "prefill-0.prefill")
    assert KVTransferConfig.from_args(explicit, "prefill", {}).public_host == "prefill-0.prefill"


def test_kv_advertise_port_flag() -> None:
    """A forwarder in front of the KV listener (the chaos harness's proxy) names its own port;
    without the flag the bound port is advertised (start_server; end to end: tests/chaos)."""
    assert KVTransferConfig.from_args(parse("--kv-port", "15000"), "prefill", {}
                                      ).advertise_port is None
    cfg = KVTransferConfig.from_args(parse("--kv-port", "15000", "--kv-advertise-port", "16000"),
                                     "prefill", {})
    assert (cfg.port, cfg.advertise_port) == (15000, 16000)
