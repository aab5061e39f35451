"""`pdmesh serve --pp-size 2`: the HTTP worker over a pipeline gives PP=1's greedy tokens."""

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

from shared.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog and then"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_pp2_worker_matches_single_process(small_ckpt: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(small_ckpt)).generate(PROMPTS, params)]
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", str(small_ckpt),
         "--pp-size", "2", "--port", str(port), "--threads", "1", "--log-level", "WARNING"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "PP worker never became healthy"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        got = _post(url + "/v1/completions", {
            "model": str(small_ckpt), "prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        by_index = sorted(got["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in by_index] == expected
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
