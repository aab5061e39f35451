"""Child-process supervision for `pdmesh up`: start, stream logs, watch, stop without orphans.

Each child runs in its own session (process group), so a signal reaches everything it spawned,
and a terminal's Ctrl-C reaches only the supervisor, which then stops children in order:
SIGTERM to each group, a grace period, SIGKILL to what is left. On Linux each child also gets
PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no worker behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
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


@dataclass
class Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    pump: asyncio.Task[None] | None = None


class Supervisor:
    """Runs children, prefixes their output with their name, and stops them all."""

    def __init__(self, specs: Sequence[ChildSpec], out: TextIO = sys.stdout,
                 grace_s: float = 10.0) -> None:
        self._specs = list(specs)
        self._out = out
        self._grace_s = grace_s
        self.children: list[Child] = []

    def say(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    async def start(self) -> None:
        width = max(len(s.name) for s in self._specs)
        for spec in self._specs:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_parent)
            child = Child(spec, proc)
            child.pump = asyncio.create_task(self._pump(child, spec.name.ljust(width)))
            self.children.append(child)
            self.say(f"[up] started {spec.name} (pid {proc.pid}): {' '.join(spec.argv)}")

    async def _pump(self, child: Child, prefix: str) -> None:
        assert child.proc.stdout is not None
        async for raw in child.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            child.tail.append(line)
            self.say(f"[{prefix}] {line}")

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.proc.returncode is not None), None)

    async def wait_healthy(self, url: str, timeout_s: float) -> bool:
        """Poll `url` until it answers 200; False on timeout or if a child exits first."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while asyncio.get_running_loop().time() < deadline:
                if self.exited() is not None:
                    return False
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return True
                await asyncio.sleep(0.5)
        return False

    async def watch(self, stop: asyncio.Event) -> Child | None:
        """Until `stop` is set (None) or a child exits (that child)."""
        waits = {asyncio.ensure_future(c.proc.wait()): c for c in self.children}
        stopper = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait({*waits, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for fut in (*waits, stopper):
                fut.cancel()
        return None if stopper in done else self.exited()

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
