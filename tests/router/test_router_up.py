"""`pdmesh up`: ready banner, a chat request through it, clean stop with no child left behind.
Once on the embedded SmolLM2 (the README's run command as it is), and with stand-in workers for
the signal and start-failure cases."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pydantic
import pytest

from services.router.supervisor import RestartPolicy
from tests.support.net import free_port

# Run from ROOT: the `up` process's cwd, which what it spawns inherits.
FAKE_SERVE = "-m tests.support.fake_serve"
ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


FAKE_UP = ("--model", "fake-model", "--prefill", "1", "--decode", "2", "--ready-timeout", "60",
           "--grace", "5", "--serve-cmd", f"{sys.executable} {FAKE_SERVE}")


def _start_up(port: int, *args: str, timeout: float = 60,
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
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


class _Capital(pydantic.BaseModel):
    country: str = pydantic.Field(max_length=30)
    capital: str = pydantic.Field(max_length=30)


def _check_sdk_parse(port: int) -> None:
    """The openai SDK's `parse(response_format=<pydantic model>)` gets its object back."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    reply = client.chat.completions.parse(
        model="smollm2-135m-instruct", response_format=_Capital, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, _Capital) and parsed.capital


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
        _check_sdk_parse(port)  # structured output through P/D, as an agent client asks it
        from services.commands.up import core_share_file

        ledgers = list(core_share_file().parent.glob(f"pdmesh-cores-{proc.pid}-*"))
        assert len(ledgers) == 1  # the workers' shared core ledger
    except BaseException:
        proc.kill()
        raise
    _stop(proc, signal.SIGINT, pids)
    assert not ledgers[0].exists()  # up removes it


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


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_up_gives_its_mesh_one_generated_kv_secret_never_shown():
    """Regression ("the KV channel is open by default"): with no PDMESH_KV_SECRET, `up` makes
    one random secret and hands it to every child through the environment: the same for all,
    on no command line, in no output line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_KV_SECRET")}
    port = free_port()
    proc, lines = _start_up(port, *FAKE_UP, env=env)
    pids = _child_pids(lines)
    try:
        secrets = {_environ(pid).get("PDMESH_KV_SECRET") for pid in pids}
        (secret,) = secrets  # one value, shared by the router and every worker
        assert secret is not None and re.fullmatch(r"[0-9a-f]{64}", secret)
        assert any("generated a random KV secret" in line for line in lines)
        assert all(secret not in _cmdline(pid) for pid in pids)
        assert len(_chat(port, "up test", 3, "fake-model").split()) == 3
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert secret not in out and all(secret not in line for line in lines)  # never printed


def test_up_fails_fast_when_a_worker_cannot_start():
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--ready-timeout", "60",
           "--serve-cmd", f"{sys.executable} -c 'import sys; sys.exit(3)'"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "exited with 3" in proc.stdout


def test_restart_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(initial_s=0.5, max_s=3.0)
    assert [policy.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(initial_s=2.0, max_s=1.0)


class Lines:
    """The rest of a process's output, read on a thread so every wait is bounded."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line.rstrip())

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if (match := re.search(pattern, line)) is not None:
                return match
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.seen[-40:]))


def _wait_http_ok(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered 200"
        time.sleep(0.1)


def test_up_restarts_a_child_that_exits_with_backoff():
    """A worker killed twice is started again each time (same argv), after 0.2 s then 0.4 s,
    and says so; the mesh serves through the restarted worker, and stops clean."""
    port = free_port()
    proc, lines = _start_up(port, *FAKE_UP, "--restart-delay", "0.2", "--restart-max-delay", "5")
    out = Lines(proc)
    pids = _child_pids(lines)
    try:
        (decode,) = [line for line in lines if "[up] started decode-1" in line]
        decode_pid = int(decode.split("(pid ")[1].split(")")[0])
        decode_port = decode.split("--port ")[1].split()[0]
        for attempt, delay in ((1, "0.2"), (2, "0.4")):
            killed = decode_pid
            os.killpg(killed, signal.SIGKILL)
            out.wait_for(rf"\[up\] decode-1 exited with -9 after [0-9.]+s; restarting in "
                         rf"{delay}s \(restart {attempt} in a row\)")
            decode_pid = int(out.wait_for(r"\[up\] started decode-1 \(pid (\d+)\)").group(1))
            assert not _alive(killed) and decode_pid not in pids
            pids.append(decode_pid)
        _wait_http_ok(f"http://127.0.0.1:{decode_port}/health")
        for i in range(3):  # the router uses the restarted worker again
            assert len(_chat(port, f"after restart {i}", 3, "fake-model").split()) == 3
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for pid in pids:
        assert not _alive(pid), f"child {pid} outlived pdmesh up"


def test_worker_arg_reaches_every_worker_and_router_arg_the_router():
    import argparse

    from services.commands import serve, up
    from services.worker.config import WorkerConfig

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--worker-arg=--kv-keepalive-seconds=2",
                              "--router-arg=--upstream-keepalive-seconds=3"])
    worker = argparse.ArgumentParser()
    serve.add_arguments(worker)
    for role in ("prefill", "decode"):
        flags = up.worker_flags(role, args, 8102, 9102, 1)
        config = WorkerConfig.from_args(worker.parse_args(flags), {})
        assert config.kv is not None and config.kv.keepalive_s == 2
    args.serve_cmd = "serve"  # skips the preflight run of a real worker
    router, *workers = up.plan(args, 2)[0]
    assert "--upstream-keepalive-seconds=3" in router.argv
    assert all("--kv-keepalive-seconds=2" in w.argv and "--upstream-keepalive-seconds=3"
               not in w.argv for w in workers) and len(workers) == 2


def test_up_gives_every_worker_one_core_ledger_unless_told_not_to(tmp_path):
    """The workers on up's box share a core ledger (shared/engine/core_share.py); each parses
    it into its EngineConfig. `--no-core-share` leaves them on their own threads."""
    import argparse

    from services.commands import serve, up
    from services.worker.config import WorkerConfig

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    worker = argparse.ArgumentParser()
    serve.add_arguments(worker)
    args = parser.parse_args(["--model", "m", "--serve-cmd", "serve"])
    args.core_share_file = up.core_share_file()
    assert not args.core_share_file.exists()  # made by the first worker, removed by up
    _, *workers = up.plan(args, 2)[0]
    for w in workers:
        flags = list(w.argv[1:])
        assert flags[flags.index("--core-share") + 1] == str(args.core_share_file)
        config = WorkerConfig.from_args(worker.parse_args(flags), {})
        assert config.engine.core_share == args.core_share_file
        assert config.engine.num_threads == 1
    assert parser.parse_args(["--no-core-share"]).no_core_share
    args.core_share_file = None  # what run() leaves with --no-core-share
    _, *plain = up.plan(args, 2)[0]
    assert len(plain) == 2 and all("--core-share" not in w.argv for w in plain)
