"""`pdmesh up` with stand-in workers: ready banner, a request through it, clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

FAKE_SERVE = Path(__file__).with_name("fake_serve.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_up(port: int) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", "fake-model", "--port", str(port),
           "--prefill", "1", "--decode", "2", "--ready-timeout", "60", "--grace", "5",
           "--serve-cmd", f"{sys.executable} {FAKE_SERVE}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "Ctrl-C stops everything" in line:
            return proc, lines
    proc.kill()
    raise AssertionError("pdmesh up never became ready:\n" + "\n".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_and_stops_every_child(sig):
    port = _free_port()
    proc, lines = _start_up(port)
    pids = [int(line.split("(pid ")[1].split(")")[0]) for line in lines if "[up] started" in line]
    assert len(pids) == 4  # router, 1 prefill, 2 decode
    text = "\n".join(lines)
    assert f"http://127.0.0.1:{port}" in text and "curl -s" in text and "OpenAI(" in text
    assert any(line.startswith("[prefill-0") for line in lines)  # children's logs, prefixed

    body = json.dumps({"model": "fake-model", "prompt": "up test", "max_tokens": 3}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.loads(resp.read())
    assert len(doc["choices"][0]["text"].split()) == 3

    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    for pid in pids:
        assert not _alive(pid), f"child {pid} outlived pdmesh up"


def test_up_fails_fast_when_a_worker_cannot_start():
    port = _free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--ready-timeout", "60",
           "--serve-cmd", f"{sys.executable} -c 'import sys; sys.exit(3)'"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "exited with 3" in proc.stdout
