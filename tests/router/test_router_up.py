"""`pdmesh up`: ready banner, a chat request through it, clean stop with no child left behind.
Once on the embedded SmolLM2 (the README's run command as it is), and with stand-in workers for
the signal and start-failure cases."""

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
from pd_harness import free_port

FAKE_SERVE = Path(__file__).with_name("fake_serve.py")
ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


FAKE_UP = ("--model", "fake-model", "--prefill", "1", "--decode", "2", "--ready-timeout", "60",
           "--grace", "5", "--serve-cmd", f"{sys.executable} {FAKE_SERVE}")


def _start_up(port: int, *args: str, timeout: float = 60) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
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


def _chat(port: int, content: str, max_tokens: int, model: str) -> str:
    body = json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def _child_pids(lines: list[str]) -> list[int]:
    return [int(line.split("(pid ")[1].split(")")[0]) for line in lines if "[up] started" in line]


def _stop(proc: subprocess.Popen, sig: signal.Signals, pids: list[int]) -> None:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    for pid in pids:
        assert not _alive(pid), f"child {pid} outlived pdmesh up"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_up_on_the_embedded_model_answers_a_chat_and_stops_clean():
    """The README's run command: 1 prefill + 1 decode on SmolLM2 behind the router."""
    port = free_port()
    proc, lines = _start_up(port, "--threads", "1", "--ready-timeout", "300", timeout=320)
    try:
        pids = _child_pids(lines)
        assert len(pids) == 3  # router, 1 prefill, 1 decode
        answer = _chat(port, "What is the capital of France?", 24, "smollm2-135m-instruct")
        assert "Paris" in answer
    except BaseException:
        proc.kill()
        raise
    _stop(proc, signal.SIGINT, pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_and_stops_every_child(sig):
    port = free_port()
    proc, lines = _start_up(port, *FAKE_UP)
    pids = _child_pids(lines)
    assert len(pids) == 4  # router, 1 prefill, 2 decode
    text = "\n".join(lines)
    assert f"http://127.0.0.1:{port}" in text and "curl -s" in text and "OpenAI(" in text
    assert any(line.startswith("[prefill-0") for line in lines)  # children's logs, prefixed

    assert len(_chat(port, "up test", 3, "fake-model").split()) == 3
    _stop(proc, sig, pids)


def test_up_fails_fast_when_a_worker_cannot_start():
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--ready-timeout", "60",
           "--serve-cmd", f"{sys.executable} -c 'import sys; sys.exit(3)'"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "exited with 3" in proc.stdout
