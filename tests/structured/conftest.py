"""Fixtures for the structured-output tests: in-process workers on a tiny random model
(mixed, a pull pair and a push pair), started once for the HTTP and P/D tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pd_mesh import make_model, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("structured") / "tiny", seed=0)


@pytest.fixture(scope="session")
def workers(tiny_untied: Path) -> Iterator[dict[str, WorkerThread]]:
    configs = {"mixed": worker_config(tiny_untied, "mixed"),
               "prefill": worker_config(tiny_untied, "prefill"),
               "decode": worker_config(tiny_untied, "decode"),
               "push_prefill": worker_config(tiny_untied, "prefill", "push"),
               "push_decode": worker_config(tiny_untied, "decode", "push")}
    started = start_workers(configs)
    try:
        yield started
    finally:
        stop_all(started)
