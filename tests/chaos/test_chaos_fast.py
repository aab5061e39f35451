"""The fast subset of the chaos matrix (benchmarks/chaos.py) on a real mesh of tiny models:
one router, two prefills, two decodes, one KV secret, the first prefill's KV listener behind
the harness's fault-injecting proxy.

Faults, each while 16 streams are in flight: kill -9 a decode, SIGSTOP a decode for 3 s,
reset KV connections in the middle of a pull (3 times), close the client after 2 tokens (10
times). What must hold today, for every fault: no stream hangs past the hard client timeout,
no stream is cut without an error event, every stream either completes or gets an error, and
no KV block stays in use on any worker once the leases expired. A killed or stopped worker
leaves the router's rotation and comes back once it is up again.

The mesh runs once for the module (about a minute on 2 busy cores); each test checks one row.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# The scripts import each other by bare name: benchmarks/ leads sys.path while they load only
# (benchmarks/kernels.py must not shadow the kernels package later; see tests/bench).
with mock.patch.object(sys, "path", [str(BENCHMARKS), *sys.path]):
    chaos: ModuleType = importlib.import_module("chaos")
    chaos_mesh: ModuleType = importlib.import_module("chaos_mesh")

FAULTS = ["client_close", "cut_kv", "stop_decode", "kill_decode"]
CONFIG = chaos.ChaosConfig(concurrency=16, max_tokens=64, hard_timeout_s=30.0, stop_s=3.0,
                           client_closes=10, cuts=3, detect_timeout_s=15.0)


@pytest.fixture(scope="module")
def rows(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
         ) -> dict[str, Any]:
    spec = chaos_mesh.MeshSpec(
        str(make_checkpoint(preset="tiny", seed=0)), dtype="float32", lease_s=3.0,
        worker_flags=("--kv-cache-memory", "16MiB"),
        # A short breaker cool-down: the killed decode is back in rotation within seconds.
        router_flags=("--breaker-cooldown", "1"), ready_timeout_s=180.0)
    log_dir = tmp_path_factory.mktemp("chaos-logs")
    result = asyncio.run(chaos.run(spec, CONFIG, FAULTS, log_dir))
    return {row.fault: row for row in result}


def _accounted(row: Any) -> None:
    """No stream hung or was cut silently; each completed, failed with an error, or was closed
    by its client; and no KV block is held anywhere afterwards."""
    assert row.hung == 0, row
    assert row.broken == 0, row
    assert row.completed + row.failed + row.closed == row.sent, row
    assert all(b == 0 for b in row.blocks_after.values()), row.blocks_after


def test_kill9_decode_streams_end_with_an_error_and_the_router_reroutes(rows: dict) -> None:
    row = rows["kill_decode"]
    _accounted(row)
    assert row.sent == CONFIG.concurrency
    # The router noticed the dead decode, and took it back once it was up again.
    assert row.stop_routing_s is not None and row.route_again_s is not None, row


def test_kill9_decode_completed_equals_all(rows: dict) -> None:
    """Decode failover: every stream on the killed decode moves to the other one."""
    row = rows["kill_decode"]
    assert row.completed == row.sent, row


def test_sigstop_decode_streams_resolve_and_it_returns(rows: dict) -> None:
    row = rows["stop_decode"]
    _accounted(row)
    assert row.route_again_s is not None, row


def test_kv_connection_cut_mid_pull(rows: dict) -> None:
    row = rows["cut_kv"]
    assert row.injected == CONFIG.cuts, row  # the proxy did reset connections mid-body
    _accounted(row)


def test_client_closes_leave_no_blocks(rows: dict) -> None:
    row = rows["client_close"]
    assert row.closed == CONFIG.client_closes, row
    _accounted(row)
