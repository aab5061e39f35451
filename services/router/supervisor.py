"""Child-process supervision for `pdmesh up`: start, stream logs, restart, stop without orphans.

Each child runs in its own session (process group), so a signal reaches everything it spawned,
and a terminal's Ctrl-C reaches only the supervisor, which then stops children in order:
SIGTERM to each group, a grace period, SIGKILL to what is left. On Linux each child also gets
PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no worker behind.

Once the mesh is up, a child that exits (a worker whose engine failed exits 1 on purpose) is
started again with the same argv after an exponential backoff (`RestartPolicy`), and each
restart is announced on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import ssl
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import aiohttp

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class ChildSpec:
    """One process to run: a log prefix and its argv."""

    name: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff for restarting an exited child: `initial_s`, doubled on each consecutive
    restart, at most `max_s`. A child that ran `reset_after_s` or longer counts as having
    recovered: its next restart waits `initial_s` again."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"restart delays need 0 < initial ({self.initial_s}) <= max "
                             f"({self.max_s})")

    def delay(self, consecutive: int) -> float:
        """Seconds before restart number `consecutive` (1-based) of a crash loop."""
        return min(self.max_s, self.initial_s * 2.0 ** (consecutive - 1))


@dataclass
class Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    pump: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.monotonic)
    crash_loop: int = 0  # consecutive restarts without a run of reset_after_s


class Supervisor:
    """Runs children, prefixes their output with their name, and stops them all."""

    def __init__(self, specs: Sequence[ChildSpec], out: TextIO = sys.stdout,
                 grace_s: float = 10.0, err: TextIO = sys.stderr) -> None:
        self._specs = list(specs)
        self._out = out
        self._err = err
        self._grace_s = grace_s
        self._width = max((len(s.name) for s in self._specs), default=0)
        self.children: list[Child] = []

    def say(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def warn(self, line: str) -> None:
        self._err.write(line + "\n")
        self._err.flush()

    async def start(self) -> None:
        for spec in self._specs:
            self.children.append(await self._spawn(spec))

    async def _spawn(self, spec: ChildSpec) -> Child:
        proc = await asyncio.create_subprocess_exec(
            *spec.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent)
        child = Child(spec, proc)
        child.pump = asyncio.create_task(self._pump(child, spec.name.ljust(self._width)))
        self.say(f"[up] started {spec.name} (pid {proc.pid}): {' '.join(spec.argv)}")
        return child

    async def _pump(self, child: Child, prefix: str) -> None:
        assert child.proc.stdout is not None
        async for raw in child.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            child.tail.append(line)
            self.say(f"[{prefix}] {line}")

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.proc.returncode is not None), None)

    async def wait_healthy(self, url: str, timeout_s: float,
                           ssl_context: ssl.SSLContext | None = None) -> bool:
        """Poll `url` until it answers 200; False on timeout or if a child exits first
        (an https `url` is verified with `ssl_context`)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2),
                                         connector=connector) as session:
            while asyncio.get_running_loop().time() < deadline:
                if self.exited() is not None:
                    return False
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return True
                await asyncio.sleep(0.5)
        return False

    async def supervise(self, stop: asyncio.Event, policy: RestartPolicy) -> None:
        """Until `stop` is set: restart every child that exits, with `policy`'s backoff."""
        keepers = [asyncio.create_task(self._keep_alive(i, stop, policy))
                   for i in range(len(self.children))]
        try:
            await stop.wait()
        finally:
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)

    async def _keep_alive(self, index: int, stop: asyncio.Event, policy: RestartPolicy) -> None:
        while not stop.is_set():
            child = self.children[index]
            code = await child.proc.wait()
            if stop.is_set():
                return
            ran = time.monotonic() - child.started_at
            crash_loop = 1 if ran >= policy.reset_after_s else child.crash_loop + 1
            delay = policy.delay(crash_loop)
            self.warn(f"[up] {child.spec.name} exited with {code} after {ran:.1f}s; restarting "
                      f"in {delay:.1f}s (restart {crash_loop} in a row)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
                return  # stopping: no restart
            try:
                fresh = await self._spawn(child.spec)
            except OSError as exc:  # retried after the next, longer delay
                self.warn(f"[up] could not restart {child.spec.name}: {exc}")
                child.crash_loop, child.started_at = crash_loop, time.monotonic()
                continue
            fresh.crash_loop = crash_loop
            self.children[index] = fresh

    async def stop(self) -> None:
        """SIGTERM every group (the router first), wait the grace period, SIGKILL the rest."""
        for child in self.children:
            _signal_group(child.proc, signal.SIGTERM)
        waits = [asyncio.ensure_future(c.proc.wait()) for c in self.children]
        _, pending = await asyncio.wait(waits, timeout=self._grace_s) if waits else ((), ())
        for child in self.children:
            if child.proc.returncode is None:
                self.say(f"[up] {child.spec.name} did not stop in {self._grace_s:.0f}s: killing")
            _signal_group(child.proc, signal.SIGKILL)  # also reaps stragglers in the group
        await asyncio.gather(*pending, return_exceptions=True)
        pumps = [c.pump for c in self.children if c.pump is not None]
        await asyncio.wait(pumps, timeout=2.0) if pumps else None


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    # The child leads its own session, so its pgid is its pid; signal the whole group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
