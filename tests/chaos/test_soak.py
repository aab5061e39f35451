"""benchmarks/soak.py for 45 seconds on `pdmesh up` with a tiny model: mixed load (short and long
prompts, streamed and not, aborts, n=2), then the soak's goals checked against the samples it
took of every process: RSS drift under 5% after warm-up, open fds and asyncio tasks flat, no
KV block held at the end, no request hung or cut without an error.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
with mock.patch.object(sys, "path", [str(BENCHMARKS), *sys.path]):
    soak: ModuleType = importlib.import_module("soak")


@pytest.mark.timeout(400)
def test_soak_meets_its_goals(make_checkpoint: Callable[..., Path],
                                         tmp_path: Path) -> None:
    model = make_checkpoint(preset="tiny", seed=0)
    args = soak.parse_args(["--model", str(model), "--duration", "45s", "--warmup", "15s",
                            "--interval", "15s", "--settle", "5s", "--keepalive", "1s",
                            "--clients", "4", "--ready-timeout", "300"])
    result = asyncio.run(soak.soak(args, tmp_path))

    # The mix ran: completions and client aborts both happened.
    assert result.outcomes.get("completed", 0) > 0 and result.outcomes.get("closed", 0) > 0, (
        result.outcomes)
    # Every process was sampled at both ends, asyncio tasks included (pdmesh:asyncio_tasks).
    names = {s.name for s in result.final}
    assert "router" in names and any(n.startswith("prefill-") for n in names) and any(
        n.startswith("decode-") for n in names), names
    assert {s.name for s in result.warm} == names
    assert all(s.tasks is not None and s.tasks > 0 for s in result.warm + result.final)
    assert result.samples, "no periodic sample was taken"
    assert result.missed == [], result.missed
