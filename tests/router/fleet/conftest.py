"""The real worker processes the slow end-to-end router tests share (tests/support/real_mesh.py).

Only modules in this directory can take the `fleet` fixture, and the suite's xdist scheduler
(tests/conftest.py) hands this directory to one process as one unit: the fleet is six fp32
SmolLM2 workers (~4.5 GB), so a second process must never start a second one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

FLEET_START_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The shared real workers (tests.support.real_mesh.Fleet), started on first use; logs in a temp dir."""
    from tests.support.real_mesh import (
        Fleet,  # imports the worker stack: only the slow tests pay for it
    )

    fleet = Fleet.create(tmp_path_factory.mktemp("router-fleet"))
    try:
        yield fleet.start(FLEET_START_TIMEOUT_S)
    finally:
        fleet.stop()
