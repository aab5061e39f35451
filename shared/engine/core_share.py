"""CoreShare: sibling workers on one host lend each other their threads while idle.

`pdmesh up` on one box splits the cores between a prefill and a decode worker, so each alone
runs at half the machine: a long prompt prefills on one core of two while the decode worker
waits for it, and the decode then streams on one core while the prefill worker has nothing to
do. A CoreShare fixes that without oversubscribing: each engine keeps its own share of threads
(`base`), and adds the shares of the siblings that are idle right now.

The siblings meet in one small file (a "ledger", /dev/shm when `up` makes it): a fixed array
of slots, one per live engine, each

    pid   int32   the owner (0: free; a slot whose pid no longer exists is idle and reusable)
    base  int32   its own share of threads
    busy  int32   1 from the step that has work until the step after which it has none

An engine claims a slot under an exclusive flock (the only write that needs it), then writes
only its own `busy` word: an aligned 4-byte store, which x86 and arm64 make atomic, read
without a lock by the others.

Invariant, between steps: an engine runs `base + sum(base of idle siblings)` threads, never
more than the shares registered. Two engines that turn busy at once may both see the other
idle; that oversubscription lasts one step of each at most, because the next step re-reads the
ledger. A step is the unit: threads never change inside one, so a borrowed step that is long
(a 2,048-token prefill chunk) keeps its threads until it ends.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

SLOTS = 64
_SLOT = struct.Struct("<iii4x")  # pid, base, busy, padding: 16 bytes per slot
_SIZE = SLOTS * _SLOT.size
_BUSY_OFFSET = 8  # of the busy word inside a slot


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


class CoreShare:
    """This engine's slot in a host's core ledger: `claim()` before a step that has work
    returns the threads to run it on (own share plus idle siblings'), `release()` after the
    step that leaves the engine without work lends the share out again."""

    def __init__(self, path: Path, base_threads: int) -> None:
        if base_threads < 1:
            raise ValueError(f"a core share needs >= 1 thread of its own, got {base_threads}")
        self.path, self.base = path, base_threads
        self.pid = os.getpid()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < _SIZE:
                    os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
                self.slot = self._take_slot()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)  # the mapping keeps the file
        self._busy = False
        self.borrowed_steps = 0  # steps run on more threads than our own share

    def _take_slot(self) -> int:
        for i in range(SLOTS):
            pid, _, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self.pid, self.base, 0)
                return i
        raise RuntimeError(f"core share {self.path}: all {SLOTS} slots are taken")

    def _set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            struct.pack_into("<i", self._map, self.slot * _SLOT.size + _BUSY_OFFSET, int(busy))
            self._busy = busy

    def lendable(self) -> int:
        """Threads the idle (or dead) siblings lend now."""
        spare = 0
        for i in range(SLOTS):
            if i == self.slot:
                continue
            pid, base, busy = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid != 0 and (not busy or not _alive(pid)):
                spare += base
        return spare

    def claim(self) -> int:
        """Mark this engine busy (first, so a sibling claiming now sees it) and return the
        threads for the coming step."""
        self._set_busy(True)
        threads = self.base + self.lendable()
        if threads > self.base:
            self.borrowed_steps += 1
        return threads

    def release(self) -> None:
        """This engine has no work: its share is the siblings' until the next claim."""
        self._set_busy(False)

    def close(self) -> None:
        """Free the slot (its share leaves the ledger)."""
        if self._map.closed:
            return
        _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0, 0)
        self._map.close()
