"""Stages on their own addresses (and network namespaces): the config, the flags, and a real
PP=2 run whose stage 1 binds gloo to 127.0.0.2 while rank 0 stays on 127.0.0.1.

The two-host benchmark (benchmarks/two_hosts.py) uses the same fields with a veth pair between
two network namespaces; the tests keep to loopback aliases and never create a namespace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shared.pipeline.config import PipelineConfig, add_arguments, from_args
from shared.pipeline.facades import PipelineLLM
from shared.pipeline.netns import NETNS_DIR, enter_netns, netns_path
from tests.support.engine import random_prompts
from tests.support.pipeline import greedy, pipeline_config, reference

LISTEN = "0A"


def test_bind_addr_per_rank() -> None:
    config = PipelineConfig(pp_size=3, master_addr="10.0.0.1", stage_addrs=("10.0.0.2", "10.0.0.3"))
    assert [config.bind_addr(r) for r in range(3)] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    same_host = PipelineConfig(pp_size=3, master_addr="10.0.0.1")
    assert [same_host.bind_addr(r) for r in range(3)] == ["10.0.0.1"] * 3
    with pytest.raises(ValueError, match="outside"):
        config.bind_addr(3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pp_size": 3, "stage_addrs": ("10.0.0.2",)}, "name 1 stages"),
    ({"pp_size": 2, "stage_addrs": ("a", "b")}, "name 2 stages"),
    ({"pp_size": 2, "stage_netns": "../etc"}, "ip netns"),
    ({"pp_size": 2, "stage_netns": ""}, "ip netns"),
])
def test_bad_stage_placement_is_rejected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**kwargs)


def test_flags_build_the_placement() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = from_args(parser.parse_args([
        "--pp-size", "3", "--pp-master-addr", "10.77.0.1",
        "--pp-stage-addrs", "10.77.0.2, 10.77.0.3", "--pp-stage-netns", "pdm-b"]))
    assert config == PipelineConfig(pp_size=3, master_addr="10.77.0.1",
                                    stage_addrs=("10.77.0.2", "10.77.0.3"), stage_netns="pdm-b")
    assert from_args(parser.parse_args([])).stage_addrs == ()


def test_netns_names_map_to_run_netns() -> None:
    assert netns_path("pdm-b") == NETNS_DIR / "pdm-b"
    with pytest.raises(ValueError):
        netns_path("a/b")


def test_entering_a_missing_namespace_raises() -> None:
    with pytest.raises(OSError):
        enter_netns("pdmesh-test-no-such-namespace")


def listening_v4(addr_hex: str) -> int:
    """How many sockets listen on the given little-endian hex IPv4 address."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.split()[1].split(":")[0] == addr_hex and r.split()[3] == LISTEN)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_a_stage_on_its_own_address_gives_the_same_tokens(small_ckpt) -> None:
    prompts, params = random_prompts([9, 5]), [greedy(6)] * 2
    expected = reference(small_ckpt, prompts, params)
    before = listening_v4("0200007F")  # 127.0.0.2
    llm = PipelineLLM(model=str(small_ckpt), pp_size=2, num_threads=1,
                      kv_cache_memory_bytes=4 << 20,
                      pipeline=pipeline_config(2, stage_addrs=("127.0.0.2",)))
    try:
        assert listening_v4("0200007F") > before  # stage 1's gloo device, on its own address
        outs = llm.generate(prompts, params)
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [expected[i].token_ids for i in range(len(prompts))]
