"""Fixtures for the P/D tests: tiny random models and a mesh of in-process workers.

The workers are started once per session (each costs ~0.5 s once torch is warm) and shared by
every test; tests leave them holding no blocks, which each test checks for itself. The
subprocess workers of the kill tests are launched at session start, only when those tests
were collected, so their start-up overlaps the other tests (when run serially).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker.config import KVLoadFailurePolicy
from tests.support.pd_mesh import (
    KILL_LEASE_S,
    SHORT_LEASE_S,
    Mesh,
    ProcessPair,
    make_model,
    serve_args,
    worker_config,
)
from tests.support.worker import SubprocessWorker, start_workers, stop_all


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("pd") / "tiny", seed=0)


@pytest.fixture(scope="session")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape, different weights (another seed): a different weights fingerprint."""
    return make_model(tmp_path_factory.mktemp("pd") / "tiny-other", seed=1)


@pytest.fixture(scope="session")
def mesh(tiny_model: Path, other_model: Path) -> Iterator[Mesh]:
    configs = {
        "mixed": worker_config(tiny_model, "mixed"),
        "prefill": worker_config(tiny_model, "prefill"),
        "decode": worker_config(tiny_model, "decode"),
        # Chunks of 128 tokens: a long prompt's blocks stream to the decode as computed.
        "push_prefill": worker_config(tiny_model, "prefill", "push",
                                      max_num_batched_tokens=128),
        "push_decode": worker_config(tiny_model, "decode", "push"),
        "short_lease_prefill": worker_config(tiny_model, "prefill", lease=SHORT_LEASE_S),
        "recompute_decode": worker_config(tiny_model, "decode",
                                          policy=KVLoadFailurePolicy.RECOMPUTE),
        "other_decode": worker_config(other_model, "decode"),
    }
    workers = start_workers(configs)
    try:
        yield Mesh(**workers)
    finally:
        stop_all(workers)


@pytest.fixture(scope="session")
def process_pair(tiny_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessPair]:
    logs = tmp_path_factory.mktemp("pd-logs")
    pair = ProcessPair(
        SubprocessWorker(serve_args(tiny_model, "prefill", "--kv-lease-seconds",
                                    str(KILL_LEASE_S)), logs / "prefill.log"),
        SubprocessWorker(serve_args(tiny_model, "decode"), logs / "decode.log"))
    try:
        yield pair
    finally:
        pair.prefill.stop()
        pair.decode.stop()


@pytest.fixture(scope="session", autouse=True)
def _early_process_pair(request: pytest.FixtureRequest) -> None:
    """Launch the kill tests' processes first thing, if any kill test is collected. Not under
    xdist: every process collects every test, so each would launch a pair it may never use;
    there the first kill test starts them."""
    if hasattr(request.config, "workerinput"):
        return
    if any("process_pair" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("process_pair")
