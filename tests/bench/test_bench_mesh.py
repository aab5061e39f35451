"""`pdmesh bench` against a real local mesh (`pdmesh up`: router + workers, tiny random model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


@pytest.fixture(scope="module")
def mesh_url(tmp_path_factory: pytest.TempPathFactory):
    model = tmp_path_factory.mktemp("bench-mesh") / "tiny"
    subprocess.run(_cli("make-model", str(model), "--preset", "tiny", "--arch", "llama",
                        "--seed", "0", "--untied"), cwd=ROOT, check=True, capture_output=True)
    port = free_port()
    # Output to a file, not a pipe nobody reads: the router logs every request (the health
    # polls too), and once a 64 KiB pipe is full `up` blocks relaying it, and with it the mesh
    # (this fixture once took 92 s to start and 40 s to stop, then a SIGKILL).
    log_path = model.parent / "up.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(_cli("up", "--model", str(model), "--port", str(port),
                                 "--threads", "1", "--ready-timeout", "120"),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        else:
            raise AssertionError("the mesh never became healthy")
        yield url, model
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_bench_against_local_mesh(mesh_url, tmp_path: Path) -> None:
    url, model = mesh_url
    result = tmp_path / "mesh.json"
    out = subprocess.run(
        _cli("bench", "--base-url", url, "--model", str(model), "--endpoint", "/v1/completions",
             "--dataset", "random", "--input-len", "40", "--output-len", "8", "--num-prompts",
             "8", "--max-concurrency", "4", "--request-rate", "inf", "--ignore-eos",
             "--seed", "1", "--percentiles", "50,99", "--no-progress",
             "--save-result", str(result)),
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    data = json.loads(result.read_text())
    assert (data["schema"], data["version"], data["partial"]) == ("pdmesh.bench.result", 1, False)
    assert (data["completed"], data["failed"]) == (8, 0)
    assert data["total_output_tokens"] == 8 * 8
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for key in ("mean", "median", "std", "p50", "p99"):
            assert data[f"{key}_{metric}_ms"] >= 0.0
    reqs = data["requests"]
    assert len(reqs) == 8 and all(r["status"] == "ok" and r["output_tokens"] == 8 for r in reqs)
    # the router's per-request phase report reached the bench
    assert data["phases"], data.keys()
