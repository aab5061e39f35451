"""`pdmesh serve --pp-size 2`: the HTTP worker over a pipeline gives PP=1's greedy tokens, and a
stage that dies ends the worker process with status 1 (after failing its requests) so that
its supervisor starts a fresh one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shared.engine import LLM, SamplingParams
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog and then"]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_pp2_worker_matches_single_process(small_ckpt: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(small_ckpt)).generate(PROMPTS, params)]
    port = free_port()
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


def _stage_processes(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc, Linux) but multiprocessing's resource tracker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid and b"resource_tracker" not in cmdline:
            found.append(int(stat.parent.name))
    return found


def _start_pp_worker(ckpt: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", str(ckpt), "--pp-size", "2",
         "--port", str(port), "--threads", "1", "--log-level", "WARNING",
         "--served-model-name", "m", "--engine-failure-drain-seconds", "20"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "PP worker never became healthy"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)


def test_pp_worker_exits_1_when_a_stage_dies(small_ckpt: Path) -> None:
    port = free_port()
    proc = _start_pp_worker(small_ckpt, port)
    try:
        body = json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 400, "stream": True,
                           "ignore_eos": True, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.readline()  # generating
            stages = _stage_processes(proc.pid)
            assert stages, "the PP worker has no child processes"
            for child in stages:
                os.kill(child, signal.SIGKILL)
            raw = resp.read()  # the stream ends (no hang): an error event, then [DONE]
        assert raw.endswith(b"data: [DONE]\n\n") and b'"engine_failed"' in raw
        assert proc.wait(timeout=60) == 1
        log = proc.stderr.read().decode()
        # One traceback (a chained one prints two headers), in the engine thread's record.
        before, died, after = log.partition("engine thread died")
        assert died and "engine thread died" not in after and "Traceback" not in before, log
        assert "exits with status 1" in after
        assert "Traceback" not in after.split("exits with status 1", 1)[1], log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_group_sigterm_stops_the_pp_worker_cleanly(small_ckpt: Path) -> None:
    """A SIGTERM to the whole process group (Ctrl-C, `kill -- -pgid`, a container stop)
    reaches the stages too. They leave their lifetime to rank 0, so the worker still drains
    and exits 0; here a stage gets its SIGTERM first, the order that used to race."""
    port = free_port()
    proc = _start_pp_worker(small_ckpt, port)
    try:
        stages = _stage_processes(proc.pid)
        assert stages, "the PP worker has no child processes"
        for child in stages:
            os.kill(child, signal.SIGTERM)
        time.sleep(1.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200  # the stages took no notice
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=40) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
